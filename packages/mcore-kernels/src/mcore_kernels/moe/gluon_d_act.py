"""The down projection's input gradient with the routed SwiGLU backward in the epilogue of a
warp-specialised persistent row-grouped GEMM (Gluon, Hopper).

:func:`gluon_d_act_swiglu`: ``grad_act[rows of e] = grad[rows of e] @ w_down[e]`` is never
stored. The kernel runs the load warp and the products of :mod:`mcore_kernels.moe.gluon_grouped`
(:func:`~mcore_kernels.moe.gluon_grouped._loader`, :func:`~mcore_kernels.moe.gluon_grouped._products`);
its epilogue (``EPI_WARPS``) loads each tile's routing weights once, applies the routed SwiGLU
backward of :func:`mcore_kernels.moe.routed._routed_swiglu_backward` (the gate and up gradients
stored) and writes each row's part of its routing weight's gradient (the float32 sum of
``grad * silu(gate) * up`` over the tile's columns) to a ``[M, F / D_ACT_BLOCK_N]`` buffer.
A small Triton kernel (:func:`d_act_swiglu_finish_kernel`) then adds each row's parts in a fixed
order and writes the weight gradient at the row's assignment (one write per assignment: no
atomics, reproducible), and zeroes the gate/up gradient of the rows past the last expert (as the
separate pass does).

The outputs are bitwise those of the GEMM followed by the separate pass (the same rounded GEMM
output, the same float32 expressions), except the routing weights' gradient, which sums the
same terms in another order (a rounding apart). Off in the layer by default
(:data:`mcore_kernels.moe.expert_gemms.GLUON_D_ACT`): measured level with the GEMM and the pass.
Needs an sm_90 GPU; the torch reference is the GEMM and the gradient of
:func:`mcore_kernels.moe.reference.weighted_swiglu_reference`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from mcore_kernels._triton_utils import jit, tl
from mcore_kernels.errors import KernelDeviceError, KernelDtypeError, KernelShapeError
from mcore_kernels.moe._launch import cdiv, launch
from mcore_kernels.moe.gluon_grouped import (
    _NUM_SMS,
    BLOCK_K,
    BLOCK_M,
    WORKER_REGS,
    _job,
    _loader,
    _products,
    _stacked,
    _tile_layout,
)
from mcore_kernels.moe.grouped_mm import tile_schedule

__all__ = ["D_ACT_BLOCK_N", "d_act_swiglu_finish_kernel", "gluon_d_act_swiglu"]

D_ACT_BLOCK_N = 128
"""Columns of ``grad_act`` per tile (the expert width must be a multiple): 128 leaves registers
for a 4-warp epilogue (16 warps of 128 registers); 256 needs 168 registers per product thread
and allows a 2-warp epilogue only."""
STAGES = 4
"""Shared-memory stages of the operand ring."""
EPI_ROWS = 8
"""Rows per epilogue chunk."""
TILE_BUFFERS = 1
"""Shared-memory buffers of the ``grad_act`` tile between the products and the epilogue (2:
the products run two tiles ahead of the epilogue)."""
EPILOGUE_WORK = True
"""False: the epilogue only hands the tile buffers back (no SwiGLU backward, no output): a
measurement switch for the products' and loads' time alone."""
PREFETCH = 1
"""The epilogue issues each row chunk's loads this many chunks ahead (0, 1 or 2)."""
EPI_WARPS = 4
"""Warps of the epilogue partition."""


@gluon.jit
def _chunk_loads(gate_up_ptr, rows, used, cols, N):
    """The gate and up values of rows ``rows`` at ``cols`` (zero where ``used`` is false)."""
    read = used[:, None] & (cols < N)[None, :]
    base = rows.to(gl.int64)[:, None] * (2 * N) + cols[None, :]
    gate = gl.load(gate_up_ptr + base, mask=read, other=0.0)
    up = gl.load(gate_up_ptr + base + N, mask=read, other=0.0)
    return gate, up


