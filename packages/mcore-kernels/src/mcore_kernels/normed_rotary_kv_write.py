"""RoPE + cache write of a q/k/v product whose input RMSNorm is folded into the weight.

``rms_norm(x, w) @ W.T + b`` equals ``rstd(x) * (x @ (W * w).T) + b`` row by row (``rstd(x) =
1 / sqrt(mean(x^2) + eps)``): with the norm weight in a copy of the q/k/v weight, the GEMM reads
the residual stream ``x`` itself and no norm kernel runs before it. This kernel then finishes
the projection per token (scale by ``rstd(x)``, add the bias, round to the activation dtype, as
a GEMM's bias epilogue rounds) and does what :func:`mcore_kernels.rotary_kv_write.
rotary_kv_write` does: rotates the queries and keys, stores the keys and values in their cache
slots and returns the rotated queries. One program per token; it reduces its row of ``x`` (a
few KB from L2) before its heads.

Shapes: ``qkv`` ``[T, (Hq + 2 Hkv) * D]`` (rows contiguous), ``x`` ``[T, H]``, ``bias``
``[(Hq + 2 Hkv) * D]`` or None, the rest as for ``rotary_kv_write``. Dispatch: Triton on CUDA,
the torch reference on CPU; ``MCORE_KERNELS_BACKEND=torch|triton`` overrides (with
``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors).
"""

from __future__ import annotations

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    CachedLauncher,
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    on_device_of,
    rotate_half_rounded,
    tl,
)
from mcore_kernels._validation import check_rotary_kv_write_args
from mcore_kernels._validation import flat_cache_slots as _flat_slots
from mcore_kernels.errors import KernelShapeError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import normed_qkv_reference, rotary_kv_write_reference

__all__ = ["normed_qkv_reference", "normed_rotary_kv_write"]


