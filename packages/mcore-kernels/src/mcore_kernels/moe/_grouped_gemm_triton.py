"""Triton kernels of the grouped expert GEMMs (launchers in :mod:`mcore_kernels.moe.grouped_gemm`).

Rows ``starts[e]:ends[e]`` of the token matrix belong to expert ``e`` (consecutive groups for
dropless routing, ``capacity``-strided ones for drop-and-pad, whose padding rows are skipped). The row-tile kernel
covers every ``(expert, row tile, column tile)`` of a product whose weight is picked per
expert; its grid is an upper bound on the number of row tiles (``cdiv(M, BLOCK_M) + E``), so
the group sizes never leave the device, and each program finds its expert from the per-expert
tile counts it recomputes from ``ends``. The weight-gradient kernel covers every
``(expert, output tile)`` and reduces over the rows of its expert. Every output element is
written by one program, without atomics: results are bitwise reproducible.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["grouped_rows_kernel", "grouped_weight_grad_kernel"]


@triton.jit
def _locate_tile(
    starts_ptr, ends_ptr, tile, num_experts, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr
):
    """Expert, first row and end row of row tile ``tile`` (expert ``num_experts`` past the
    last tile)."""
    ids = tl.arange(0, E_PAD)
    valid = ids < num_experts
    ends = tl.load(ends_ptr + ids, mask=valid, other=0).to(tl.int32)
    starts = tl.load(starts_ptr + ids, mask=valid, other=0).to(tl.int32)
    tiles = tl.where(valid, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, axis=0)
    expert = tl.sum((cum <= tile).to(tl.int32), axis=0)
    hit = ids == expert
    first_tile = tl.sum(tl.where(hit, cum - tiles, 0), axis=0)
    start = tl.sum(tl.where(hit, starts, 0), axis=0)
    end = tl.sum(tl.where(hit, ends, 0), axis=0)
    return expert, start + (tile - first_tile) * BLOCK_M, end


@triton.jit
def grouped_rows_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    aux_ptr,
    act_ptr,
    index_ptr,
    starts_ptr,
    ends_ptr,
    num_experts,
    N,
    K,
    stride_am,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    up_offset,
    INDEX_DIV: tl.constexpr,
    GATHER: tl.constexpr,
    EPILOGUE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """``C[rows of e] = A[rows of e] @ B[e]`` (``PRECISION``: "ieee" for float32 inputs, else
    None, Triton's default) with ``B[e][k, n]`` at ``b + e*stride_be +
    k*stride_bk + n*stride_bn``.

    ``GATHER``: row ``r`` of A is row ``index[r] // INDEX_DIV`` of ``a`` (the permutation of the
    tokens folded into the load). ``EPILOGUE``:

    - 0: store ``C``.
    - 1 (SwiGLU forward): ``B`` has ``2 * N`` columns, the up columns ``up_offset`` columns
      after the gate ones; store the gate/up product into ``aux`` (``[M, 2N]``, saved for the
      backward pass) and ``silu(gate) * up`` into ``C`` (``[M, N]``).
    - 2 (SwiGLU backward): ``C`` is the gradient of the activation; read the saved gate/up
      from ``aux`` and store the gate/up gradient into ``act`` (``[M, 2N]``) and nothing else.
    """
    num_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    tile = pid // num_n
    pid_n = pid % num_n
    expert, row_start, row_end = _locate_tile(
        starts_ptr, ends_ptr, tile, num_experts, BLOCK_M, E_PAD
    )
    if expert >= num_experts:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    if GATHER:
        src = tl.load(index_ptr + rows, mask=row_ok, other=0) // INDEX_DIV
    else:
        src = rows
    src = src.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None] * stride_am + ks[None, :]
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    b_ptrs = b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EPILOGUE == 1:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if EPILOGUE == 1:
            b_up = tl.load(
                b_ptrs + up_offset * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0
            )
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    mask = row_ok[:, None] & col_ok[None, :]
    out_rows = rows.to(tl.int64)[:, None]
    dtype = c_ptr.dtype.element_ty
    if EPILOGUE == 0:
        tl.store(c_ptr + out_rows * stride_cm + cols[None, :], acc.to(dtype), mask=mask)
    elif EPILOGUE == 1:
        gate = acc.to(dtype)
        up = acc_up.to(dtype)
        aux = aux_ptr + out_rows * (2 * N) + cols[None, :]
        tl.store(aux, gate, mask=mask)
        tl.store(aux + N, up, mask=mask)
        # The activation of the rounded gate/up values, as the unfused kernels compute it.
        g = gate.to(tl.float32)
        silu = g / (1.0 + tl.exp(-g))
        act = silu * up.to(tl.float32)
        tl.store(c_ptr + out_rows * stride_cm + cols[None, :], act.to(dtype), mask=mask)
    else:
        aux = aux_ptr + out_rows * (2 * N) + cols[None, :]
        g = tl.load(aux, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(aux + N, mask=mask, other=0.0).to(tl.float32)
        d = acc.to(dtype).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        d_gate = d * u * sig * (1.0 + g * (1.0 - sig))
        d_up = d * g * sig
        out = act_ptr + out_rows * (2 * N) + cols[None, :]
        tl.store(out, d_gate.to(dtype), mask=mask)
        tl.store(out + N, d_up.to(dtype), mask=mask)


@triton.jit
def grouped_weight_grad_kernel(
    g_ptr,
    x_ptr,
    out_ptr,
    index_ptr,
    starts_ptr,
    ends_ptr,
    N,
    K,
    stride_gm,
    stride_xm,
    INDEX_DIV: tl.constexpr,
    GATHER: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[e] = G[rows of e].T @ X[rows of e]`` (``[N, K]`` per expert; zero for an expert
    without rows). ``GATHER``: row ``r`` of X is row ``index[r] // INDEX_DIV`` of ``x``."""
    expert = tl.program_id(1)
    num_k = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    pid_n = pid // num_k
    pid_k = pid % num_k
    start = tl.load(starts_ptr + expert).to(tl.int32)
    end = tl.load(ends_ptr + expert).to(tl.int32)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = ns < N
    k_ok = ks < K
    base = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + base
        row_ok = rows < end
        if GATHER:
            src = tl.load(index_ptr + rows, mask=row_ok, other=0) // INDEX_DIV
        else:
            src = rows
        g = tl.load(
            g_ptr + rows.to(tl.int64)[None, :] * stride_gm + ns[:, None],
            mask=n_ok[:, None] & row_ok[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + src.to(tl.int64)[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(g, x, acc, input_precision=PRECISION)
    out = out_ptr + expert.to(tl.int64) * N * K + ns[:, None] * K + ks[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])
