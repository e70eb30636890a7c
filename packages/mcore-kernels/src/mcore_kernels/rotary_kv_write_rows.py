"""RoPE + key/value cache write with one program per token (every head of it in one tile).

:func:`mcore_kernels.rotary_kv_write.rotary_kv_write` runs one program of one warp per (token,
head): at 512 decode tokens of a 14 + 2 head model that is 9,216 programs of 32 channel pairs
each, and the launch, not the bytes, sets the time (6.1 us per layer on one H200 where the
bytes take about one). Here one program handles a token: its query heads as one
``[Hq, D / 2]`` tile pair, its key and value heads as ``[Hkv, D / 2]`` tiles: 1.96 against
6.13 us at 512 tokens, 1.65 against 1.80 at 64 (one H200, 14 + 2 heads of 64 channels, CUDA
graph replays). The arithmetic is the same expression element for element
(:func:`~mcore_kernels.rotary_kv_write._rotate_half`, the same roundings to the activation
dtype); with 2 or 4 warps per program the results were the same bits as ``rotary_kv_write``
at 1 to 512 tokens on that GPU, with 1 warp they were not (the compiler's choice of fused
multiply-adds may follow the thread layout), so the engine uses 4.

Same arguments, shapes and result as ``rotary_kv_write`` (see there); CUDA only (the engine
calls it where the Triton path of ``rotary_kv_write`` would run).
"""

from __future__ import annotations

import torch

from mcore_kernels._triton_utils import gdc_launch_dependents, gdc_wait, jit, next_power_of_2, tl
from mcore_kernels._validation import check_rotary_kv_write_args
from mcore_kernels._validation import flat_cache_slots as _flat_slots
from mcore_kernels.errors import KernelBackendError, KernelShapeError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.rotary_kv_write import _rotate_half

__all__ = ["rotary_kv_write_rows"]


@jit
def _rotary_kv_write_rows_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cos_token,
    stride_sin_token,
    stride_out_token,
    stride_out_head,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    channels = tl.arange(0, HALF_PAD)[None, :]
    channel_mask = channels < HALF
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + token * stride_cos_token + channels, mask=channel_mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_sin_token + channels, mask=channel_mask, other=0.0)
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)

    q_heads = tl.arange(0, Q_HEADS_PAD)[:, None]
    q_mask = (q_heads < NUM_Q_HEADS) & channel_mask
    q_source = q_ptr + token * stride_q_token + q_heads * stride_q_head + channels
    x1 = tl.load(q_source, mask=q_mask, other=0.0).to(tl.float32)
    x2 = tl.load(q_source + HALF, mask=q_mask, other=0.0).to(tl.float32)
    first, second = _rotate_half(x1, x2, cos, sin, dtype)
    q_target = q_out_ptr + token * stride_out_token + q_heads * stride_out_head + channels
    tl.store(q_target, first, mask=q_mask)
    tl.store(q_target + HALF, second, mask=q_mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    kv_heads = tl.arange(0, KV_HEADS_PAD)[:, None]
    kv_mask = (kv_heads < NUM_KV_HEADS) & channel_mask
    k_source = k_ptr + token * stride_k_token + kv_heads * stride_k_head + channels
    y1 = tl.load(k_source, mask=kv_mask, other=0.0).to(tl.float32)
    y2 = tl.load(k_source + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    k_first, k_second = _rotate_half(y1, y2, cos, sin, k_ptr.dtype.element_ty)
    cache_dtype = k_cache_ptr.dtype.element_ty
    k_target = k_cache_ptr + slot * stride_kc_slot + kv_heads * stride_kc_head + channels
    tl.store(k_target, k_first.to(cache_dtype), mask=kv_mask)
    tl.store(k_target + HALF, k_second.to(cache_dtype), mask=kv_mask)
    v_source = v_ptr + token * stride_v_token + kv_heads * stride_v_head + channels
    v_target = v_cache_ptr + slot * stride_vc_slot + kv_heads * stride_vc_head + channels
    value_dtype = v_cache_ptr.dtype.element_ty
    low = tl.load(v_source, mask=kv_mask, other=0.0)
    high = tl.load(v_source + HALF, mask=kv_mask, other=0.0)
    tl.store(v_target, low.to(value_dtype), mask=kv_mask)
    tl.store(v_target + HALF, high.to(value_dtype), mask=kv_mask)


def rotary_kv_write_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_warps: int = 4,
) -> torch.Tensor:
    """``rotary_kv_write`` with one program per token (same bits, far fewer programs).

    Args:
        q: ``[T, Hq, D]`` new queries.
        k: ``[T, Hkv, D]`` new keys.
        v: ``[T, Hkv, D]`` new values.
        cos: float32 ``[T, D // 2]`` RoPE cosines.
        sin: float32 ``[T, D // 2]`` RoPE sines.
        k_cache: One layer's key cache ``[num_blocks, block_size, Hkv, D]`` (written in place).
        v_cache: One layer's value cache, shaped like ``k_cache`` (written in place).
        slot_mapping: ``[T]`` flat cache slot of each token.
        num_warps: Warps per program.

    Returns:
        The rotated queries ``[T, Hq, D]`` (contiguous, dtype of ``q``).

    Raises:
        KernelShapeError: If the shapes do not match the layout above.
        KernelDtypeError: If a dtype is unsupported.
        KernelBackendError: If Triton is not installed or the tensors are not on a GPU (and
            ``TRITON_INTERPRET=1`` is not set).
    """
    check_rotary_kv_write_args(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    if tl is None:
        raise KernelBackendError("rotary_kv_write_rows needs triton, which is not installed")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    for name, tensor in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        if tensor.stride(-1) != 1:
            raise KernelShapeError(
                f"{name} has strides {tensor.stride()}; expected a contiguous last dimension"
            )
    keys = _flat_slots(k_cache, "k_cache")
    values = _flat_slots(v_cache, "v_cache")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise KernelShapeError("k_cache and v_cache must have a contiguous last dimension")
    half = head_dim // 2
    use_pdl = pdl_enabled(q.device)
    _rotary_kv_write_rows_kernel[(num_tokens,)](
        q,
        k,
        v,
        cos,
        sin,
        out,
        keys,
        values,
        slot_mapping.contiguous(),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PAD=next_power_of_2(num_q_heads),
        KV_HEADS_PAD=next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PAD=next_power_of_2(half),
        USE_PDL=use_pdl,
        num_warps=num_warps,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out
