"""Expert weight gradients in Gluon (Hopper): warp-specialised persistent kernels.

``out[e] = g[rows of e].T @ x[rows of e]`` (``[E, N, K]``) for rows sorted by expert, either
packed (every expert's row count a multiple of ``block_r``: rows padded per expert, the input
of the aligned Triton kernel; or any counts, the rows of an expert's last chunk past its end
zeroed in shared memory before that chunk's product), or in equal slots of ``S`` rows per
expert (``S`` a multiple of 8; the slot's last partial chunk is zero-filled by the TMA unit
through 3-D descriptors ``[E, S, N]``).

A load warp streams the row chunks of every output tile of the program through a ring of
shared-memory stages (TMA, mbarriers) and runs ahead across tile boundaries; two warpgroups
share each stage's ``g`` chunk and run the wgmma products of one half each of the tile's
columns (a ``block_n x 2 block_k`` tile per program). Each tile's epilogue goes registers ->
shared memory -> TMA store and is not waited for: the store drains while the next tile's
products run (the wait comes at the next epilogue, just before the buffer is rewritten).

Gluon kernels need an sm_90 GPU (they do not run under the Triton interpreter); the torch
reference of both layouts is :func:`mcore_kernels.moe.reference.k_grouped_mm_reference` (equal
slots: ``offsets = (e + 1) * S``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mcore_kernels.errors import (
    KernelDeviceError,
    KernelDtypeError,
    KernelShapeError,
    KernelValueError,
)

__all__ = [
    "DEFAULT_TILES",
    "GluonWeightTiles",
    "gluon_k_grouped_mm",
    "gluon_slot_k_grouped_mm",
]


@gluon.constexpr_function
def _stacked(count, shape):
    """The shape of ``count`` buffers of ``shape``."""
    return [count, *shape]


@gluon.constexpr_function
def _row_layout(columns):
    """A blocked layout of 4 warps over ``[rows, columns]`` (8 contiguous elements a thread)."""
    across = min(32, max(1, columns // 8))
    return gl.BlockedLayout([1, 8], [32 // across, across], [4, 1], [1, 0])


@gluon.jit
def _rows(expert, ends_ptr, slot_rows, BLOCK_R: gl.constexpr, SLOTS: gl.constexpr):
    """First row (inside the slot with ``SLOTS``) and row count of ``expert``."""
    if SLOTS:
        row0 = expert * 0
        count = slot_rows + expert * 0
    else:
        end = gl.load(ends_ptr + expert)
        prev = gl.load(ends_ptr + gl.maximum(expert - 1, 0))
        row0 = gl.where(expert > 0, prev, 0)
        count = end - row0
    return row0, count


@gluon.jit
def _load(desc, expert, row, col, bar, buf, SLOTS: gl.constexpr):
    if SLOTS:
        tma.async_copy_global_to_shared(desc, [expert, row, col], bar, buf)
    else:
        tma.async_copy_global_to_shared(desc, [row, col], bar, buf)


@gluon.jit
def _operand(buf, SLOTS: gl.constexpr):
    """A stage buffer as the 2-D ``[rows, columns]`` operand of wgmma."""
    if SLOTS:
        return buf.reshape([buf.shape[1], buf.shape[2]])
    else:
        return buf


@gluon.jit
def _zero_rows(buf, valid):
    """Zero the rows of a ``[rows, columns]`` stage buffer from row ``valid`` on."""
    layout: gl.constexpr = _row_layout(buf.shape[1])
    rows = gl.arange(0, buf.shape[0], layout=gl.SliceLayout(1, layout))
    keep = gl.expand_dims(rows < valid, 1)
    tile = buf.load(layout)
    buf.store(gl.where(keep, tile, gl.zeros_like(tile)))


@gluon.jit
def _loader(g_desc, x_desc, args, STAGES: gl.constexpr, SLOTS: gl.constexpr):
    a_bufs, b_bufs, ready, empty, ends_ptr, num_experts, slot_rows, N, K = args
    BLOCK_R: gl.constexpr = g_desc.block_type.shape[-2]
    BLOCK_N: gl.constexpr = g_desc.block_type.shape[-1]
    SUB_K: gl.constexpr = x_desc.block_type.shape[-1]
    num_k = gl.cdiv(K, 2 * SUB_K)
    per_expert = gl.cdiv(N, BLOCK_N) * num_k
    nbytes: gl.constexpr = g_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes
    counter = 0
    for job in range(gl.program_id(0), num_experts * per_expert, gl.num_programs(0)):
        expert = job // per_expert
        n0 = (job % per_expert // num_k) * BLOCK_N
        k0 = (job % num_k) * 2 * SUB_K
        row0, count = _rows(expert, ends_ptr, slot_rows, BLOCK_R, SLOTS)
        for c in range(gl.cdiv(count, BLOCK_R)):
            s = counter % STAGES
            mbarrier.wait(empty.index(s), ((counter // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            m0 = row0 + c * BLOCK_R
            _load(g_desc, expert, m0, n0, bar, a_bufs.index(s), SLOTS)
            _load(x_desc, expert, m0, k0, bar, b_bufs.index(2 * s), SLOTS)
            _load(x_desc, expert, m0, k0 + SUB_K, bar, b_bufs.index(2 * s + 1), SLOTS)
            counter += 1


@gluon.jit
def _consumer(
    out_desc,
    c_bufs,
    args,
    CID: gl.constexpr,
    STAGES: gl.constexpr,
    SLOTS: gl.constexpr,
    MASKED: gl.constexpr,
    SYNC_STORE: gl.constexpr,
):
    a_bufs, b_bufs, ready, empty, ends_ptr, num_experts, slot_rows, N, K = args
    BLOCK_R: gl.constexpr = a_bufs.type.shape[-2]
    BLOCK_N: gl.constexpr = a_bufs.type.shape[-1]
    SUB_K: gl.constexpr = b_bufs.type.shape[-1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SUB_K, 16]
    )
    c_smem = c_bufs.index(CID)
    num_k = gl.cdiv(K, 2 * SUB_K)
    per_expert = gl.cdiv(N, BLOCK_N) * num_k
    counter = 0
    for job in range(gl.program_id(0), num_experts * per_expert, gl.num_programs(0)):
        expert = job // per_expert
        n0 = (job % per_expert // num_k) * BLOCK_N
        k0 = (job % num_k) * 2 * SUB_K + CID * SUB_K
        count = _rows(expert, ends_ptr, slot_rows, BLOCK_R, SLOTS)[1]
        chunks = gl.cdiv(count, BLOCK_R)
        acc = gl.zeros([BLOCK_N, SUB_K], gl.float32, layout)
        prev = 0
        for c in range(chunks):
            s = counter % STAGES
            mbarrier.wait(ready.index(s), (counter // STAGES) & 1)
            a = _operand(a_bufs.index(s), SLOTS)
            b = _operand(b_bufs.index(2 * s + CID), SLOTS)
            if MASKED:
                tail = count - c * BLOCK_R
                if tail < BLOCK_R:
                    # The chunk runs into the next expert's rows: zero them in both operands
                    # (both warpgroups write the same zeros to the shared g chunk).
                    _zero_rows(a, tail)
                    _zero_rows(b, tail)
                    fence_async_shared()
                    gl.thread_barrier()
            acc = warpgroup_mma(a.permute((1, 0)), b, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # The product of the previous chunk has retired: its stage goes back to the loader.
            mbarrier.arrive(empty.index(prev), count=1, pred=c > 0)
            prev = s
            counter += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(prev), count=1, pred=chunks > 0)
        # The previous tile's store (from this buffer) had a whole tile of products to drain.
        tma.store_wait(0)
        c_smem.store(acc.to(out_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [expert * N + n0, k0], c_smem)
        if SYNC_STORE:
            tma.store_wait(0)
    tma.store_wait(0)


@gluon.jit
def gluon_wgrad_kernel(
    g_desc,
    x_desc,
    out_desc,
    ends_ptr,
    num_experts,
    slot_rows,
    N,
    K,
    STAGES: gl.constexpr,
    SLOTS: gl.constexpr,
    MASKED: gl.constexpr,
    SYNC_STORE: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):
    """``OUT[e] = G[rows of e].T @ X[rows of e]`` (see the module docstring)."""
    dtype: gl.constexpr = g_desc.dtype
    a_bufs = gl.allocate_shared_memory(
        dtype, _stacked(STAGES, g_desc.block_type.shape), g_desc.layout
    )
    b_bufs = gl.allocate_shared_memory(
        dtype, _stacked(2 * STAGES, x_desc.block_type.shape), x_desc.layout
    )
    c_bufs = gl.allocate_shared_memory(
        dtype, _stacked(2, out_desc.block_type.shape), out_desc.layout
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    args = (a_bufs, b_bufs, ready, empty, ends_ptr, num_experts, slot_rows, N, K)
    # Partitions: consumer 0 (the default warps), consumer 1 (4 warps), the loader (1 warp).
    gl.warp_specialize(
        [
            (_consumer, (out_desc, c_bufs, args, 0, STAGES, SLOTS, MASKED, SYNC_STORE)),
            (_consumer, (out_desc, c_bufs, args, 1, STAGES, SLOTS, MASKED, SYNC_STORE)),
            (_loader, (g_desc, x_desc, args, STAGES, SLOTS)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


@dataclass(kw_only=True, slots=True, frozen=True)
class GluonWeightTiles:
    """Tile shape of the Gluon weight-gradient kernel."""

    block_r: int = 64
    """Rows per reduction chunk."""
    block_n: int = 128
    """Output rows per tile (columns of ``g``)."""
    block_k: int = 128
    """Output columns per warpgroup (columns of ``x``): a tile is twice as wide."""
    stages: int = 3
    """Shared-memory stages of the operand ring."""
    consumer_regs: int = 232
    """Registers per thread of the product warpgroups."""
    loader_regs: int = 24
    """Registers per thread of the load warp."""
    sync_store: bool = False
    """Wait for each tile's store at once (as Triton's descriptor stores do) instead of at
    the next epilogue: a measurement switch."""

    def __post_init__(self) -> None:
        for name in ("block_r", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value > 256 or value & (value - 1):
                raise KernelShapeError(f"{name}={value} must be a power of two in [16, 256]")
        if self.stages < 1:
            raise KernelValueError(f"stages={self.stages} must be >= 1")

    @property
    def tile_k(self) -> int:
        """Output columns per tile."""
        return 2 * self.block_k


DEFAULT_TILES = GluonWeightTiles()
"""128 x 256 tiles, 64-row chunks, 3 stages (the DeepSeek-V3 tiles of session 16)."""
_NUM_SMS: dict[int, int] = {}


def _check(g: torch.Tensor, x: torch.Tensor, tiles: GluonWeightTiles) -> None:
    for name, tensor in (("g", g), ("x", x)):
        if tensor.dim() != 2:
            raise KernelShapeError(f"{name}.shape={tuple(tensor.shape)} must have 2 dimensions")
        if tensor.dtype not in (torch.bfloat16, torch.float16):
            raise KernelDtypeError(f"{name}.dtype={tensor.dtype} must be bfloat16 or float16")
    if g.dtype != x.dtype:
        raise KernelDtypeError(f"g.dtype={g.dtype} and x.dtype={x.dtype} must match")
    if g.shape[0] != x.shape[0] or g.shape[1] % tiles.block_n or x.shape[1] % tiles.tile_k:
        raise KernelShapeError(
            f"g.shape={tuple(g.shape)}, x.shape={tuple(x.shape)}: expected [M, N] and [M, K] "
            f"with N a multiple of {tiles.block_n} and K of {tiles.tile_k}"
        )
    for name, tensor in (("g", g), ("x", x)):
        if tensor.device.type != "cuda":
            raise KernelDeviceError(f"{name}.device={tensor.device}: Gluon kernels need a GPU")


@functools.cache
def _layout(block: tuple[int, ...], dtype: object) -> object:
    """The shared-memory layout of a TMA block (cached: it is built on every launch)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def _launch(
    g: torch.Tensor,
    x: torch.Tensor,
    offsets: torch.Tensor | None,
    experts: int,
    slot_rows: int,
    tiles: GluonWeightTiles,
    masked: bool = False,
) -> torch.Tensor:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    (rows, n), k = g.shape, x.shape[1]
    out = g.new_empty(experts, n, k)
    if experts == 0 or n == 0 or k == 0:
        return out
    if rows == 0:
        return out.zero_()
    g, x = g.contiguous(), x.contiguous()
    slots = slot_rows > 0
    dtype = gl.bfloat16 if g.dtype == torch.bfloat16 else gl.float16
    lead = [1] if slots else []
    g_block = [*lead, tiles.block_r, tiles.block_n]
    x_block = [*lead, tiles.block_r, tiles.block_k]
    g_desc = TensorDescriptor.from_tensor(
        g.view(experts, slot_rows, n) if slots else g,
        g_block,
        _layout(tuple(g_block), dtype),
    )
    x_desc = TensorDescriptor.from_tensor(
        x.view(experts, slot_rows, k) if slots else x,
        x_block,
        _layout(tuple(x_block), dtype),
    )
    o_block = [tiles.block_n, tiles.block_k]
    out_desc = TensorDescriptor.from_tensor(
        out.view(experts * n, k), o_block, _layout(tuple(o_block), dtype)
    )
    ends = offsets if offsets is not None else out  # not read with slots
    index = g.device.index if g.device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    programs = max(1, min(_NUM_SMS[index], experts * (n // tiles.block_n) * (k // tiles.tile_k)))
    gluon_wgrad_kernel[(programs,)](
        g_desc,
        x_desc,
        out_desc,
        ends,
        experts,
        slot_rows,
        n,
        k,
        STAGES=tiles.stages,
        SLOTS=slots,
        MASKED=masked,
        SYNC_STORE=tiles.sync_store,
        CONSUMER_REGS=tiles.consumer_regs,
        LOADER_REGS=tiles.loader_regs,
        num_warps=4,
    )
    return out


def gluon_k_grouped_mm(
    g: torch.Tensor,
    x: torch.Tensor,
    offsets: torch.Tensor,
    *,
    tiles: GluonWeightTiles | None = None,
    aligned: bool = True,
) -> torch.Tensor:
    """Weight gradients ``out[e] = g[rows of e].T @ x[rows of e]`` on packed rows sorted by
    expert.

    Args:
        g: ``[M, N]`` CUDA rows sorted by expert (N a multiple of ``tiles.block_n``).
        x: ``[M, K]`` (K a multiple of :attr:`GluonWeightTiles.tile_k`).
        offsets: ``[E]`` int32 end row of each expert.
        tiles: Tile shape; None: :data:`DEFAULT_TILES`.
        aligned: Every expert's row count is a multiple of ``tiles.block_r`` (rows padded per
            expert; not checked, which would sync the host). False: any counts, the rows of
            each expert's last chunk past its end zeroed in shared memory before its product.

    Returns:
        ``[E, N, K]``, zero for an expert without rows.

    Raises:
        KernelShapeError: If the shapes do not match or are not tile multiples.
        KernelDtypeError: If a dtype is not 16-bit or the dtypes differ.
        KernelDeviceError: If a tensor is not on a GPU.
    """
    tiles = DEFAULT_TILES if tiles is None else tiles
    _check(g, x, tiles)
    if offsets.dim() != 1 or offsets.dtype != torch.int32:
        raise KernelShapeError(
            f"offsets.shape={tuple(offsets.shape)}, offsets.dtype={offsets.dtype}: expected "
            "[E] int32"
        )
    return _launch(g, x, offsets, offsets.shape[0], 0, tiles, masked=not aligned)


def gluon_slot_k_grouped_mm(
    g: torch.Tensor,
    x: torch.Tensor,
    experts: int,
    *,
    tiles: GluonWeightTiles | None = None,
) -> torch.Tensor:
    """Weight gradients over equal slots: ``out[e] = g[e S:(e + 1) S].T @ x[e S:(e + 1) S]``
    with ``S = M / experts`` (``torch.bmm`` of the transposed slots).

    Args:
        g: ``[M, N]`` CUDA rows, ``experts`` slots of ``S`` rows (N a multiple of
            ``tiles.block_n``).
        x: ``[M, K]`` (K a multiple of :attr:`GluonWeightTiles.tile_k`).
        experts: Slots (experts).
        tiles: Tile shape; None: :data:`DEFAULT_TILES`.

    Returns:
        ``[E, N, K]``.

    Raises:
        KernelShapeError: If the shapes do not match or M is not ``experts`` equal slots.
        KernelDtypeError: If a dtype is not 16-bit or the dtypes differ.
        KernelDeviceError: If a tensor is not on a GPU.
    """
    tiles = DEFAULT_TILES if tiles is None else tiles
    _check(g, x, tiles)
    rows = g.shape[0]
    if experts < 1 or rows % experts:
        raise KernelShapeError(f"g.shape={tuple(g.shape)}: {experts} equal slots expected")
    slot_rows = rows // experts
    if slot_rows == 0:
        return g.new_zeros(experts, g.shape[1], x.shape[1])
    return _launch(g, x, None, experts, slot_rows, tiles)
