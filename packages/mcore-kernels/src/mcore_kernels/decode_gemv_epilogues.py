"""Triton epilogues of the decode projection: bias, rounding, SwiGLU, residual add and the
store of a tile (:func:`_epilogue`), RoPE with the key/value cache write
(:func:`_rope_epilogue`), and the early loads of what they read (:func:`_early_bias`,
:func:`_early_inputs`), requested before the products so their latency overlaps them."""

from __future__ import annotations

from mcore_kernels._triton_utils import jit, round_to, tl


@jit
def _epilogue(
    acc,
    acc_up,
    bias_ptr,
    res_ptr,
    out_ptr,
    offs_m,
    offs_n,
    m_mask,
    N_OUT,
    stride_rm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    DTYPE: tl.constexpr,
    pre_bias,
    pre_bias_up,
    pre_res,
    PRE: tl.constexpr,
):
    """Bias, rounding, SwiGLU, residual add and the store of one ``[BLOCK_M, BLOCK_N]`` tile.

    With ``PRE`` the bias and residual tiles come loaded already (``pre_*``, see
    :func:`_early_epilogue_loads`).
    """
    n_mask = offs_n < N_OUT
    if HAS_BIAS:
        if PRE:
            acc += pre_bias[None, :]
        else:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = round_to(acc, DTYPE).to(tl.float32)
    if SWIGLU:
        if HAS_BIAS:
            if PRE:
                acc_up += pre_bias_up[None, :]
            else:
                acc_up += tl.load(bias_ptr + N_OUT + offs_n, mask=n_mask, other=0.0).to(tl.float32)[
                    None, :
                ]
        up = round_to(acc_up, DTYPE).to(tl.float32)
        y = round_to(y * tl.sigmoid(y) * up, DTYPE).to(tl.float32)
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RESIDUAL:
        if PRE:
            r = pre_res
        else:
            r = tl.load(
                res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0
            )
        y = round_to(y + r.to(tl.float32), DTYPE).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], round_to(y, DTYPE), mask=mask)


