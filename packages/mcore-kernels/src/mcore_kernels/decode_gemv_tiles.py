"""Triton building blocks of the decode projection's main loop: the RMSNorm scales of the
input rows, the weight tile loads and the float32 accumulation of one reduction slice."""

from __future__ import annotations

from mcore_kernels._triton_utils import jit, round_to, tl


@jit
def _row_scales(
    x_ptr, offs_m, m_mask, K, stride_xm, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
):
    """``rsqrt(mean(x**2) + eps)`` of every row (float32 ``[BLOCK_M]``)."""
    offs_k = tl.arange(0, BLOCK_K)
    sum_sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :],
            mask=m_mask[:, None] & (k < K)[None, :],
            other=0.0,
        ).to(tl.float32)
        sum_sq += x * x
    return 1.0 / tl.sqrt(tl.sum(sum_sq, axis=1) / K + eps)


@jit
def _load_tile(w_ptr, w_rows, up_rows, k, k_end, PAIRED: tl.constexpr, MASKED: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile (and the paired tile: SwiGLU's up rows, RoPE's
    second halves) at ``k``."""
    k_mask = k < k_end
    if MASKED:
        w = tl.load(w_ptr + w_rows[:, None] + k[None, :], mask=k_mask[None, :], other=0.0)
    else:
        w = tl.load(w_ptr + w_rows[:, None] + k[None, :])
    w_up = w
    if PAIRED:
        if MASKED:
            w_up = tl.load(w_ptr + up_rows[:, None] + k[None, :], mask=k_mask[None, :], other=0.0)
        else:
            w_up = tl.load(w_ptr + up_rows[:, None] + k[None, :])
    return w, w_up


@jit
def _accumulate(
    acc,
    acc_up,
    w,
    w_up,
    x_ptr,
    w_ptr,
    norm_ptr,
    scales,
    offs_m,
    m_mask,
    w_rows,
    up_rows,
    k,
    k_end,
    M,
    stride_xm,
    pid_m,
    HAS_NORM: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_DOT: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PRELOADED: tl.constexpr,
    pre_gamma,
    PRE_GAMMA: tl.constexpr,
):
    """Add one ``BLOCK_K`` slice of the products to the accumulators (masked: the tail)."""
    dtype = x_ptr.dtype.element_ty
    k_mask = k < k_end
    if not PRELOADED:
        w, w_up = _load_tile(w_ptr, w_rows, up_rows, k, k_end, PAIRED, MASKED)
    gamma = k_mask.to(tl.float32)
    if HAS_NORM:
        if PRE_GAMMA:
            gamma = pre_gamma
        else:
            gamma = tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    if USE_DOT:
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if HAS_NORM:
            x = round_to(x.to(tl.float32) * scales[:, None] * gamma[None, :], dtype)
        if UPCAST_DOT:
            # The interpreter's tl.dot misreads bfloat16 operands; float32 ones are exact.
            x = x.to(tl.float32)
            w = w.to(tl.float32)
            w_up = w_up.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        if PAIRED:
            acc_up += tl.dot(x, tl.trans(w_up), input_precision=DOT_PRECISION)
    else:
        wf = w.to(tl.float32)
        wf_up = w_up.to(tl.float32)
        for row in tl.static_range(BLOCK_M):
            m = pid_m * BLOCK_M + row
            # Rows past M re-read row M - 1; their results are never stored.
            xr = tl.load(x_ptr + tl.minimum(m, M - 1) * stride_xm + k, mask=k_mask, other=0.0)
            if HAS_NORM:
                scale = tl.sum(tl.where(offs_m == m, scales, 0.0), axis=0)
                xr = round_to(xr.to(tl.float32) * scale * gamma, dtype)
            xf = xr.to(tl.float32)
            here = offs_m[:, None] == m
            acc = tl.where(here, acc + tl.sum(wf * xf[None, :], axis=1)[None, :], acc)
            if PAIRED:
                acc_up = tl.where(
                    here, acc_up + tl.sum(wf_up * xf[None, :], axis=1)[None, :], acc_up
                )
    return acc, acc_up