@jit
def _finish(raw, rstd, bias_ptr, offsets, mask, HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr):
    """``round(rstd * raw + bias)`` in float32 (the projection's rounding)."""
    value = raw.to(tl.float32) * rstd
    if HAS_BIAS:
        value += tl.load(bias_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return value.to(DTYPE).to(tl.float32)


@jit
def _normed_rotary_kv_write_kernel(
    qkv_ptr,
    x_ptr,
    bias_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qkv_token,
    stride_x_token,
    stride_cos_token,
    stride_sin_token,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    hidden,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HIDDEN_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    head_dim = 2 * HALF
    channels = tl.arange(0, HALF_PAD)[None, :]
    channel_mask = channels < HALF
    dtype = qkv_ptr.dtype.element_ty
    row = qkv_ptr + token * stride_qkv_token
    q_heads = tl.arange(0, Q_HEADS_PAD)[:, None]
    q_mask = (q_heads < NUM_Q_HEADS) & channel_mask
    q_offsets = q_heads * head_dim + channels
    kv_heads = tl.arange(0, KV_HEADS_PAD)[:, None]
    kv_mask = (kv_heads < NUM_KV_HEADS) & channel_mask
    k_offsets = NUM_Q_HEADS * head_dim + kv_heads * head_dim + channels
    v_offsets = k_offsets + NUM_KV_HEADS * head_dim
    # Every load of the token first: they are in flight while its row scale is reduced.
    x1 = tl.load(row + q_offsets, mask=q_mask, other=0.0)
    x2 = tl.load(row + q_offsets + HALF, mask=q_mask, other=0.0)
    y1 = tl.load(row + k_offsets, mask=kv_mask, other=0.0)
    y2 = tl.load(row + k_offsets + HALF, mask=kv_mask, other=0.0)
    low = tl.load(row + v_offsets, mask=kv_mask, other=0.0)
    high = tl.load(row + v_offsets + HALF, mask=kv_mask, other=0.0)
    cos = tl.load(cos_ptr + token * stride_cos_token + channels, mask=channel_mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_sin_token + channels, mask=channel_mask, other=0.0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    columns = tl.arange(0, HIDDEN_BLOCK)
    h = tl.load(x_ptr + token * stride_x_token + columns, mask=columns < hidden, other=0.0)
    h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)

    x1 = _finish(x1, rstd, bias_ptr, q_offsets, q_mask, HAS_BIAS, dtype)
    x2 = _finish(x2, rstd, bias_ptr, q_offsets + HALF, q_mask, HAS_BIAS, dtype)
    first, second = rotate_half_rounded(x1, x2, cos, sin, dtype)
    q_target = q_out_ptr + token * (NUM_Q_HEADS * head_dim) + q_offsets
    tl.store(q_target, first, mask=q_mask)
    tl.store(q_target + HALF, second, mask=q_mask)

    y1 = _finish(y1, rstd, bias_ptr, k_offsets, kv_mask, HAS_BIAS, dtype)
    y2 = _finish(y2, rstd, bias_ptr, k_offsets + HALF, kv_mask, HAS_BIAS, dtype)
    k_first, k_second = rotate_half_rounded(y1, y2, cos, sin, dtype)
    cache_dtype = k_cache_ptr.dtype.element_ty
    k_target = k_cache_ptr + slot * stride_kc_slot + kv_heads * stride_kc_head + channels
    tl.store(k_target, k_first.to(cache_dtype), mask=kv_mask)
    tl.store(k_target + HALF, k_second.to(cache_dtype), mask=kv_mask)

    low = _finish(low, rstd, bias_ptr, v_offsets, kv_mask, HAS_BIAS, dtype)
    high = _finish(high, rstd, bias_ptr, v_offsets + HALF, kv_mask, HAS_BIAS, dtype)
    value_dtype = v_cache_ptr.dtype.element_ty
    v_target = v_cache_ptr + slot * stride_vc_slot + kv_heads * stride_vc_head + channels
    tl.store(v_target, low.to(value_dtype), mask=kv_mask)
    tl.store(v_target + HALF, high.to(value_dtype), mask=kv_mask)


_LAUNCHER = CachedLauncher(_normed_rotary_kv_write_kernel)
_LAUNCHER_PDL = CachedLauncher(_normed_rotary_kv_write_kernel, launch_pdl=True)


def _split(
    qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[T, (Hq + 2 Hkv) * D]`` as ``[T, H, D]`` q, k and v views."""
    q, k, v = qkv.split(
        [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    return (
        q.unflatten(-1, (-1, head_dim)),
        k.unflatten(-1, (-1, head_dim)),
        v.unflatten(-1, (-1, head_dim)),
    )


def normed_rotary_kv_write(
    qkv: torch.Tensor,
    x: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
) -> torch.Tensor:
    """Finish a norm-folded q/k/v projection, rotate by RoPE and write the cache, one launch.

    Args:
        qkv: ``[T, (Hq + 2 Hkv) * D]`` product ``x @ (W * w).T`` (``w`` the input RMSNorm
            weight), last dimension contiguous.
        x: ``[T, H]`` rows of that product (the residual stream), last dimension contiguous.
        eps: The folded norm's epsilon.
        bias: ``[(Hq + 2 Hkv) * D]`` q/k/v bias, or None.
        cos: float32 ``[T, D // 2]`` RoPE cosines.
        sin: float32 ``[T, D // 2]`` RoPE sines.
        k_cache: One layer's key cache ``[num_blocks, block_size, Hkv, D]`` (written in place).
        v_cache: One layer's value cache, shaped like ``k_cache`` (written in place).
        slot_mapping: ``[T]`` flat cache slot of each token.
        num_q_heads: Query heads ``Hq``.

    Returns:
        The rotated queries ``[T, Hq, D]`` (contiguous, dtype of ``qkv``): those of
        ``rotary_kv_write`` on ``normed_qkv_reference(qkv, x, eps, bias)``.

    Raises:
        KernelShapeError: If the shapes do not match the layout above.
        KernelDtypeError: If a dtype is unsupported.
    """
    num_kv_heads, head_dim = int(k_cache.shape[2]), int(k_cache.shape[3])
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise KernelShapeError(
            f"qkv.shape={tuple(qkv.shape)}; expected [tokens, {width}] for {num_q_heads} query "
            f"and {num_kv_heads} key/value heads of {head_dim}"
        )
    if x.dim() != 2 or x.shape[0] != qkv.shape[0]:
        raise KernelShapeError(f"x.shape={tuple(x.shape)}; expected [{qkv.shape[0]}, hidden]")
    if bias is not None and tuple(bias.shape) != (width,):
        raise KernelShapeError(f"bias.shape={tuple(bias.shape)}; expected ({width},)")
    q, k, v = _split(qkv, num_q_heads, num_kv_heads, head_dim)
    check_rotary_kv_write_args(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    if not use_triton(qkv, x):
        finished = normed_qkv_reference(qkv, x, eps, bias)
        q, k, v = _split(finished, num_q_heads, num_kv_heads, head_dim)
        return rotary_kv_write_reference(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    for name, tensor in (("qkv", qkv), ("x", x), ("cos", cos), ("sin", sin)):
        if tensor.stride(-1) != 1:
            raise KernelShapeError(
                f"{name} has strides {tensor.stride()}; expected a contiguous last dimension"
            )
    tokens = qkv.shape[0]
    out = torch.empty((tokens, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return out
    keys = _flat_slots(k_cache, "k_cache")
    values = _flat_slots(v_cache, "v_cache")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise KernelShapeError("k_cache and v_cache must have a contiguous last dimension")
    use_pdl = pdl_enabled(qkv.device)
    half = head_dim // 2
    args = (
        qkv,
        x,
        qkv if bias is None else bias.contiguous(),
        cos,
        sin,
        out,
        keys,
        values,
        slot_mapping.contiguous(),
        qkv.stride(0),
        x.stride(0),
        cos.stride(0),
        sin.stride(0),
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        x.shape[1],
        float(eps),
    )
    constexprs = {
        "NUM_Q_HEADS": num_q_heads,
        "NUM_KV_HEADS": num_kv_heads,
        "Q_HEADS_PAD": next_power_of_2(num_q_heads),
        "KV_HEADS_PAD": next_power_of_2(num_kv_heads),
        "HALF": half,
        "HALF_PAD": next_power_of_2(half),
        "HIDDEN_BLOCK": next_power_of_2(x.shape[1]),
        "HAS_BIAS": bias is not None,
        "USE_PDL": use_pdl,
    }
    with on_device_of(qkv):
        (_LAUNCHER_PDL if use_pdl else _LAUNCHER)(
            (tokens,), args, constexprs, 4, qkv.get_device() if qkv.is_cuda else 0
        )
    return out
