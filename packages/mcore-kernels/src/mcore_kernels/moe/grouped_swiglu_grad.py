"""The down projection's input gradient with the routed SwiGLU's backward in its epilogue.

In the routed experts' backward (:mod:`mcore_kernels.moe.routed`) the down projection's input
gradient ``grad_act[rows of e] = grad[rows of e] @ w_down[e]`` is only read by the weighted
SwiGLU's backward pass. :func:`m_grouped_swiglu_backward` computes both in one persistent
Triton kernel (the row-grouped GEMM of :func:`~mcore_kernels.moe.grouped_mm.m_grouped_mm`):
each output tile, rounded to the activations' dtype as the separate pass reads it, is turned
into the gate and up gradients of its rows and columns right away, so ``grad_act`` is never
written to or read back from memory and the separate pass is not launched. The routing
weights' gradient, a sum over the ``F`` columns of each row, is summed per column tile in
float32 and the tiles' partial sums are added per row by a second small kernel (no atomics:
bitwise reproducible). Its torch reference is
:func:`~mcore_kernels.moe.reference.m_grouped_swiglu_backward_reference`.
"""

from __future__ import annotations

import torch

from mcore_kernels._triton_utils import jit, tl
from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.moe._launch import cdiv, launch, next_power_of_2
from mcore_kernels.moe.grouped_mm import (
    PersistentTiles,
    _check,
    _m_job,
    _programs,
    _tma_ready,
    tile_schedule,
)
from mcore_kernels.moe.reference import m_grouped_swiglu_backward_reference

__all__ = ["m_grouped_swiglu_backward", "m_grouped_swiglu_backward_reference"]


