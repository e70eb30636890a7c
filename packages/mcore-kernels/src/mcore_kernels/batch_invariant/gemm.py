"""The batch-invariant GEMM kernels: a pointer kernel (dense, batched, grouped) and a TMA one.

A row of ``a @ b`` is reduced over ``K`` the same way whatever the number of rows ``M``: the
launch configuration (:class:`GemmConfig`) is chosen from ``(N, K, dtype)`` only, and no
integer that depends on ``M`` is specialised by the Triton compiler (``do_not_specialize``), so
every ``M`` runs the same binary.

- Tiles: ``BLOCK_M x BLOCK_N`` outputs per program, reduced over ``K`` in ascending
  ``BLOCK_K`` chunks into a float32 accumulator (``acc = dot(a, b, acc)``).
- Fixed split-K: with ``splits > 1`` the ``K`` range is cut into ``splits`` consecutive pieces
  of ``k_per_split`` (a multiple of ``BLOCK_K``, from ``K`` alone); each piece is reduced by its
  own program into a float32 partial, and :func:`_split_sum_kernel` adds the partials in
  ascending order (``((p0 + p1) + p2) + ...``) and rounds once. The order is the same for every
  row and every ``M``: split-K is only batch-dependent when the split is chosen from ``M``, as
  cuBLAS does. It gives skinny products (decode) enough programs when ``N`` is small and ``K``
  large (the MLP's down projection).
- TMA (Hopper and later): a persistent program walks its tiles with the bulk tensor copy engine
  loading both operands (host-built tensor descriptors, out-of-bounds reads as zero). Used for
  dense products whose operands are 16-byte aligned; an unaligned ``a`` is copied first, so the
  kernel a given ``(N, K)`` runs never depends on how the caller's tensor was sliced.

Under ``TRITON_INTERPRET=1`` the tile product is an explicit broadcast-multiply and sum
(``DOT=False``) because the interpreter's ``tl.dot`` goes through numpy's BLAS, whose rounding
depends on the row's position in the tile; the tiles and the order over ``K`` are the same.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from mcore_kernels._backend import _interpreting
from mcore_kernels._triton_utils import jit, round_to, tl, triton
from mcore_kernels.errors import KernelShapeError

__all__ = ["GemmConfig", "launch_gemm"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GemmConfig:
    """Launch configuration of the invariant GEMM (a function of ``(N, K, dtype)`` only)."""

    block_m: int
    """Output rows per tile."""
    block_n: int
    """Output columns per tile."""
    block_k: int
    """Depth of one step of the reduction over ``K``."""
    warps: int
    """Warps per program."""
    stages: int
    """Software-pipelining depth of the ``K`` loop."""
    splits: int = 1
    """Fixed split-K: consecutive ``K`` pieces reduced separately, summed in order."""
    tma: bool = False
    """Persistent kernel with TMA loads (dense products on Hopper or later)."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise KernelShapeError(f"{name}={value}; expected a power of two >= 16")
        if self.warps not in (1, 2, 4, 8, 16):
            raise KernelShapeError(f"warps={self.warps}; expected 1, 2, 4, 8 or 16")
        if self.stages < 1:
            raise KernelShapeError(f"stages={self.stages}; expected >= 1")
        if self.splits < 1:
            raise KernelShapeError(f"splits={self.splits}; expected >= 1")

    def k_per_split(self, depth: int) -> int:
        """Length of each split-K piece: ``depth / splits`` rounded up to ``block_k``.

        Args:
            depth: The reduction size ``K``.

        Returns:
            A multiple of ``block_k`` (``K`` rounded up when ``splits == 1``).
        """
        steps = -(-depth // self.block_k)
        return -(-steps // self.splits) * self.block_k


@jit(do_not_specialize=["rows_per_group", "stride_os"])
def _gemm_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    group_ends_ptr,
    rows_per_group,
    N,
    K,
    k_per_split,
    splits,
    stride_am,
    stride_ak,
    stride_bg,
    stride_bk,
    stride_bn,
    stride_os,
    stride_om,
    stride_on,
    VARIABLE_GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    DOT: tl.constexpr,
):
    group = tl.program_id(0)
    tile_m = tl.program_id(1)
    tile_n = tl.program_id(2) // splits
    split = tl.program_id(2) % splits
    if VARIABLE_GROUPS:
        end = tl.load(group_ends_ptr + group).to(tl.int64)
        previous = tl.load(group_ends_ptr + tl.maximum(group - 1, 0)).to(tl.int64)
        start = tl.where(group > 0, previous, 0)
    else:
        start = group.to(tl.int64) * rows_per_group
        end = start + rows_per_group
    first_row = start + tile_m * BLOCK_M
    if first_row < end:
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < end
        col_mask = cols < N
        depth = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        b_base = b_ptr + group.to(tl.int64) * stride_bg
        k_start = split * k_per_split
        k_end = tl.minimum(K, k_start + k_per_split)
        # NOTE: one ascending loop over this split's K range with a fixed BLOCK_K: a row's order
        # of additions is the same in every launch.
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + depth
            k_mask = ks < k_end
            a = tl.load(
                a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            b = tl.load(
                b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            if not DOT:
                acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
            elif IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        tl.store(
            out_ptr
            + split.to(tl.int64) * stride_os
            + rows[:, None] * stride_om
            + cols[None, :] * stride_on,
            round_to(acc, out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & col_mask[None, :],
        )


@jit(do_not_specialize=["M", "stride_os"])
def _gemm_tma_kernel(
    a_desc,
    b_desc,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    splits,
    stride_os,
    stride_om,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    DOT: tl.constexpr,
):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    total = tiles_m * tiles_n * splits
    for tile in range(tl.program_id(0), total, num_programs):
        # Consecutive tiles share the weight tile (tile_n) and walk the rows.
        split = tile % splits
        rest = tile // splits
        tile_m = rest % tiles_m
        tile_n = rest // tiles_m
        k_start = split * k_per_split
        k_end = tl.minimum(K, k_start + k_per_split)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            a = a_desc.load([tile_m * BLOCK_M, k0])
            b = b_desc.load([tile_n * BLOCK_N, k0])
            if not DOT:
                acc += tl.sum(a.to(tl.float32)[:, :, None] * tl.trans(b).to(tl.float32)[None], 1)
            elif IEEE:
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(
            out_ptr
            + split.to(tl.int64) * stride_os
            + rows[:, None].to(tl.int64) * stride_om
            + cols[None, :],
            round_to(acc, out_ptr.dtype.element_ty),
            mask=(rows[:, None] < M) & (cols[None, :] < N),
        )


@jit(do_not_specialize=["numel"])
def _split_sum_kernel(partial_ptr, out_ptr, numel, splits, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    acc = tl.load(partial_ptr + offsets, mask=mask, other=0.0)
    for split in range(1, splits):
        acc += tl.load(partial_ptr + split * numel + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, round_to(acc, out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=8)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and (t.stride(0) * size) % 16 == 0
        and t.data_ptr() % 16 == 0
        and t.shape[-1] * size >= 16
    )


def _tma_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(a, weight[N, K])`` ready for TMA, or None when ``b`` is not a transposed weight."""
    weight = b[0].t()
    if b.shape[0] != 1 or not _aligned(weight):
        return None
    if not _aligned(a):
        a = a.clone(memory_format=torch.contiguous_format)
        if not _aligned(a):
            return None
    return a, weight


def launch_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    group_ends: torch.Tensor | None,
    rows_per_group: int,
    config: GemmConfig,
) -> torch.Tensor:
    """Launch the invariant product ``a[rows of g] @ b[g]`` with ``config``.

    Args:
        a: ``[M, K]`` rows.
        b: ``[G, K, N]`` (any strides).
        group_ends: ``[G]`` device end row of each group, or None for groups of
            ``rows_per_group`` rows.
        rows_per_group: Rows of every group when ``group_ends`` is None.
        config: The launch configuration (chosen from ``(N, K, dtype)``).

    Returns:
        ``[M, N]`` in ``a.dtype``; rows after the last group end are not
        written (the reference returns zeros there).
    """
    num_rows, depth = a.shape
    groups, _, width = b.shape
    out = a.new_empty((num_rows, width))
    if num_rows == 0 or width == 0:
        return out
    if depth == 0:
        return out.zero_()
    k_per_split = config.k_per_split(depth)
    splits = -(-depth // k_per_split)
    target = out if splits == 1 else a.new_empty((splits, num_rows, width), dtype=torch.float32)
    interpreting = _interpreting()
    tma = None
    if config.tma and group_ends is None and groups == 1:
        tma = _tma_operands(a, b)
    if tma is not None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        rows_a, weight = tma
        a_desc = TensorDescriptor.from_tensor(rows_a, [config.block_m, config.block_k])
        b_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
        tiles = triton.cdiv(num_rows, config.block_m) * triton.cdiv(width, config.block_n) * splits
        programs = tiles if interpreting else min(tiles, _multiprocessors(a.device.index or 0))
        _gemm_tma_kernel[(programs,)](
            a_desc,
            b_desc,
            target,
            num_rows,
            width,
            depth,
            k_per_split,
            splits,
            num_rows * width,
            width,
            programs,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            IEEE=a.dtype == torch.float32,
            DOT=not interpreting,
            num_warps=config.warps,
            num_stages=config.stages,
        )
    else:
        rows_bound = num_rows if group_ends is not None else rows_per_group
        grid = (groups, triton.cdiv(rows_bound, config.block_m), triton.cdiv(width, config.block_n))
        _gemm_kernel[(grid[0], grid[1], grid[2] * splits)](
            a,
            b,
            target,
            group_ends if group_ends is not None else out,
            rows_per_group,
            width,
            depth,
            k_per_split,
            splits,
            a.stride(0),
            a.stride(1),
            b.stride(0),
            b.stride(1),
            b.stride(2),
            num_rows * width,
            width,
            1,
            VARIABLE_GROUPS=group_ends is not None,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            IEEE=a.dtype == torch.float32,
            DOT=not interpreting,
            num_warps=config.warps,
            num_stages=config.stages,
        )
    if splits > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(num_rows * width, block),)](
            target, out, num_rows * width, splits, BLOCK=block, num_warps=4
        )
    return out
