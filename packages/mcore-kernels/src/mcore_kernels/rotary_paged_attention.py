"""RoPE, the cache write and the paged attention of decode tokens in one launch.

A decode layer over many tokens runs its q/k/v GEMM, then one kernel that rotates the queries
and keys and stores keys and values in their cache slots
(:func:`mcore_kernels.rotary_kv_write.rotary_kv_write`, or
:func:`mcore_kernels.normed_rotary_kv_write.normed_rotary_kv_write` for a projection whose
input RMSNorm is folded into the weight), then the paged attention
(:func:`mcore_kernels.paged_attention.paged_attention`). Here a program of the attention (one
token and one key/value head) does the first kernel's work for its own heads before it
attends: it finishes the projection (the row's ``rstd`` and the bias, one rounding) when asked,
rotates its query heads and its key head, stores its key and value in the token's slot, and
then walks the token's whole context in tiles as the paged split kernel does for a context
within one split (``_attend_rows``, the same tiles and sums). One launch fewer per layer, and
the attention's queries come from the program itself.

The rotations round as ``rotary_kv_write`` rounds; the row scale of a folded projection is the
float32 sum of squares reduced in this program (its order may differ from the standalone
kernel's in the last bit). The program walks every position of its token: use it for
contexts that fit one split of the split kernel (decode steps of short contexts).

Shapes: ``qkv`` ``[T, (Hq + 2 Hkv) * D]`` (rows contiguous), ``cos``/``sin`` float32
``[T, D // 2]``, the caches ``[num_blocks, block_size, Hkv, D]``, ``slot_mapping`` ``[T]``,
``block_tables`` int32 ``[T, max_blocks]``, ``context_lens`` int32 ``[T]`` (the new token
included); returns ``[T, Hq, D]``. Dispatch: Triton on CUDA, the torch reference on CPU;
``MCORE_KERNELS_BACKEND=torch|triton`` overrides (with ``TRITON_INTERPRET=1`` the Triton path
runs on CPU tensors).
"""

from __future__ import annotations

import math

import torch

from mcore_kernels._backend import _interpreting, use_triton
from mcore_kernels._triton_utils import (
    device_limits,
    jit,
    next_power_of_2,
    on_device_of,
    rotate_half_rounded,
    tl,
)
from mcore_kernels._validation import check_rotary_kv_write_args
from mcore_kernels.errors import KernelShapeError
from mcore_kernels.normed_rotary_kv_write import _finish
from mcore_kernels.paged_attention import PagedDecodeConfig, _attend_rows, paged_decode_config
from mcore_kernels.reference import rotary_paged_attention_reference

__all__ = ["rotary_paged_attention", "rotary_paged_attention_reference"]


