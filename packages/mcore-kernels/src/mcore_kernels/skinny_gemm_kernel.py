"""The Triton kernel of :func:`mcore_kernels.skinny_gemm.skinny_gemm` and its RoPE + cache
write epilogue (one program: ``BLOCK_N`` weight rows times ``BLOCK_M`` tokens over one K slice;
see that module for the layout and the epilogues)."""

from __future__ import annotations

from mcore_kernels._triton_utils import gdc_launch_dependents, gdc_wait, jit, prefetch_l2, tl
from mcore_kernels.rotary_kv_write import _rotate_half

__all__ = ["skinny_gemm_kernel"]


@jit
def _rope_epilogue(
    acc,
    head,
    m0,
    rows,
    q_ptr,
    bias_ptr,
    stride_q_row,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_cos,
    stride_sin,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
):
    """One head's ``[D, tokens]`` product: round (plus bias) like the projection output, then
    rotate and store the query, or rotate and store the key, or store the value."""
    dtype = q_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    channels = tl.arange(0, HEAD_DIM)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + head * HEAD_DIM + channels).to(tl.float32)[:, None]
    values = acc.to(dtype)
    tokens = m0 + tl.arange(0, BLOCK_M)[None, :]
    token_mask = tokens < rows
    half = tl.arange(0, HALF)[:, None]
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        pair = tl.permute(tl.reshape(values.to(tl.float32), (2, HALF, BLOCK_M)), (1, 2, 0))
        x1, x2 = tl.split(pair)
        cos = tl.load(cos_ptr + tokens * stride_cos + half, mask=token_mask, other=0.0)
        sin = tl.load(sin_ptr + tokens * stride_sin + half, mask=token_mask, other=0.0)
        cos = cos.to(dtype).to(tl.float32)
        sin = sin.to(dtype).to(tl.float32)
        first, second = _rotate_half(x1, x2, cos, sin, dtype)
        if head < NUM_Q_HEADS:
            q_target = q_ptr + tokens * stride_q_row + head * HEAD_DIM + half
            tl.store(q_target, first, mask=token_mask)
            tl.store(q_target + HALF, second, mask=token_mask)
        else:
            key_slots = tl.load(slot_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
            key_head = head - NUM_Q_HEADS
            k_target = k_cache_ptr + key_slots * stride_kc_slot + key_head * stride_kc_head + half
            cache_dtype = k_cache_ptr.dtype.element_ty
            tl.store(k_target, first.to(cache_dtype), mask=token_mask)
            tl.store(k_target + HALF, second.to(cache_dtype), mask=token_mask)
    else:
        value_slots = tl.load(slot_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
        value_head = head - NUM_Q_HEADS - NUM_KV_HEADS
        v_target = v_cache_ptr + value_slots * stride_vc_slot + value_head * stride_vc_head
        value_dtype = v_cache_ptr.dtype.element_ty
        tl.store(v_target + channels[:, None], values.to(value_dtype), mask=token_mask)


@jit
def skinny_gemm_kernel(
    w_desc,
    x_desc,
    w_ptr,
    out_ptr,
    bias_ptr,
    residual_ptr,
    rows,
    outputs,
    inputs,
    stride_out_split,
    stride_out_row,
    stride_residual_row,
    k_per_split,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_cos,
    stride_sin,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    norm_eps,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PARTIALS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    ROPE: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    SWIGLU: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    tile_n = tl.program_id(0)
    split = tl.program_id(1)
    tile_m = tl.program_id(2)
    n0 = tile_n * BLOCK_N
    m0 = tile_m * BLOCK_M
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, inputs)
    if USE_PDL:
        gdc_launch_dependents()
        if PREFETCH_LINES > 0:
            # The weights do not depend on the previous kernel: request this program's slab
            # (one address per 128-byte line; clamped to the slab) while it drains.
            lines = tl.arange(0, PREFETCH_LINES)
            line_rows = n0 + lines // (PREFETCH_LINES // BLOCK_N)
            line_cols = k_begin + (lines % (PREFETCH_LINES // BLOCK_N)) * 64
            line_cols = tl.minimum(line_cols, k_end - 1)
            line_rows = tl.minimum(line_rows, outputs - 1)
            prefetch_l2(w_ptr + line_rows.to(tl.int64) * inputs + line_cols)
        gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([n0, k])
        x = x_desc.load([m0, k])
        acc = tl.dot(w, tl.trans(x), acc)
        if SWIGLU:
            # The up rows of the same features, and the rows' sum of squares for the norm.
            w_up = w_desc.load([outputs + n0, k])
            acc_up = tl.dot(w_up, tl.trans(x), acc_up)
            h = x.to(tl.float32)
            squares += tl.sum(h * h, axis=1)
    result = tl.trans(acc)
    offs_m = m0 + tl.arange(0, BLOCK_M)[:, None]
    offs_n = n0 + tl.arange(0, BLOCK_N)[None, :]
    mask = (offs_m < rows) & (offs_n < outputs)
    if ROPE:
        _rope_epilogue(
            acc,
            tile_n,
            m0,
            rows,
            out_ptr,
            bias_ptr,
            stride_out_row,
            cos_ptr,
            sin_ptr,
            k_cache_ptr,
            v_cache_ptr,
            slot_ptr,
            stride_cos,
            stride_sin,
            stride_kc_slot,
            stride_kc_head,
            stride_vc_slot,
            stride_vc_head,
            BLOCK_N,
            BLOCK_M,
            HAS_BIAS,
            NUM_Q_HEADS,
            NUM_KV_HEADS,
        )
    elif SWIGLU:
        # normed_swiglu of the rounded products: silu(r * gate) * (r * up), r the row's rstd.
        rstd = 1.0 / tl.sqrt(squares / inputs + norm_eps)
        dtype = out_ptr.dtype.element_ty
        gate = result.to(dtype).to(tl.float32) * rstd[:, None]
        up = tl.trans(acc_up).to(dtype).to(tl.float32) * rstd[:, None]
        activation = gate / (1.0 + tl.exp(-gate)) * up
        target = out_ptr + offs_m * stride_out_row + offs_n
        tl.store(target, activation.to(dtype), mask=mask)
    elif PARTIALS:
        target = out_ptr + split * stride_out_split + offs_m * stride_out_row + offs_n
        tl.store(target, result, mask=mask)
    else:
        if HAS_BIAS:
            result += tl.load(bias_ptr + offs_n, mask=offs_n < outputs, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            residual = tl.load(
                residual_ptr + offs_m * stride_residual_row + offs_n, mask=mask, other=0.0
            )
            result += residual.to(tl.float32)
        target = out_ptr + offs_m * stride_out_row + offs_n
        tl.store(target, result.to(out_ptr.dtype.element_ty), mask=mask)
