"""Batch-invariant GEMMs: every output row is computed the same way whatever the batch.

cuBLAS (and CPU BLAS) pick a different algorithm for a different number of rows ``M``: split-K
for a skinny matrix, another tile shape, a matrix-vector path for ``M = 1``. Each changes the
order in which a row's dot products are summed, so one row's result depends on how many other
rows share the call. Here one Triton kernel family (:mod:`the kernels below)
serves dense, batched (``bmm``) and grouped (MoE experts) products with a launch configuration
chosen from ``(N, K, dtype)`` only (:func:`gemm_config`): a row is
reduced over ``K`` in ascending ``BLOCK_K`` chunks into a float32 accumulator, split over ``K``
only in pieces fixed by ``K`` whose partials are added in order, and its value does not depend
on which tile or group it shares with other rows.

All three take the second operand as ``b[G, K, N]`` (any strides) and the rows of ``a[M, K]``
in ``G`` consecutive groups; group ``g`` is multiplied by ``b[g]``:

- dense: ``G = 1``;
- batched: ``G`` groups of ``M / G`` rows (``torch.bmm``);
- grouped: group ends ``offsets[G]`` on the device (``torch._grouped_mm``), no host sync.

The torch reference (the CPU path) reaches the same property a different way: CPU BLAS takes
another path for fewer than 4 to 8 rows, so it multiplies fixed 16-row chunks (the last one
zero-padded); every BLAS call then has the same shape and a row's value depends on its own data
only. The two paths are each batch-invariant; they agree with each other to rounding.

Eager calls go through ``_InvariantMatmul``; while ``torch.compile`` traces a call it becomes the
custom op ``torch.ops.mcore_kernels.batch_invariant_matmul`` with the registered backward
``batch_invariant_matmul_bwd`` (the same ordinary GEMMs). The torch reference is
:func:`mcore_kernels.batch_invariant.reference.matmul_reference`.

The kernels: a pointer kernel (dense, batched, grouped) and a TMA one.

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

Which :class:`GemmConfig` a product runs with (:func:`gemm_config`) is a function of ``(N, K, dtype)`` and of the GPU generation, never of the number
of rows ``M``: that is what makes the GEMM batch-invariant. Inside those limits it is tuned for
both ends of ``M`` at once (decode, a few rows; training and prefill, thousands).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import _interpreting, use_triton
from mcore_kernels._triton_utils import jit, round_to, tl, triton
from mcore_kernels.batch_invariant.reference import REFERENCE_CHUNK_ROWS, matmul_reference
from mcore_kernels.errors import KernelDtypeError, KernelShapeError

__all__ = [
    "GemmConfig",
    "gemm_config",
    "launch_gemm",
    "REFERENCE_CHUNK_ROWS",
    "bmm_batch_invariant",
    "grouped_mm_batch_invariant",
    "linear_batch_invariant",
    "matmul_reference",
    "mm_batch_invariant",
]

# --- kernels and their launcher -----------------------------------------------------------------


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


# --- launch configuration per (N, K, dtype) -----------------------------------------------------

_FLOAT32 = GemmConfig(block_m=32, block_n=64, block_k=32, warps=4, stages=2)
_DEFAULT = GemmConfig(block_m=64, block_n=128, block_k=64, warps=4, stages=3)

# Hopper (H100), bf16/fp16. From a sweep of tile shapes, warps, stages, split-K and TMA at
# M = 1, 256 and 4096 for the Llama-3.2-1B projections (packages/mcore-inference/benchmarks/
# results/nvidia-h100/batch_invariant.md): each shape takes the configuration with the lowest
# sum of slowdowns against cuBLAS over the three M, since one configuration has to serve decode
# and training alike. Shapes not swept take the rule of _hopper_rule.
_HOPPER_VOCAB = GemmConfig(block_m=128, block_n=256, block_k=64, warps=8, stages=3, tma=True)
_HOPPER_NARROW = GemmConfig(block_m=64, block_n=64, block_k=128, warps=4, stages=4, tma=True)
_HOPPER_SQUARE = GemmConfig(block_m=64, block_n=128, block_k=64, warps=4, stages=4, tma=True)
_HOPPER_WIDE = GemmConfig(block_m=64, block_n=128, block_k=64, warps=4, stages=3)
_HOPPER_DEEP = GemmConfig(
    block_m=128, block_n=128, block_k=64, warps=4, stages=4, splits=2, tma=True
)


def _hopper_rule(width: int, depth: int) -> GemmConfig:
    """Configuration on Hopper from the output width ``N`` and the depth ``K``."""
    if width >= 32768:
        return _HOPPER_VOCAB
    if depth >= 4096 and depth >= 2 * width:
        return _HOPPER_DEEP
    if width <= 1024:
        return _HOPPER_NARROW
    if width <= 4096:
        return _HOPPER_SQUARE
    return _HOPPER_WIDE


@functools.lru_cache(maxsize=256)
def _hopper_config(width: int, depth: int) -> GemmConfig:
    return _hopper_rule(width, depth)


def gemm_config(width: int, depth: int, dtype: torch.dtype, device: torch.device) -> GemmConfig:
    """The launch configuration of an invariant product with ``N = width`` and ``K = depth``.

    Args:
        width: Output columns ``N``.
        depth: Reduction size ``K``.
        dtype: Operand dtype.
        device: Device of the operands (the GPU generation picks the table).

    Returns:
        The configuration; it never depends on the number of rows.
    """
    if dtype == torch.float32:
        return _FLOAT32
    if device.type == "cuda" and _capability(device.index) >= 9:
        return _hopper_config(width, depth)
    return _DEFAULT


@functools.lru_cache(maxsize=16)
def _capability(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


# --- the products: checks, autograd, custom ops, API --------------------------------------------


_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def _check(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    if a.dtype not in _SUPPORTED or b.dtype != a.dtype:
        raise KernelDtypeError(
            f"{name}: a.dtype={a.dtype}, b.dtype={b.dtype}; expected one float dtype of "
            f"{_SUPPORTED}"
        )
    if a.device != b.device:
        raise KernelShapeError(f"{name}: a is on {a.device} and b on {b.device}")
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        raise KernelShapeError(
            f"{name}: a{tuple(a.shape)} and b{tuple(b.shape)}; expected a[M, K] and b[G, K, N]"
        )


def _launch(
    a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor | None, rows_per_group: int
) -> torch.Tensor:
    config = gemm_config(b.shape[2], a.shape[1], a.dtype, a.device)
    return launch_gemm(a, b, group_ends, rows_per_group, config)


def _grouped_forward(
    a: torch.Tensor,
    b: torch.Tensor,
    group_ends: torch.Tensor | None,
    rows_per_group: int,
) -> torch.Tensor:
    if use_triton(a, b):
        return _launch(a, b, group_ends, rows_per_group)
    return matmul_reference(a, b, group_ends, rows_per_group)


class _InvariantMatmul(torch.autograd.Function):
    """Forward through the invariant kernel; backward with ordinary GEMMs (cuBLAS on the GPU).

    The backward needs no batch invariance: log-probs come from the forward, and the engine
    never computes a gradient. It needs determinism, which cuBLAS gives for a given shape, GPU
    and library version (the same algorithm is picked every time, and no algorithm torch uses
    for these products reduces with atomics); the ordinary kernels are 1.5-3x faster than
    the invariant ones.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        a: torch.Tensor,
        b: torch.Tensor,
        group_ends: torch.Tensor | None,
        rows_per_group: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(a, b, group_ends)
        ctx.rows_per_group = rows_per_group
        return _grouped_forward(a, b, group_ends, rows_per_group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        a, b, group_ends = ctx.saved_tensors
        grad_a, grad_b = _backward(ctx, a, b, group_ends, grad)
        return grad_a, grad_b, None, None


def _backward(
    ctx: Any, a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor | None, grad: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(d a, d b)`` by ordinary GEMMs (``ctx`` has ``needs_input_grad`` and
    ``rows_per_group``), with batch-invariant mode suspended."""
    from mcore_kernels.batch_invariant.mode import suspended

    with suspended():
        if group_ends is None:
            return _uniform_backward(ctx, a, b, grad)
        return _grouped_backward(ctx, a, b, group_ends, grad)


def _uniform_backward(
    ctx: Any, a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of equal groups (dense, ``bmm``): one cuBLAS call each, no copies."""
    groups, rows = b.shape[0], ctx.rows_per_group
    grad_a = grad_b = None
    if groups == 1:
        if ctx.needs_input_grad[0]:
            grad_a = grad @ b[0].transpose(0, 1)
        if ctx.needs_input_grad[1]:
            if b.stride(1) == 1:
                # b is a linear layer's weight[N, K] seen as [K, N]: produce the gradient in the
                # weight's own layout, so that accumulating it needs no transposed copy.
                grad_b = (grad.transpose(0, 1) @ a).transpose(0, 1)[None]
            else:
                grad_b = (a.transpose(0, 1) @ grad)[None]
        return grad_a, grad_b
    grads = grad.reshape(groups, rows, grad.shape[-1])
    if ctx.needs_input_grad[0]:
        grad_a = torch.bmm(grads, b.transpose(1, 2)).reshape(a.shape)
    if ctx.needs_input_grad[1]:
        grad_b = torch.bmm(a.reshape(groups, rows, a.shape[-1]).transpose(1, 2), grads)
    return grad_a, grad_b


def _grouped_backward(
    ctx: Any, a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of variable groups (MoE experts), one product per non-empty group."""
    ends = [int(e) for e in group_ends.tolist()]
    grad_a = torch.zeros_like(a) if ctx.needs_input_grad[0] else None
    grad_b = torch.zeros_like(b) if ctx.needs_input_grad[1] else None
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            if grad_a is not None:
                grad_a[start:end] = grad[start:end] @ b[g].transpose(0, 1)
            if grad_b is not None:
                grad_b[g] = a[start:end].transpose(0, 1) @ grad[start:end]
        start = end
    return grad_a, grad_b


def grouped_mm_batch_invariant(
    a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor
) -> torch.Tensor:
    """Grouped GEMM ``a[rows of g] @ b[g]`` with a batch-invariant reduction order.

    The semantics of ``torch._grouped_mm(a, b, offs=group_ends)`` for 2-D ``a`` and 3-D ``b``.

    Args:
        a: ``[M, K]`` rows sorted by group.
        b: ``[G, K, N]``.
        group_ends: ``[G]`` integer end row (exclusive) of each group, non-decreasing.

    Returns:
        ``[M, N]``; rows after the last group end are not written by the Triton path
        (left as allocated) and zero on the torch path.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are not one supported float dtype.
    """
    _check(a, b, "grouped_mm_batch_invariant")
    if group_ends.dim() != 1 or group_ends.shape[0] != b.shape[0]:
        raise KernelShapeError(
            f"group_ends.shape={tuple(group_ends.shape)}; expected [{b.shape[0]}] (one per group)"
        )
    return _apply(a, b, group_ends.contiguous(), 0)


def mm_batch_invariant(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D operands with a batch-invariant reduction order.

    Args:
        a: ``[M, K]``.
        b: ``[K, N]``.

    Returns:
        ``[M, N]`` in ``a.dtype``.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are not one supported float dtype.
    """
    if b.dim() != 2:
        raise KernelShapeError(f"b.shape={tuple(b.shape)}; expected [K, N]")
    _check(a, b[None], "mm_batch_invariant")
    return _apply(a, b[None], None, a.shape[0])


def bmm_batch_invariant(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` with a batch-invariant reduction order.

    Args:
        a: ``[G, M, K]``.
        b: ``[G, K, N]``.

    Returns:
        ``[G, M, N]`` in ``a.dtype``.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are not one supported float dtype.
    """
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]:
        raise KernelShapeError(
            f"a{tuple(a.shape)} and b{tuple(b.shape)}; expected a[G, M, K] and b[G, K, N]"
        )
    groups, rows, _ = a.shape
    flat = a.reshape(groups * rows, a.shape[2])
    _check(flat, b, "bmm_batch_invariant")
    out = _apply(flat, b, None, rows)
    return out.view(groups, rows, b.shape[2])


def linear_batch_invariant(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch.nn.functional.linear`` with a batch-invariant reduction order.

    Args:
        x: ``[..., K]`` input.
        weight: ``[N, K]`` weight.
        bias: Optional ``[N]`` bias, added after the product.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are not one supported float dtype.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)}, weight.shape={tuple(weight.shape)}; expected x[..., K] "
            "and weight[N, K]"
        )
    flat = x.reshape(-1, x.shape[-1])
    out = mm_batch_invariant(flat, weight.t())
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _apply(
    a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor | None, rows_per_group: int
) -> torch.Tensor:
    if _compile.compiling():
        return _matmul_op(a, b, group_ends, rows_per_group)
    out = _InvariantMatmul.apply(a, b, group_ends, rows_per_group)
    assert isinstance(out, torch.Tensor)
    return out


# --- torch.compile: the custom ops -----------------------------------------------------------


@_compile.custom_op(
    "batch_invariant_matmul",
    "(Tensor a, Tensor b, Tensor? group_ends, int rows_per_group) -> Tensor",
)
def _matmul_op(
    a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor | None, rows_per_group: int
) -> torch.Tensor:
    return _grouped_forward(a, b, group_ends, rows_per_group).contiguous()


_matmul_op.register_fake(lambda a, b, *args: a.new_empty((a.shape[0], b.shape[2])))


class _Needs:
    """What the backward helpers read from an autograd context."""

    __slots__ = ("needs_input_grad", "rows_per_group")

    def __init__(self, rows_per_group: int) -> None:
        self.needs_input_grad = (True, True)
        self.rows_per_group = rows_per_group


@_compile.custom_op(
    "batch_invariant_matmul_bwd",
    "(Tensor grad, Tensor a, Tensor b, Tensor? group_ends, int rows_per_group) -> (Tensor, Tensor)",
)
def _matmul_bwd_op(
    grad: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    group_ends: torch.Tensor | None,
    rows_per_group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_a, grad_b = _backward(_Needs(rows_per_group), a, b, group_ends, grad)
    assert grad_a is not None and grad_b is not None
    # Outputs may not alias inputs or each other, and take the fake implementation's layout.
    return grad_a.contiguous().clone(), grad_b.contiguous().clone()


_matmul_bwd_op.register_fake(lambda grad, a, b, *args: (a.new_empty(a.shape), b.new_empty(b.shape)))


def _setup_context(ctx, inputs, output):
    a, b, group_ends, rows_per_group = inputs
    ctx.save_for_backward(a, b, group_ends)
    ctx.rows_per_group = rows_per_group


def _op_backward(ctx, grad):
    a, b, group_ends = ctx.saved_tensors
    grad_a, grad_b = _matmul_bwd_op(grad, a, b, group_ends, ctx.rows_per_group)
    return grad_a, grad_b, None, None


_matmul_op.register_autograd(_op_backward, setup_context=_setup_context)