@jit
def _rope_epilogue(
    acc,
    acc_up,
    bias_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_cos,
    stride_sin,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    offs_m,
    offs_n,
    m_mask,
    N_PAIRS,
    stride_om,
    NUM_Q_HEADS,
    NUM_KV_HEADS,
    HAS_BIAS: tl.constexpr,
    HALF: tl.constexpr,
    DTYPE: tl.constexpr,
    pre_bias,
    pre_bias_up,
    pre_cos,
    pre_sin,
    PRE: tl.constexpr,
):
    """RoPE and the key/value cache write of a q/k/v tile of ``(first, second)``-half pairs.

    Column ``c`` of the tile is pair ``offs_n[c]``: channel ``j`` and ``j + HALF`` of one head.
    Query heads are rotated and stored to ``out`` (``[M, NUM_Q_HEADS * 2 * HALF]``), key heads
    rotated and stored to the key cache, value heads stored to the value cache, each at the
    row's slot, with the roundings of :func:`mcore_kernels.rotary_kv_write.rotary_kv_write`.
    """
    n_mask = offs_n < N_PAIRS
    head = offs_n // HALF
    j = offs_n % HALF
    row = head * (2 * HALF) + j
    if HAS_BIAS:
        if PRE:
            acc += pre_bias[None, :]
            acc_up += pre_bias_up[None, :]
        else:
            acc += tl.load(bias_ptr + row, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            acc_up += tl.load(bias_ptr + row + HALF, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    x1 = round_to(acc, DTYPE).to(tl.float32)
    x2 = round_to(acc_up, DTYPE).to(tl.float32)
    mask = m_mask[:, None] & n_mask[None, :]
    # The tables are rounded to the activation dtype first, as the unfused expression does.
    if PRE:
        cos = pre_cos
        sin = pre_sin
    else:
        cos = tl.load(cos_ptr + offs_m[:, None] * stride_cos + j[None, :], mask=mask, other=0.0)
        sin = tl.load(sin_ptr + offs_m[:, None] * stride_sin + j[None, :], mask=mask, other=0.0)
    cos = cos.to(DTYPE).to(tl.float32)
    sin = sin.to(DTYPE).to(tl.float32)
    first = (x1 * cos).to(DTYPE).to(tl.float32) - (x2 * sin).to(DTYPE).to(tl.float32)
    second = (x2 * cos).to(DTYPE).to(tl.float32) + (x1 * sin).to(DTYPE).to(tl.float32)
    first = first.to(DTYPE)
    second = second.to(DTYPE)
    is_query = head < NUM_Q_HEADS
    is_key = (head >= NUM_Q_HEADS) & (head < NUM_Q_HEADS + NUM_KV_HEADS)
    is_value = head >= NUM_Q_HEADS + NUM_KV_HEADS
    target = out_ptr + offs_m[:, None] * stride_om + row[None, :]
    query_mask = mask & is_query[None, :]
    tl.store(target, first, mask=query_mask)
    tl.store(target + HALF, second, mask=query_mask)
    slot = tl.load(slot_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    kv_head = head - NUM_Q_HEADS
    key_target = (
        k_cache_ptr + slot[:, None] * stride_kc_slot + (kv_head * stride_kc_head + j)[None, :]
    )
    key_dtype = k_cache_ptr.dtype.element_ty
    key_mask = mask & is_key[None, :]
    tl.store(key_target, first.to(key_dtype), mask=key_mask)
    tl.store(key_target + HALF, second.to(key_dtype), mask=key_mask)
    value_head = kv_head - NUM_KV_HEADS
    value_target = (
        v_cache_ptr + slot[:, None] * stride_vc_slot + (value_head * stride_vc_head + j)[None, :]
    )
    value_dtype = v_cache_ptr.dtype.element_ty
    value_mask = mask & is_value[None, :]
    tl.store(value_target, x1.to(DTYPE).to(value_dtype), mask=value_mask)
    tl.store(value_target + HALF, x2.to(DTYPE).to(value_dtype), mask=value_mask)


@jit
def _early_bias(bias_ptr, offs_n, n_mask, N_OUT, HAS_BIAS: tl.constexpr, ROPE: tl.constexpr,
                SWIGLU: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """The bias of the tile's columns (and of their paired columns), float32."""
    first = tl.zeros(offs_n.shape, tl.float32)
    second = first
    if HAS_BIAS:
        if ROPE:
            pair = tl.where(n_mask, offs_n, 0)
            row = (pair // HALF) * (2 * HALF) + pair % HALF
            first = tl.load(bias_ptr + row, mask=n_mask, other=0.0).to(tl.float32)
            second = tl.load(bias_ptr + row + HALF, mask=n_mask, other=0.0).to(tl.float32)
        else:
            first = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            if SWIGLU:
                second = tl.load(bias_ptr + N_OUT + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    return first, second


@jit
def _early_inputs(res_ptr, cos_ptr, sin_ptr, offs_m, offs_n, m_mask, n_mask, stride_rm,
                  stride_cos, stride_sin, HAS_RESIDUAL: tl.constexpr, ROPE: tl.constexpr,
                  HALF: tl.constexpr):  # fmt: skip
    """The residual tile, or the RoPE cosines and sines of the tile's pairs."""
    mask = m_mask[:, None] & n_mask[None, :]
    res = tl.zeros([offs_m.shape[0], offs_n.shape[0]], tl.float32)
    cos = res
    sin = res
    if HAS_RESIDUAL:
        res = tl.load(
            res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0
        ).to(tl.float32)
    if ROPE:
        j = offs_n % HALF
        cos = tl.load(cos_ptr + offs_m[:, None] * stride_cos + j[None, :], mask=mask, other=0.0)
        sin = tl.load(sin_ptr + offs_m[:, None] * stride_sin + j[None, :], mask=mask, other=0.0)
    return res, cos, sin