@gluon.jit
def _row_table(
    w_ptr,
    order_ptr,
    row_start,
    row_end,
    weights,
    flags,
    CHUNKS: gl.constexpr,
    ROWS: gl.constexpr,
    WARPS: gl.constexpr,
):
    """Store each row's routing weight (float32, zero without an assignment) in ``weights``
    and whether it has an assignment (1.0 / 0.0) in ``flags``, ``[CHUNKS, ROWS]`` each: the
    order -> weight loads of a tile are issued together, not once per row chunk."""
    layout: gl.constexpr = gl.BlockedLayout([1, ROWS], [32, 1], [WARPS, 1], [1, 0])
    r = gl.arange(0, CHUNKS, layout=gl.SliceLayout(1, layout))[:, None] * ROWS
    rows = row_start + r + gl.arange(0, ROWS, layout=gl.SliceLayout(0, layout))[None, :]
    valid = rows < row_end
    assignment = gl.load(order_ptr + rows, mask=valid, other=-1)
    used = assignment >= 0
    weight = gl.load(w_ptr + gl.where(used, assignment, 0), mask=used, other=0.0)
    weight = gl.where(used, weight.to(gl.float32), 0.0)
    # The previous tile's reads of the table are done.
    gl.thread_barrier()
    weights.store(weight)
    flags.store(gl.where(used, 1.0, 0.0))
    gl.thread_barrier()