@jit(do_not_specialize=["stride_table_token"])
def _rotary_paged_attention_kernel(
    qkv_ptr,
    x_ptr,
    bias_ptr,
    cos_ptr,
    sin_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    stride_qkv_token,
    stride_x_token,
    stride_cos_token,
    stride_sin_token,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_table_token,
    hidden,
    eps,
    scale,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    ALIGN: tl.constexpr,
    DOT_F32: tl.constexpr,
    NORMED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HIDDEN_BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = qkv_ptr.dtype.element_ty
    # 1. This program's query heads and its key/value head: finish, rotate, store.
    channels = tl.arange(0, HALF)[None, :]
    group = tl.arange(0, GROUP_PAD)[:, None]
    q_mask = (group < GROUP) & (channels < HALF)
    q_offsets = (kv_head * GROUP + group) * HEAD_DIM + channels
    k_offsets = NUM_Q_HEADS * HEAD_DIM + kv_head * HEAD_DIM + channels
    v_offsets = k_offsets + NUM_KV_HEADS * HEAD_DIM
    row = qkv_ptr + token * stride_qkv_token
    x1 = tl.load(row + q_offsets, mask=q_mask, other=0.0)
    x2 = tl.load(row + q_offsets + HALF, mask=q_mask, other=0.0)
    y1 = tl.load(row + k_offsets)
    y2 = tl.load(row + k_offsets + HALF)
    low = tl.load(row + v_offsets)
    high = tl.load(row + v_offsets + HALF)
    cos = tl.load(cos_ptr + token * stride_cos_token + channels)
    sin = tl.load(sin_ptr + token * stride_sin_token + channels)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if NORMED:
        columns = tl.arange(0, HIDDEN_BLOCK)
        h = tl.load(x_ptr + token * stride_x_token + columns, mask=columns < hidden, other=0.0)
        h = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
        x1 = _finish(x1, rstd, bias_ptr, q_offsets, q_mask, HAS_BIAS, dtype)
        x2 = _finish(x2, rstd, bias_ptr, q_offsets + HALF, q_mask, HAS_BIAS, dtype)
        y1 = _finish(y1, rstd, bias_ptr, k_offsets, channels < HALF, HAS_BIAS, dtype)
        y2 = _finish(y2, rstd, bias_ptr, k_offsets + HALF, channels < HALF, HAS_BIAS, dtype)
        low = _finish(low, rstd, bias_ptr, v_offsets, channels < HALF, HAS_BIAS, dtype)
        high = _finish(high, rstd, bias_ptr, v_offsets + HALF, channels < HALF, HAS_BIAS, dtype)
    else:
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        y1, y2 = y1.to(tl.float32), y2.to(tl.float32)
    first, second = rotate_half_rounded(x1, x2, cos, sin, dtype)
    # The rotated queries go to this program's rows of the output, read back below.
    q_target = out_ptr + token * (NUM_Q_HEADS * HEAD_DIM) + q_offsets
    tl.store(q_target, first, mask=q_mask)
    tl.store(q_target + HALF, second, mask=q_mask)
    k_first, k_second = rotate_half_rounded(y1, y2, cos, sin, dtype)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k_target = (
        k_ptr
        + (block * stride_k_block + offset * stride_k_slot + kv_head * stride_k_head) * ALIGN
        + channels
    )
    cache_dtype = k_ptr.dtype.element_ty
    tl.store(k_target, k_first.to(cache_dtype))
    tl.store(k_target + HALF, k_second.to(cache_dtype))
    v_target = (
        v_ptr
        + (block * stride_v_block + offset * stride_v_slot + kv_head * stride_v_head) * ALIGN
        + channels
    )
    value_dtype = v_ptr.dtype.element_ty
    tl.store(v_target, low.to(value_dtype))
    tl.store(v_target + HALF, high.to(value_dtype))
    # Every thread's stores (queries, the new key and value) before any thread reads them.
    tl.debug_barrier()
    # 2. The attention of the token over its whole context (the split kernel's tiles).
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = (rows < GROUP_PAD) & (rows % GROUP_PAD < GROUP)
    heads = kv_head * GROUP + rows % GROUP_PAD
    context = tl.load(context_lens_ptr + token).to(tl.int32)
    ctx_rows = tl.where(row_ok, context, 0)
    q = tl.load(
        out_ptr + token * (NUM_Q_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    table = block_tables_ptr + token * stride_table_token
    _, running_sum, acc = _attend_rows(
        q, ctx_rows, row_ok, table, k_ptr, v_ptr, kv_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        scale, 0, context,
        ROWS, HEAD_DIM, HEAD_DIM, BLOCK_SIZE, TILE, True, ALIGN, DOT_F32,
    )  # fmt: skip
    # Every thread's query loads before the output overwrites them.
    tl.debug_barrier()
    out = acc / tl.where(row_ok, running_sum, 1.0)[:, None]
    tl.store(
        out_ptr + token * (NUM_Q_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def rotary_paged_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    num_q_heads: int,
    scale: float,
    norm_input: tuple[torch.Tensor, float] | None = None,
    bias: torch.Tensor | None = None,
    config: PagedDecodeConfig | None = None,
) -> torch.Tensor:
    """Rotate, store and attend the new tokens of a decode step in one launch.

    Args:
        qkv: ``[T, (Hq + 2 Hkv) * D]`` q/k/v projection output (bias included unless
            ``norm_input`` is given), last dimension contiguous.
        cos: float32 ``[T, D // 2]`` RoPE cosines of the tokens' positions.
        sin: float32 ``[T, D // 2]`` RoPE sines.
        k_cache: One layer's key cache ``[num_blocks, block_size, Hkv, D]`` (written in place).
        v_cache: One layer's value cache, shaped like ``k_cache`` (written in place).
        slot_mapping: ``[T]`` flat cache slot of each token.
        block_tables: int32 ``[T, max_blocks]``: the physical block of each logical block.
        context_lens: int32 ``[T]``: positions attended, the new token included (at least 1).
        num_q_heads: Query heads ``Hq`` (a multiple of ``Hkv``).
        scale: Multiplier of the query-key products.
        norm_input: ``(x, eps)`` when ``qkv`` is ``x @ (W * w).T`` with the input RMSNorm
            weight ``w`` folded in: each token's product is scaled by ``rstd(x)`` and ``bias``
            added (:func:`mcore_kernels.normed_rotary_kv_write.normed_rotary_kv_write`).
        bias: ``[(Hq + 2 Hkv) * D]`` q/k/v bias, only with ``norm_input``.
        config: Tiles and warps of the attention (None:
            :func:`~mcore_kernels.paged_attention.paged_decode_config` for the launch).

    Returns:
        ``[T, Hq, D]`` attention output in the dtype of ``qkv``.

    Raises:
        KernelShapeError: If the shapes do not match the layout above, the head dimension is
            not a power of two of at least 32, or ``bias`` comes without ``norm_input``.
        KernelDtypeError: If a dtype is unsupported.
    """
    num_kv_heads, head_dim = int(k_cache.shape[2]), int(k_cache.shape[3])
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or num_q_heads % num_kv_heads:
        raise KernelShapeError(
            f"qkv.shape={tuple(qkv.shape)}; expected [tokens, {width}] for {num_q_heads} query "
            f"and {num_kv_heads} key/value heads of {head_dim}"
        )
    if head_dim < 32 or head_dim & (head_dim - 1):
        raise KernelShapeError(f"head_dim={head_dim}; expected a power of two >= 32")
    if bias is not None and (norm_input is None or tuple(bias.shape) != (width,)):
        raise KernelShapeError(
            f"bias.shape={tuple(bias.shape)}; expected ({width},) and norm_input (an unfolded "
            "projection adds its bias itself)"
        )
    tokens = qkv.shape[0]
    if norm_input is not None and (norm_input[0].dim() != 2 or norm_input[0].shape[0] != tokens):
        raise KernelShapeError(
            f"norm_input[0].shape={tuple(norm_input[0].shape)}; expected [{tokens}, hidden]"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != tokens:
        raise KernelShapeError(
            f"block_tables.shape={tuple(block_tables.shape)}; expected [{tokens}, max_blocks]"
        )
    if tuple(context_lens.shape) != (tokens,):
        raise KernelShapeError(
            f"context_lens.shape={tuple(context_lens.shape)}; expected [{tokens}]"
        )
    split = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], 1)
    q, k, v = (part.unflatten(-1, (-1, head_dim)) for part in split)
    check_rotary_kv_write_args(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    if not use_triton(qkv, k_cache):
        return rotary_paged_attention_reference(
            qkv, cos, sin, k_cache, v_cache, slot_mapping, block_tables, context_lens,
            num_q_heads=num_q_heads, scale=scale, norm_input=norm_input, bias=bias,
        )  # fmt: skip
    for name, tensor in (("qkv", qkv), ("cos", cos), ("sin", sin)):
        if tensor.stride(-1) != 1:
            raise KernelShapeError(
                f"{name} has strides {tensor.stride()}; expected a contiguous last dimension"
            )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise KernelShapeError("k_cache and v_cache must have a contiguous last dimension")
    out = torch.empty((tokens, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return out
    group = num_q_heads // num_kv_heads
    if config is None:
        programs = tokens * num_kv_heads / device_limits(qkv.device)[0]
        config = paged_decode_config(group, head_dim, num_kv_heads, k_cache.dtype, programs)
    strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    align = math.gcd(16, *strides)
    x, eps = norm_input if norm_input is not None else (qkv, 0.0)
    if x.stride(-1) != 1:
        x = x.contiguous()
    dot_f32 = (
        qkv.dtype != k_cache.dtype
        or k_cache.dtype == torch.float32
        or v_cache.dtype != k_cache.dtype
        or _interpreting()
    )
    group_pad = next_power_of_2(group)
    tables = block_tables.contiguous()
    with on_device_of(qkv):
        _rotary_paged_attention_kernel[(tokens, num_kv_heads)](
            qkv,
            x,
            bias if bias is not None else qkv,
            cos,
            sin,
            k_cache,
            v_cache,
            slot_mapping.contiguous(),
            tables,
            context_lens.contiguous(),
            out,
            qkv.stride(0),
            x.stride(0),
            cos.stride(0),
            sin.stride(0),
            *(stride // align for stride in strides),
            tables.stride(0),
            x.shape[1],
            float(eps),
            float(scale),
            NUM_Q_HEADS=num_q_heads,
            NUM_KV_HEADS=num_kv_heads,
            GROUP=group,
            GROUP_PAD=group_pad,
            ROWS=max(16, group_pad),
            HEAD_DIM=head_dim,
            BLOCK_SIZE=int(k_cache.shape[1]),
            TILE=max(16, config.tile),
            ALIGN=align,
            DOT_F32=dot_f32,
            NORMED=norm_input is not None,
            HAS_BIAS=bias is not None,
            HIDDEN_BLOCK=next_power_of_2(x.shape[1]),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **({"maxnreg": config.max_registers} if config.max_registers else {}),
        )
    return out
