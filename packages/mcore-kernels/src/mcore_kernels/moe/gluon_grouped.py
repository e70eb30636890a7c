"""The routed SwiGLU forward in the epilogue of a warp-specialised persistent row-grouped GEMM
(Gluon, Hopper), and the partitions it shares with :mod:`mcore_kernels.moe.gluon_d_act`.

The kernels take the row tiles of :func:`~mcore_kernels.moe.grouped_mm.tile_schedule` (128
rows) and run three partitions:

- the products (:func:`_products`, the kernel's 8 warps: two warpgroups of 64 rows, wgmma from
  shared memory), which round each finished tile to the output dtype into shared memory and go
  on with the next tile;
- the epilogue, which applies the SwiGLU (here) or its backward (:mod:`~mcore_kernels.moe.gluon_d_act`)
  to that tile while the products run the next one, in row chunks;
- one load warp (:func:`_loader`: TMA, a ring of shared-memory stages, mbarriers), running
  ahead across tiles.

:func:`gluon_gate_up_swiglu`: ``x[rows of e] @ w_gate_up[e].T`` with each job's 128 gate and
128 up rows in one 256-wide operand; the epilogue (``FORWARD_EPI_WARPS``) stores the gate/up
output and ``w[order[m]] * silu(gate) * up`` of the rounded values, bitwise the GEMM followed by
the separate routed SwiGLU pass.

Gluon kernels need an sm_90 GPU (they do not run under the Triton interpreter): the torch
references are the GEMMs (:func:`mcore_kernels.moe.grouped_mm.m_grouped_mm_reference`) and
:func:`mcore_kernels.moe.reference.weighted_swiglu_reference`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mcore_kernels._triton_utils import jit, tl
from mcore_kernels.errors import KernelDeviceError, KernelDtypeError, KernelShapeError
from mcore_kernels.moe._launch import cdiv, launch
from mcore_kernels.moe.grouped_mm import tile_schedule

__all__ = ["BLOCK_M", "BLOCK_N", "gluon_gate_up_swiglu"]

BLOCK_M = 128
"""Rows per tile (two product warpgroups of 64 rows): the :func:`tile_schedule` height."""
BLOCK_N = 256
"""Columns of the gate/up output per tile (128 gate and 128 up columns; the expert width must
be a multiple of half of it)."""
BLOCK_K = 64
"""Reduction step."""
FORWARD_ROWS = 8
"""Rows per epilogue chunk of the gate/up kernel (half-width tiles)."""
FORWARD_STAGES = 3
"""Shared-memory stages of the gate/up kernel's operand ring."""
FORWARD_EPI_WARPS = 2
"""Warps of the gate/up kernel's epilogue partition."""
WORKER_REGS = 152
"""Registers per thread of the epilogue and load warps (one warpgroup: the same count)."""


@gluon.constexpr_function
def _tile_layout(epi_rows):
    """Shared layout of the ``grad_act`` tile: 16-byte vectors swizzled over ``min(8,
    epi_rows)`` rows, so that the product warps store it with few bank conflicts and its row
    chunks of ``epi_rows`` rows are the same bytes viewed as ``[chunks, epi_rows, columns]``."""
    return gl.SwizzledSharedLayout(8, 1, min(8, epi_rows), order=[1, 0])


@gluon.constexpr_function
def _pick(flag, when_true, when_false):
    """``when_true`` if ``flag`` else ``when_false`` (constexprs)."""
    return when_true if flag else when_false


@gluon.constexpr_function
def _stacked(count, shape):
    """The shape of ``count`` buffers of ``shape``."""
    return [count, *shape]


@gluon.jit
def _job(job, sched_ptr, max_tiles, num_n):
    """Expert, first row, end row and first column of job ``job`` (the column tiles of one
    row tile consecutive)."""
    tile = job // num_n
    expert = gl.load(sched_ptr + tile)
    row_start = gl.load(sched_ptr + max_tiles + tile)
    row_end = gl.load(sched_ptr + 2 * max_tiles + tile)
    return expert, row_start, row_end, job % num_n