@jit
def m_grouped_swiglu_grad_kernel(
    a_desc,
    b_desc,
    gate_up_ptr,
    w_ptr,
    order_ptr,
    out_ptr,
    partial_ptr,
    sched_ptr,
    max_tiles,
    N,
    K,
    ends_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    EXPERT_COLUMNS: tl.constexpr,
):
    """Tile of ``g = A[rows of e] @ B[e]`` (``b_desc`` views ``B`` as ``[E * K, N]``), rounded
    to the output dtype, then for each row ``m`` with assignment ``a = order[m]`` and gate and
    up values ``x``, ``u`` (``gate_up[m, :N]``, ``gate_up[m, N:]``): ``out[m, :N] = w[a] g u
    s (1 + x (1 - s))`` and ``out[m, N:] = w[a] g silu(x)`` with ``s = sigmoid(x)``, and the
    tile's float32 part of ``sum_n g silu(x) u`` at ``partial[m, column tile]``. A row without
    an assignment (``order[m] < 0``) gets zeros and reads no gate/up values."""
    N = tl.multiple_of(N, 16)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = tl.load(sched_ptr + 3 * max_tiles) * num_n
    dtype = out_ptr.dtype.element_ty
    for job in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row_start, row_end, n0 = _m_job(
            job, sched_ptr, ends_ptr, max_tiles, num_n, BLOCK_M, BLOCK_N, EXPERT_COLUMNS
        )
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            k0 = kk * BLOCK_K
            a = a_desc.load([row_start, k0])
            b = b_desc.load([expert * K + k0, n0])
            acc = tl.dot(a, b, acc)
        rows = row_start + tl.arange(0, BLOCK_M)
        in_rows = rows < row_end
        assignment = tl.load(order_ptr + rows, mask=in_rows, other=-1)
        used = assignment >= 0
        weight = tl.load(w_ptr + tl.where(used, assignment, 0), mask=used, other=0.0)
        weight = weight.to(tl.float32)
        base = rows.to(tl.int64) * (2 * N)
        # The separate pass reads the GEMM's rounded output; the epilogue runs in four column
        # quarters (fewer live registers).
        g = acc.to(dtype)
        lo, hi = tl.split(tl.permute(tl.reshape(g, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        q0, q1 = tl.split(tl.permute(tl.reshape(lo, (BLOCK_M, 2, BLOCK_N // 4)), (0, 2, 1)))
        q2, q3 = tl.split(tl.permute(tl.reshape(hi, (BLOCK_M, 2, BLOCK_N // 4)), (0, 2, 1)))
        part = _swiglu_grad_part(
            q0, 0, n0, gate_up_ptr, out_ptr, base, used, in_rows, weight, N, BLOCK_N
        )
        part += _swiglu_grad_part(
            q1, 1, n0, gate_up_ptr, out_ptr, base, used, in_rows, weight, N, BLOCK_N
        )
        part += _swiglu_grad_part(
            q2, 2, n0, gate_up_ptr, out_ptr, base, used, in_rows, weight, N, BLOCK_N
        )
        part += _swiglu_grad_part(
            q3, 3, n0, gate_up_ptr, out_ptr, base, used, in_rows, weight, N, BLOCK_N
        )
        tl.store(partial_ptr + rows.to(tl.int64) * num_n + n0 // BLOCK_N, part, mask=in_rows)


@jit
def _swiglu_grad_part(
    g, quarter, n0, gate_up_ptr, out_ptr, base, used, in_rows, weight, N, BLOCK_N: tl.constexpr
):
    """The weighted SwiGLU's backward on column quarter ``quarter`` of the row tile at column
    ``n0`` whose rounded ``grad_act`` quarter is ``g``: stores the gate and up gradients,
    returns each row's float32 ``sum g silu(x) u`` over these columns."""
    WIDTH: tl.constexpr = BLOCK_N // 4
    c0 = n0 + quarter * WIDTH
    # Quarters start at multiples of WIDTH (the tile's columns at multiples of 4 WIDTH)
    # and rows at multiples of 2N (N a multiple of 16): the loads and stores move 16 bytes
    # per thread.
    cols = tl.max_contiguous(tl.multiple_of(c0 + tl.arange(0, WIDTH), WIDTH), WIDTH)
    read = used[:, None] & (cols < N)[None, :]
    offs = tl.multiple_of(base, 16)[:, None] + cols[None, :]
    gate = tl.load(gate_up_ptr + offs, mask=read, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + offs + N, mask=read, other=0.0).to(tl.float32)
    grad = tl.where(read, g.to(tl.float32), 0.0)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    scaled = grad * weight[:, None]
    d_gate = scaled * up * sig * (1.0 + gate * (1.0 - sig))
    keep = in_rows[:, None] & (cols < N)[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs, d_gate.to(dtype), mask=keep)
    tl.store(out_ptr + offs + N, (scaled * silu).to(dtype), mask=keep)
    return tl.sum(grad * silu * up, axis=1)


@jit
def assignment_sums_kernel(
    partial_ptr,
    order_ptr,
    out_ptr,
    rows,
    num_assignments,
    NUM_N: tl.constexpr,
    N_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out[order[m]] = sum_j partial[m, j]`` (float32, rounded once) for a block of rows;
    rows without an assignment write their (unused) sum to the spare ``out[num_assignments]``
    and read nothing."""
    m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = m < rows
    assignment = tl.load(order_ptr + m, mask=ok, other=-1)
    used = assignment >= 0
    j = tl.arange(0, N_PAD)
    parts = tl.load(
        partial_ptr + m.to(tl.int64)[:, None] * NUM_N + j[None, :],
        mask=used[:, None] & (j < NUM_N)[None, :],
        other=0.0,
    )
    total = tl.sum(parts, axis=1)
    target = tl.where(used, assignment, num_assignments)
    tl.store(out_ptr + target, total.to(out_ptr.dtype.element_ty), mask=ok)


def m_grouped_swiglu_backward(
    grad: torch.Tensor,
    w_down: torch.Tensor,
    offsets: torch.Tensor,
    gate_up: torch.Tensor,
    weights: torch.Tensor,
    order: torch.Tensor,
    *,
    tiles: PersistentTiles,
    schedule: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the routed weighted SwiGLU through the down projection, in one kernel.

    ``grad_act[rows of e] = grad[rows of e] @ w_down[e]`` (rounded to the dtype of ``grad``),
    then the backward of ``act[m] = weights[order[m]] * silu(gate_up[m, :F]) * gate_up[m,
    F:]``, as :func:`~mcore_kernels.moe.routed.routed_experts` runs them one after the other.

    Args:
        grad: ``[M, H]`` gradient of the down projection's output, rows sorted by expert.
        w_down: ``[E, H, F]`` down projection of each expert.
        offsets: ``[E]`` int32 end row of each expert.
        gate_up: ``[M, 2F]`` gate/up projection of the forward (gate columns, then up).
        weights: ``[A]`` routing weight of each assignment.
        order: ``[M]`` int64 assignment of each row, -1 in a row without one.
        tiles: Tile shape of the row-grouped GEMM.
        schedule: :func:`~mcore_kernels.moe.grouped_mm.tile_schedule` of ``offsets`` with
            ``tiles.block_m`` (built when None).

    Returns:
        ``grad_gate_up`` ``[M, 2F]`` (zero in expert rows without an assignment; rows past
        ``offsets[-1]`` unwritten) and the weights' gradient ``[A]`` in their dtype (zero for
        an assignment without a row).

    Raises:
        KernelShapeError: If the shapes do not match, ``F`` is not a multiple of 16 or ``H``
            of ``tiles.block_k``.
        KernelDtypeError: If a dtype is not 16-bit, the dtypes differ or ``order`` is not
            int64.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    _check("grad", grad, 2)
    _check("w_down", w_down, 3)
    _check("gate_up", gate_up, 2)
    if not (grad.dtype == w_down.dtype == gate_up.dtype):
        raise KernelDtypeError(
            f"grad.dtype={grad.dtype}, w_down.dtype={w_down.dtype} and "
            f"gate_up.dtype={gate_up.dtype} must match"
        )
    if order.dtype != torch.int64:
        raise KernelDtypeError(f"order.dtype={order.dtype} must be int64")
    experts, hidden, ffn = w_down.shape
    rows = grad.shape[0]
    if (
        grad.shape[1] != hidden
        or tuple(gate_up.shape) != (rows, 2 * ffn)
        or tuple(order.shape) != (rows,)
        or tuple(offsets.shape) != (experts,)
        or weights.dim() != 1
        or ffn % 16
        or hidden % tiles.block_k
    ):
        raise KernelShapeError(
            f"grad.shape={tuple(grad.shape)}, w_down.shape={tuple(w_down.shape)}, "
            f"gate_up.shape={tuple(gate_up.shape)}, order.shape={tuple(order.shape)}, "
            f"offsets.shape={tuple(offsets.shape)}, weights.shape={tuple(weights.shape)}: "
            f"expected [M, H], [E, H, F], [M, 2F], [M], [E], [A] with F a multiple of 16 and "
            f"H of block_k={tiles.block_k}"
        )
    out = torch.empty_like(gate_up)
    assignments = weights.shape[0]
    # One spare entry takes the rows without an assignment; assignments without a row stay 0.
    grad_w = torch.zeros(assignments + 1, dtype=weights.dtype, device=weights.device)
    if rows == 0 or ffn == 0:
        return out, grad_w[:-1]
    grad, gate_up, order = _tma_ready(grad), gate_up.contiguous(), order.contiguous()
    w_down = w_down.contiguous()
    if schedule is None:
        schedule = tile_schedule(offsets, rows, tiles.block_m)
    max_tiles = (schedule.shape[0] - 1) // 3
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    num_n = cdiv(ffn, bn)
    partial = torch.empty(rows, num_n, dtype=torch.float32, device=grad.device)
    a_desc = TensorDescriptor.from_tensor(grad, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(w_down.view(experts * hidden, ffn), [bk, bn])
    programs = _programs(grad.device, tiles, max_tiles * num_n)
    launch(
        m_grouped_swiglu_grad_kernel,
        (programs,),
        (
            a_desc,
            b_desc,
            gate_up,
            weights.contiguous(),
            order,
            out,
            partial,
            schedule,
            max_tiles,
            ffn,
            hidden,
            offsets,
        ),
        dict(
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            NUM_PROGRAMS=programs,
            FLATTEN=tiles.flatten,
            EXPERT_COLUMNS=tiles.expert_columns,
        ),
        device=grad.device,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    block = 256
    launch(
        assignment_sums_kernel,
        (cdiv(rows, block),),
        (partial, order, grad_w, rows, assignments),
        dict(NUM_N=num_n, N_PAD=max(2, next_power_of_2(num_n)), BLOCK=block),
        device=grad.device,
    )
    return out, grad_w[:-1]