@gluon.jit
def _epilogue(
    c_bufs,
    c_ready,
    c_empty,
    weights,
    flags,
    sched_ptr,
    max_tiles,
    gate_up_ptr,
    w_ptr,
    order_ptr,
    out_ptr,
    part_ptr,
    N,
    EPI_ROWS_: gl.constexpr,
    EPI_WARPS: gl.constexpr,
    PREFETCH: gl.constexpr,
    WORK: gl.constexpr,
):
    NUM_C: gl.constexpr = c_bufs.type.shape[0]
    BM: gl.constexpr = c_bufs.type.shape[1]
    BN: gl.constexpr = c_bufs.type.shape[2]
    CHUNKS: gl.constexpr = BM // EPI_ROWS_
    layout: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8],
        threads_per_warp=[32 // (BN // 8), BN // 8],
        warps_per_cta=[EPI_WARPS, 1],
        order=[1, 0],
    )
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, layout)
    num_n = N // BN
    total = gl.load(sched_ptr + 3 * max_tiles) * num_n
    dtype: gl.constexpr = c_bufs.dtype
    # The tile's rows in chunks (the same bytes: the swizzle repeats within a chunk).
    chunks = c_bufs._reinterpret(dtype, [NUM_C * CHUNKS, EPI_ROWS_, BN], _tile_layout(EPI_ROWS_))
    offs = gl.arange(0, EPI_ROWS_, layout=rows_layout)
    # The row tables as one [EPI_ROWS] buffer per chunk (the same bytes).
    chunk_rows: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    weight_rows = weights._reinterpret(gl.float32, [CHUNKS, EPI_ROWS_], chunk_rows)
    flag_rows = flags._reinterpret(gl.float32, [CHUNKS, EPI_ROWS_], chunk_rows)
    tiles = 0
    for job in range(gl.program_id(0), total, gl.num_programs(0)):
        _, row_start, row_end, pid_n = _job(job, sched_ptr, max_tiles, num_n)
        cols = pid_n * BN + gl.arange(0, BN, layout=cols_layout)
        buf = tiles % NUM_C
        if WORK:
            _row_table(
                w_ptr, order_ptr, row_start, row_end, weights, flags, CHUNKS, EPI_ROWS_, EPI_WARPS
            )
            # The first chunks' loads do not wait for the products (PREFETCH: each chunk's
            # loads are issued that many chunks ahead).
            gate, up = _chunk_loads(
                gate_up_ptr, row_start + offs, flag_rows.index(0).load(rows_layout) != 0.0, cols, N
            )
            if PREFETCH == 2:
                gate1, up1 = _chunk_loads(
                    gate_up_ptr,
                    row_start + EPI_ROWS_ + offs,
                    flag_rows.index(1).load(rows_layout) != 0.0,
                    cols,
                    N,
                )
        mbarrier.wait(c_ready.index(buf), (tiles // NUM_C) & 1)
        if WORK:
            for i in range(CHUNKS):
                rows = row_start + i * EPI_ROWS_ + offs
                used = flag_rows.index(i).load(rows_layout) != 0.0
                w32 = weight_rows.index(i).load(rows_layout)
                if PREFETCH > 0:
                    ahead = i + PREFETCH
                    nxt = gl.minimum(ahead, CHUNKS - 1)
                    n_used = (flag_rows.index(nxt).load(rows_layout) != 0.0) & (ahead < CHUNKS)
                    n_gate, n_up = _chunk_loads(
                        gate_up_ptr, rows + PREFETCH * EPI_ROWS_, n_used, cols, N
                    )
                elif i > 0:
                    gate, up = _chunk_loads(gate_up_ptr, rows, used, cols, N)
                valid = rows < row_end
                read = used[:, None] & (cols < N)[None, :]
                store = valid[:, None] & (cols < N)[None, :]
                base = rows.to(gl.int64)[:, None] * (2 * N) + cols[None, :]
                grad = chunks.index(buf * CHUNKS + i).load(layout).to(gl.float32)
                grad = gl.where(read, grad, 0.0)
                g32 = gate.to(gl.float32)
                u32 = up.to(gl.float32)
                sig = 1.0 / (1.0 + gl.exp(-g32))
                silu = g32 * sig
                part = gl.sum(grad * silu * u32, axis=1)
                scaled = grad * w32[:, None]
                d_gate = scaled * u32 * sig * (1.0 + g32 * (1.0 - sig))
                gl.store(out_ptr + base, d_gate.to(dtype), mask=store)
                gl.store(out_ptr + base + N, (scaled * silu).to(dtype), mask=store)
                gl.store(part_ptr + rows.to(gl.int64) * num_n + pid_n, part, mask=valid)
                if PREFETCH == 2:
                    gate, up = gate1, up1
                    gate1, up1 = n_gate, n_up
                elif PREFETCH == 1:
                    gate, up = n_gate, n_up
        mbarrier.arrive(c_empty.index(buf))
        tiles += 1  # noqa: SIM113 (a loop-carried scalar)


@gluon.jit
def gluon_d_act_swiglu_kernel(
    a_desc,
    b_desc,
    sched_ptr,
    max_tiles,
    gate_up_ptr,
    w_ptr,
    order_ptr,
    out_ptr,
    part_ptr,
    N,
    K,
    NUM_STAGES: gl.constexpr,
    EPI_ROWS_: gl.constexpr,
    EPI_WARPS_: gl.constexpr,
    WORKER_REGS_: gl.constexpr,
    PREFETCH_: gl.constexpr,
    NUM_C_: gl.constexpr,
    WORK_: gl.constexpr,
    TILE_N_: gl.constexpr,
):
    """The gate/up gradient of the routed SwiGLU from ``grad @ w_down[e]`` (see the module
    docstring); ``a_desc`` views ``grad`` ``[M, K]`` in ``[BLOCK_M, BLOCK_K]`` boxes, ``b_desc``
    the weights as ``[E * K, N]`` in ``[BLOCK_K, TILE_N_]`` boxes (``TILE_N_`` keys the cached
    launch)."""
    dtype: gl.constexpr = a_desc.dtype
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(
        dtype, _stacked(NUM_STAGES, a_desc.block_type.shape), a_desc.layout
    )
    b_bufs = gl.allocate_shared_memory(
        dtype, _stacked(NUM_STAGES, b_desc.block_type.shape), b_desc.layout
    )
    c_bufs = gl.allocate_shared_memory(dtype, [NUM_C_, BM, BN], _tile_layout(EPI_ROWS_))
    # Per row of the tile: its routing weight, and 1.0 / 0.0 for an assignment / none.
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    weights = gl.allocate_shared_memory(gl.float32, [BM // EPI_ROWS_, EPI_ROWS_], row_layout)
    flags = gl.allocate_shared_memory(gl.float32, [BM // EPI_ROWS_, EPI_ROWS_], row_layout)
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
    # Partitions: the products (the kernel's 8 warps), the epilogue, the load warp.
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
                    False,
                ),
            ),
            (
                _epilogue,
                (
                    c_bufs,
                    c_ready,
                    c_empty,
                    weights,
                    flags,
                    sched_ptr,
                    max_tiles,
                    gate_up_ptr,
                    w_ptr,
                    order_ptr,
                    out_ptr,
                    part_ptr,
                    N,
                    EPI_ROWS_,
                    EPI_WARPS_,
                    PREFETCH_,
                    WORK_,
                ),
            ),
            (
                _loader,
                (a_desc, b_desc, a_bufs, b_bufs, ready, empty, sched_ptr, max_tiles, N, K, False),
            ),
        ],
        [EPI_WARPS_, 1],
        [WORKER_REGS_, WORKER_REGS_],
    )


@jit
def d_act_swiglu_finish_kernel(
    part_ptr,
    order_ptr,
    ends_ptr,
    num_experts,
    grad_w_ptr,
    out_ptr,
    rows,
    width2,
    num_assignments,
    NUM_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Each row's weight gradient (its ``NUM_N`` column-tile parts added in order) written at
    its assignment (rows without one: a spare last entry); the ``width2`` gate/up gradient
    columns of the rows past the last expert zeroed."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = r < rows
    last = tl.load(ends_ptr + num_experts - 1)
    computed = in_rows & (r < last)
    assignment = tl.load(order_ptr + r, mask=computed, other=-1)
    used = assignment >= 0
    total = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for j in tl.static_range(NUM_N):
        total += tl.load(part_ptr + r.to(tl.int64) * NUM_N + j, mask=used, other=0.0)
    target = tl.where(used, assignment, num_assignments)
    tl.store(grad_w_ptr + target, total.to(grad_w_ptr.dtype.element_ty), mask=in_rows)
    tail = in_rows & (r >= last)
    if tl.max(tail.to(tl.int32), axis=0) > 0:
        c = tl.arange(0, BLOCK_C)
        dtype = out_ptr.dtype.element_ty
        for c0 in range(0, width2, BLOCK_C):
            cols = c0 + c
            mask = tail[:, None] & (cols < width2)[None, :]
            ptrs = out_ptr + r.to(tl.int64)[:, None] * width2 + cols[None, :]
            tl.store(ptrs, tl.zeros((BLOCK_R, BLOCK_C), dtype=dtype), mask=mask)


def _check(
    grad: torch.Tensor,
    w_down: torch.Tensor,
    offsets: torch.Tensor,
    gate_up: torch.Tensor,
    weights: torch.Tensor,
    order: torch.Tensor,
) -> None:
    for name, tensor in (("grad", grad), ("w_down", w_down), ("gate_up", gate_up)):
        if tensor.dtype not in (torch.bfloat16, torch.float16) or tensor.dtype != grad.dtype:
            raise KernelDtypeError(
                f"{name}.dtype={tensor.dtype}: grad, w_down and gate_up must share one 16-bit dtype"
            )
    if grad.dim() != 2 or w_down.dim() != 3:
        raise KernelShapeError(
            f"grad.shape={tuple(grad.shape)} and w_down.shape={tuple(w_down.shape)} must be "
            "[M, H] and [E, H, F]"
        )
    rows, hidden = grad.shape
    experts, _, ffn = w_down.shape
    if (
        tuple(w_down.shape) != (experts, hidden, ffn)
        or tuple(gate_up.shape) != (rows, 2 * ffn)
        or ffn % D_ACT_BLOCK_N
        or hidden % BLOCK_K
        or tuple(offsets.shape) != (experts,)
        or offsets.dtype != torch.int32
        or tuple(order.shape) != (rows,)
        or order.dtype != torch.int64
        or weights.dim() != 1
    ):
        raise KernelShapeError(
            f"grad.shape={tuple(grad.shape)}, w_down.shape={tuple(w_down.shape)}, "
            f"gate_up.shape={tuple(gate_up.shape)}, offsets={tuple(offsets.shape)} "
            f"{offsets.dtype}, order={tuple(order.shape)} {order.dtype}, "
            f"weights={tuple(weights.shape)}: expected [M, H], [E, H, F], [M, 2F], [E] int32, "
            f"[M] int64 and 1-D weights, with F a multiple of {D_ACT_BLOCK_N} and H of {BLOCK_K}"
        )
    for name, tensor in (("grad", grad), ("w_down", w_down), ("gate_up", gate_up)):
        if tensor.device.type != "cuda":
            raise KernelDeviceError(f"{name}.device={tensor.device}: Gluon kernels need a GPU")


def gluon_d_act_swiglu(
    grad: torch.Tensor,
    w_down: torch.Tensor,
    offsets: torch.Tensor,
    gate_up: torch.Tensor,
    weights: torch.Tensor,
    order: torch.Tensor,
    *,
    schedule: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the routed SwiGLU's input and of its routing weights from the down
    projection's output gradient, without storing ``grad_act = grad[rows of e] @ w_down[e]``.

    Args:
        grad: ``[M, H]`` CUDA gradient of the down projection's output, rows sorted by expert.
        w_down: ``[E, H, F]`` down projection of each expert (F a multiple of
            :data:`D_ACT_BLOCK_N`, H of 64).
        offsets: ``[E]`` int32 end row of each expert.
        gate_up: ``[M, 2F]`` saved gate/up GEMM output (gate columns first).
        weights: ``[A]`` routing weight of each assignment.
        order: ``[M]`` int64 assignment of each row, -1 for a row without one.
        schedule: :func:`~mcore_kernels.moe.grouped_mm.tile_schedule` of ``offsets`` with
            :data:`BLOCK_M` rows per tile (built when None).

    Returns:
        ``(grad_gate_up [M, 2F], grad_weights [A])``: bitwise the gate/up gradient of the GEMM
        followed by the separate routed SwiGLU backward (rows past the last expert zero), the
        weight gradient in the weights' dtype (zero for an assignment without a row).

    Raises:
        KernelShapeError: If the shapes do not match or are not tile multiples.
        KernelDtypeError: If a dtype is not 16-bit or the dtypes differ.
        KernelDeviceError: If a tensor is not on a GPU.
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _check(grad, w_down, offsets, gate_up, weights, order)
    rows, hidden = grad.shape
    experts, _, ffn = w_down.shape
    out = torch.empty_like(gate_up)
    grad_w = torch.zeros(weights.numel() + 1, dtype=weights.dtype, device=weights.device)
    if rows == 0 or ffn == 0:
        return out, grad_w[:-1]
    grad, w_down, gate_up = grad.contiguous(), w_down.contiguous(), gate_up.contiguous()
    weights, order = weights.contiguous(), order.contiguous()
    if schedule is None:
        schedule = tile_schedule(offsets, rows, BLOCK_M)
    max_tiles = (schedule.shape[0] - 1) // 3
    num_n = ffn // D_ACT_BLOCK_N
    part = torch.empty(rows * num_n, dtype=torch.float32, device=grad.device)
    dtype = gl.bfloat16 if grad.dtype == torch.bfloat16 else gl.float16
    a_block = [BLOCK_M, BLOCK_K]
    b_block = [BLOCK_K, D_ACT_BLOCK_N]
    a_desc = TensorDescriptor.from_tensor(
        grad, a_block, gl.NVMMASharedLayout.get_default_for(a_block, dtype)
    )
    b_desc = TensorDescriptor.from_tensor(
        w_down.view(experts * hidden, ffn),
        b_block,
        gl.NVMMASharedLayout.get_default_for(b_block, dtype),
    )
    index = grad.device.index if grad.device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    programs = max(1, min(_NUM_SMS[index], max_tiles * num_n))
    # Through a CachedLauncher (the compiled kernel launched directly after the first call).
    launch(
        gluon_d_act_swiglu_kernel,
        (programs,),
        (a_desc, b_desc, schedule, max_tiles, gate_up, weights, order, out, part, ffn, hidden),
        dict(
            NUM_STAGES=STAGES,
            EPI_ROWS_=EPI_ROWS,
            EPI_WARPS_=EPI_WARPS,
            WORKER_REGS_=WORKER_REGS,
            PREFETCH_=PREFETCH,
            NUM_C_=TILE_BUFFERS,
            WORK_=EPILOGUE_WORK,
            TILE_N_=D_ACT_BLOCK_N,
        ),
        device=grad.device,
        num_warps=8,
    )
    block_r = 64
    launch(
        d_act_swiglu_finish_kernel,
        (cdiv(rows, block_r),),
        (part, order, offsets, experts, grad_w, out, rows, 2 * ffn, weights.numel()),
        dict(NUM_N=num_n, BLOCK_R=block_r, BLOCK_C=64),
        device=grad.device,
    )
    return out, grad_w[:-1]