@gluon.jit
def _loader(
    a_desc, b_desc, a_bufs, b_bufs, ready, empty, sched_ptr, max_tiles, N, K, GATE_UP: gl.constexpr
):
    BK: gl.constexpr = a_desc.block_type.shape[1]
    NUM_STAGES: gl.constexpr = b_bufs.type.shape[0]
    # GATE_UP: weights [E * 2F, K] (gate rows, then up rows): a job's 128 gate and 128 up rows
    # go to the two halves of one [256, BK] stage.
    HN: gl.constexpr = b_desc.block_type.shape[0]
    BN: gl.constexpr = _pick(GATE_UP, HN, b_desc.block_type.shape[1])
    nbytes: gl.constexpr = (
        a_desc.block_type.nbytes + _pick(GATE_UP, 2, 1) * b_desc.block_type.nbytes
    )
    num_n = N // BN
    k_tiles = K // BK
    total = gl.load(sched_ptr + 3 * max_tiles) * num_n
    counter = 0
    for job in range(gl.program_id(0), total, gl.num_programs(0)):
        expert, row_start, _, pid_n = _job(job, sched_ptr, max_tiles, num_n)
        for kk in range(k_tiles):
            s = counter % NUM_STAGES
            mbarrier.wait(empty.index(s), ((counter // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            k0 = kk * BK
            tma.async_copy_global_to_shared(a_desc, [row_start, k0], bar, a_bufs.index(s))
            if GATE_UP:
                row = expert * 2 * N + pid_n * HN
                stage = b_bufs.index(s)
                tma.async_copy_global_to_shared(b_desc, [row, k0], bar, stage.slice(0, HN))
                tma.async_copy_global_to_shared(b_desc, [row + N, k0], bar, stage.slice(HN, HN))
            else:
                tma.async_copy_global_to_shared(
                    b_desc, [expert * K + k0, pid_n * BN], bar, b_bufs.index(s)
                )
            counter += 1


@gluon.jit
def _products(
    a_bufs,
    b_bufs,
    c_bufs,
    ready,
    empty,
    c_ready,
    c_empty,
    sched_ptr,
    max_tiles,
    N,
    K,
    GATE_UP: gl.constexpr,
):
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    NUM_STAGES: gl.constexpr = b_bufs.type.shape[0]
    # GATE_UP: b stages [256, BK] (gate rows then up rows), the tile's halves in two buffers.
    BN: gl.constexpr = _pick(GATE_UP, b_bufs.type.shape[1], b_bufs.type.shape[2])
    NUM_C: gl.constexpr = _pick(GATE_UP, c_bufs.type.shape[0] // 2, c_bufs.type.shape[0])
    num_n = N // _pick(GATE_UP, BN // 2, BN)
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BN, 16]
    )
    k_tiles = K // BK
    total = gl.load(sched_ptr + 3 * max_tiles) * num_n
    counter = 0
    tiles = 0
    for _job_id in range(gl.program_id(0), total, gl.num_programs(0)):
        acc = gl.zeros([BM, BN], gl.float32, layout)
        prev = 0
        for kk in range(k_tiles):
            s = counter % NUM_STAGES
            mbarrier.wait(ready.index(s), (counter // NUM_STAGES) & 1)
            if GATE_UP:
                b = b_bufs.index(s).permute((1, 0))
            else:
                b = b_bufs.index(s)
            acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # The product of the previous step has retired: its stage goes back to the loader.
            mbarrier.arrive(empty.index(prev), pred=kk > 0)
            prev = s
            counter += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(prev), pred=k_tiles > 0)
        # The epilogue has read the previous tile out of the buffer.
        buf = tiles % NUM_C
        mbarrier.wait(c_empty.index(buf), ((tiles // NUM_C) & 1) ^ 1)
        if GATE_UP:
            gate, up = acc.reshape([BM, 2, BN // 2]).permute((0, 2, 1)).split()
            c_bufs.index(2 * buf).store(gate.to(c_bufs.dtype))
            c_bufs.index(2 * buf + 1).store(up.to(c_bufs.dtype))
        else:
            c_bufs.index(buf).store(acc.to(c_bufs.dtype))
        gl.thread_barrier()
        mbarrier.arrive(c_ready.index(buf))
        tiles += 1  # noqa: SIM113 (a loop-carried scalar)


@gluon.jit
def _epilogue_forward(
    c_bufs,
    c_ready,
    c_empty,
    sched_ptr,
    max_tiles,
    gate_up_ptr,
    act_ptr,
    w_ptr,
    order_ptr,
    N,
    ROWS: gl.constexpr,
    EPI_WARPS: gl.constexpr,
):
    NUM_C: gl.constexpr = c_bufs.type.shape[0] // 2
    BM: gl.constexpr = c_bufs.type.shape[1]
    HN: gl.constexpr = c_bufs.type.shape[2]
    CHUNKS: gl.constexpr = BM // ROWS
    layout: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8],
        threads_per_warp=[32 // (HN // 8), HN // 8],
        warps_per_cta=[EPI_WARPS, 1],
        order=[1, 0],
    )
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, layout)
    num_n = N // HN
    total = gl.load(sched_ptr + 3 * max_tiles) * num_n
    dtype: gl.constexpr = c_bufs.dtype
    # Chunk j of half h of buffer b: index (2 b + h) * CHUNKS + j.
    chunks = c_bufs._reinterpret(dtype, [2 * NUM_C * CHUNKS, ROWS, HN], _tile_layout(ROWS))
    offs = gl.arange(0, ROWS, layout=rows_layout)
    tiles = 0
    for job in range(gl.program_id(0), total, gl.num_programs(0)):
        _, row_start, row_end, pid_n = _job(job, sched_ptr, max_tiles, num_n)
        cols = pid_n * HN + gl.arange(0, HN, layout=cols_layout)
        buf = tiles % NUM_C
        mbarrier.wait(c_ready.index(buf), (tiles // NUM_C) & 1)
        for i in range(CHUNKS):
            rows = row_start + i * ROWS + offs
            valid = rows < row_end
            assignment = gl.load(order_ptr + rows, mask=valid, other=-1)
            used = assignment >= 0
            weight = gl.load(w_ptr + gl.where(used, assignment, 0), mask=used, other=0.0)
            w32 = gl.where(used, weight.to(gl.float32), 0.0)
            store = valid[:, None] & (cols < N)[None, :]
            read = used[:, None] & (cols < N)[None, :]
            gate = chunks.index(2 * buf * CHUNKS + i).load(layout)
            up = chunks.index((2 * buf + 1) * CHUNKS + i).load(layout)
            base = rows.to(gl.int64)[:, None] * (2 * N) + cols[None, :]
            gl.store(gate_up_ptr + base, gate, mask=store)
            gl.store(gate_up_ptr + base + N, up, mask=store)
            g32 = gl.where(read, gate.to(gl.float32), 0.0)
            u32 = gl.where(read, up.to(gl.float32), 0.0)
            act = g32 / (1.0 + gl.exp(-g32)) * u32 * w32[:, None]
            out = rows.to(gl.int64)[:, None] * N + cols[None, :]
            gl.store(act_ptr + out, act.to(dtype), mask=store)
        mbarrier.arrive(c_empty.index(buf))
        tiles += 1  # noqa: SIM113 (a loop-carried scalar)


@gluon.jit
def gluon_gate_up_swiglu_kernel(
    a_desc,
    b_desc,
    sched_ptr,
    max_tiles,
    gate_up_ptr,
    act_ptr,
    w_ptr,
    order_ptr,
    N,
    K,
    NUM_STAGES: gl.constexpr,
    ROWS: gl.constexpr,
    EPI_WARPS_: gl.constexpr,
    WORKER_REGS_: gl.constexpr,
    NUM_C_: gl.constexpr,
):
    """The gate/up projection and the routed SwiGLU (see :func:`gluon_gate_up_swiglu`);
    ``a_desc`` views ``x`` ``[M, K]`` in ``[BLOCK_M, BLOCK_K]`` boxes, ``b_desc`` the weights
    as ``[E * 2N, K]`` in ``[BLOCK_N / 2, BLOCK_K]`` boxes."""
    dtype: gl.constexpr = a_desc.dtype
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    HN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(
        dtype, _stacked(NUM_STAGES, a_desc.block_type.shape), a_desc.layout
    )
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, 2 * HN, BK], b_desc.layout)
    c_bufs = gl.allocate_shared_memory(dtype, [2 * NUM_C_, BM, HN], _tile_layout(ROWS))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [NUM_C_, 1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [NUM_C_, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(NUM_C_):
        mbarrier.init(c_ready.index(i), count=1)
        mbarrier.init(c_empty.index(i), count=1)
    gl.warp_specialize(
        [
            (
                _products,
                (
                    a_bufs,
                    b_bufs,
                    c_bufs,
                    ready,
                    empty,
                    c_ready,
                    c_empty,
                    sched_ptr,
                    max_tiles,
                    N,
                    K,
                    True,
                ),
            ),
            (
                _epilogue_forward,
                (
                    c_bufs,
                    c_ready,
                    c_empty,
                    sched_ptr,
                    max_tiles,
                    gate_up_ptr,
                    act_ptr,
                    w_ptr,
                    order_ptr,
                    N,
                    ROWS,
                    EPI_WARPS_,
                ),
            ),
            (
                _loader,
                (a_desc, b_desc, a_bufs, b_bufs, ready, empty, sched_ptr, max_tiles, N, K, True),
            ),
        ],
        [EPI_WARPS_, 1],
        [WORKER_REGS_, WORKER_REGS_],
    )


@jit
def zero_tail_rows_kernel(
    out_ptr, ends_ptr, num_experts, rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    """Zero the ``width`` columns of the rows of ``out`` past the last expert's end row."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    tail = (r < rows) & (r >= tl.load(ends_ptr + num_experts - 1))
    if tl.max(tail.to(tl.int32), axis=0) > 0:
        c = tl.arange(0, BLOCK_C)
        dtype = out_ptr.dtype.element_ty
        for c0 in range(0, width, BLOCK_C):
            cols = c0 + c
            mask = tail[:, None] & (cols < width)[None, :]
            ptrs = out_ptr + r.to(tl.int64)[:, None] * width + cols[None, :]
            tl.store(ptrs, tl.zeros((BLOCK_R, BLOCK_C), dtype=dtype), mask=mask)


_NUM_SMS: dict[int, int] = {}


def gluon_gate_up_swiglu(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor,
    order: torch.Tensor,
    *,
    schedule: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate/up projection ``x[rows of e] @ w_gate_up[e].T`` and the routed SwiGLU of its
    rounded output in the epilogue: ``act[m] = w[order[m]] * silu(gate) * up``.

    Args:
        x: ``[M, H]`` CUDA rows sorted by expert.
        w_gate_up: ``[E, 2F, H]`` gate rows then up rows of each expert (F a multiple of
            ``BLOCK_N / 2``, H of 64).
        offsets: ``[E]`` int32 end row of each expert.
        weights: ``[A]`` routing weight of each assignment.
        order: ``[M]`` int64 assignment of each row, -1 for a row without one.
        schedule: :func:`~mcore_kernels.moe.grouped_mm.tile_schedule` of ``offsets`` with
            :data:`BLOCK_M` rows per tile (built when None).

    Returns:
        ``(gate_up [M, 2F], act [M, F])``: bitwise the GEMM's output (rows past the last
        expert unwritten, as the GEMM leaves them) and the separate routed SwiGLU pass's
        (rows without an assignment or past the last expert zero).

    Raises:
        KernelShapeError: If the shapes do not match or are not tile multiples.
        KernelDtypeError: If a dtype is not 16-bit or the dtypes differ.
        KernelDeviceError: If a tensor is not on a GPU.
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    half = BLOCK_N // 2
    if w_gate_up.dim() != 3 or x.dim() != 2:
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)} and w_gate_up.shape={tuple(w_gate_up.shape)} must be "
            "[M, H] and [E, 2F, H]"
        )
    experts, two_ffn, hidden = w_gate_up.shape
    rows = x.shape[0]
    for name, tensor in (("x", x), ("w_gate_up", w_gate_up)):
        if tensor.dtype not in (torch.bfloat16, torch.float16) or tensor.dtype != x.dtype:
            raise KernelDtypeError(
                f"{name}.dtype={tensor.dtype}: x and w_gate_up must share one 16-bit dtype"
            )
    if (
        x.shape[1] != hidden
        or two_ffn % BLOCK_N
        or hidden % BLOCK_K
        or tuple(offsets.shape) != (experts,)
        or offsets.dtype != torch.int32
        or tuple(order.shape) != (rows,)
        or order.dtype != torch.int64
        or weights.dim() != 1
    ):
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)}, w_gate_up.shape={tuple(w_gate_up.shape)}, "
            f"offsets={tuple(offsets.shape)} {offsets.dtype}, order={tuple(order.shape)} "
            f"{order.dtype}, weights={tuple(weights.shape)}: expected [M, H], [E, 2F, H], [E] "
            f"int32, [M] int64 and 1-D weights, with F a multiple of {half} and H of {BLOCK_K}"
        )
    for name, tensor in (("x", x), ("w_gate_up", w_gate_up)):
        if tensor.device.type != "cuda":
            raise KernelDeviceError(f"{name}.device={tensor.device}: Gluon kernels need a GPU")
    ffn = two_ffn // 2
    gate_up = x.new_empty(rows, two_ffn)
    act = x.new_empty(rows, ffn)
    if rows == 0 or ffn == 0:
        return gate_up, act
    x, w_gate_up = x.contiguous(), w_gate_up.contiguous()
    weights, order = weights.contiguous(), order.contiguous()
    if schedule is None:
        schedule = tile_schedule(offsets, rows, BLOCK_M)
    max_tiles = (schedule.shape[0] - 1) // 3
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    a_block = [BLOCK_M, BLOCK_K]
    b_block = [half, BLOCK_K]
    a_desc = TensorDescriptor.from_tensor(
        x, a_block, gl.NVMMASharedLayout.get_default_for(a_block, dtype)
    )
    b_desc = TensorDescriptor.from_tensor(
        w_gate_up.view(experts * two_ffn, hidden),
        b_block,
        gl.NVMMASharedLayout.get_default_for(b_block, dtype),
    )
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    programs = max(1, min(_NUM_SMS[index], max_tiles * (ffn // half)))
    launch(
        gluon_gate_up_swiglu_kernel,
        (programs,),
        (a_desc, b_desc, schedule, max_tiles, gate_up, act, weights, order, ffn, hidden),
        dict(
            NUM_STAGES=FORWARD_STAGES,
            ROWS=FORWARD_ROWS,
            EPI_WARPS_=FORWARD_EPI_WARPS,
            WORKER_REGS_=WORKER_REGS,
            NUM_C_=1,
        ),
        device=x.device,
        num_warps=8,
    )
    block_r = 64
    launch(
        zero_tail_rows_kernel,
        (cdiv(rows, block_r),),
        (act, offsets, experts, rows, ffn),
        dict(BLOCK_R=block_r, BLOCK_C=64),
        device=x.device,
    )
    return gate_up, act
