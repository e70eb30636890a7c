"""Absorbed Multi-head Latent Attention (MLA) of new tokens over a paged latent cache.

MLA with absorbed weights (DeepSeek-AI, "DeepSeek-V2", arXiv:2405.04434, section 2.1.3) caches
one row per token: the latent ``c_kv`` (``R = kv_lora_rank`` channels) followed by the rotary
key shared by all heads (``P`` channels). Every head ``h`` of a new token scores position ``s``
with ``q_latent[h] . c_kv[s] + q_rope[h] . k_rope[s]`` and returns the softmax-weighted sum of
the latents, which the model maps back to values with ``W_UV``. All heads read the same cache
rows, like multi-query attention with a value that is the first ``R`` channels of the key.

Shapes:

- ``q_latent``: ``[T, H, R]``; ``q_rope``: ``[T, H, P]``
- ``latent_cache``: ``[num_blocks, block_size, R + P]``
- ``block_tables``: ``[T, max_blocks]`` int32/int64; ``context_lens``: ``[T]`` int32/int64
- returns ``[T, H, R]`` in ``q_latent.dtype``

The file holds the Triton kernel, its launcher, the ``torch.library`` registration and the
entry point; the torch reference and the argument check live in :mod:`mcore_kernels.reference`
and ``mcore_kernels._validation`` (both re-exported here). The Triton path follows :mod:`mcore_kernels.paged_attention`: each token's context is cut into
splits of a fixed ``split_size`` (split-KV); a program handles one token, a block of heads and
one split, and a second kernel merges the splits in a fixed order, so the result of a token does
not depend on what else shares the launch. The launch shape depends on the table width only
(graph-safe). Dispatch: Triton on CUDA, the torch reference on CPU;
``MCORE_KERNELS_BACKEND=torch|triton`` overrides (``TRITON_INTERPRET=1`` runs Triton on CPU).
"""

from __future__ import annotations

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import jit, next_power_of_2, tl, triton
from mcore_kernels._validation import check_paged_mla_attention_args
from mcore_kernels.errors import KernelBackendError, KernelShapeError
from mcore_kernels.paged_attention import DEFAULT_SPLIT_SIZE, merge_splits
from mcore_kernels.reference import paged_mla_attention_reference

__all__ = [
    "check_paged_mla_attention_args",
    "paged_mla_attention",
    "paged_mla_attention_reference",
    "paged_mla_attention_triton",
]


# The table stride and split count follow the step (see paged_attention): not specialised.
@jit(do_not_specialize=["stride_table_token", "num_splits"])
def _paged_mla_split_kernel(
    q_latent_ptr,
    q_rope_ptr,
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    scale,
    stride_ql_token,
    stride_ql_head,
    stride_qr_token,
    stride_qr_head,
    stride_cache_block,
    stride_cache_slot,
    stride_table_token,
    num_heads,
    num_splits,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_lens_ptr + token).to(tl.int32)
    heads = head_block * HEADS + tl.arange(0, HEADS)
    head_mask = heads < num_heads
    rank_offsets = tl.arange(0, RANK_PAD)
    rope_offsets = tl.arange(0, ROPE_PAD)
    rank_mask = rank_offsets < RANK
    rope_mask = rope_offsets < ROPE
    q_latent = tl.load(
        q_latent_ptr
        + token * stride_ql_token
        + heads[:, None] * stride_ql_head
        + rank_offsets[None, :],
        mask=head_mask[:, None] & rank_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    q_rope = tl.load(
        q_rope_ptr
        + token * stride_qr_token
        + heads[:, None] * stride_qr_head
        + rope_offsets[None, :],
        mask=head_mask[:, None] & rope_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    running_max = tl.full([HEADS], float("-inf"), tl.float32)
    running_sum = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, RANK_PAD], tl.float32)
    split_start = split * SPLIT_SIZE
    remaining = tl.minimum(tl.maximum(context - split_start, 0), SPLIT_SIZE)
    num_tiles = (remaining + TILE - 1) // TILE
    table = block_tables_ptr + token * stride_table_token
    tile_offsets = tl.arange(0, TILE)
    for i in range(0, num_tiles):
        positions = split_start + i * TILE + tile_offsets
        valid = positions < context
        physical = tl.load(table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = (
            cache_ptr + physical * stride_cache_block + (positions % BLOCK_SIZE) * stride_cache_slot
        )
        c_kv = tl.load(
            rows[:, None] + rank_offsets[None, :],
            mask=valid[:, None] & rank_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        k_rope = tl.load(
            rows[:, None] + RANK + rope_offsets[None, :],
            mask=valid[:, None] & rope_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if USE_DOT:
            scores = tl.dot(q_latent, tl.trans(c_kv), input_precision="ieee")
            scores += tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee")
        else:
            scores = tl.sum(q_latent[:, None, :] * c_kv[None, :, :], axis=2)
            scores += tl.sum(q_rope[:, None, :] * k_rope[None, :, :], axis=2)
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        if USE_DOT:
            update = tl.dot(probs, c_kv, input_precision="ieee")
        else:
            update = tl.sum(probs[:, :, None] * c_kv[None, :, :], axis=1)
        acc = acc * correction[:, None] + update
        running_max = new_max
    # Same partial layout as paged_attention: [T, H, num_splits] (+ [R] for the outputs).
    row = (token * num_heads + heads) * num_splits + split
    tl.store(partial_max_ptr + row, running_max, mask=head_mask)
    tl.store(partial_sum_ptr + row, running_sum, mask=head_mask)
    tl.store(
        partial_out_ptr + row[:, None] * RANK + rank_offsets[None, :],
        acc,
        mask=head_mask[:, None] & rank_mask[None, :],
    )


def paged_mla_attention_triton(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    split_size: int = DEFAULT_SPLIT_SIZE,
) -> torch.Tensor:
    """Split-KV Triton absorbed MLA attention (launch shape fixed by the table width).

    Args:
        q_latent: ``[T, H, R]``.
        q_rope: ``[T, H, P]``.
        latent_cache: ``[num_blocks, block_size, R + P]``, rows contiguous.
        block_tables: ``[T, max_blocks]``.
        context_lens: ``[T]``, each at least 1.
        scale: Softmax scale.
        split_size: Context positions per split; a positive multiple of the block size.

    Returns:
        ``[T, H, R]`` in ``q_latent.dtype``.

    Raises:
        KernelShapeError: If the shapes do not match or ``split_size`` is invalid.
        KernelDtypeError: If a dtype is unsupported.
        KernelBackendError: If Triton is not installed.
    """
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    check_paged_mla_attention_args(q_latent, q_rope, latent_cache, block_tables, context_lens)
    num_tokens, num_heads, rank = q_latent.shape
    rope = q_rope.shape[2]
    block_size = latent_cache.shape[1]
    if split_size <= 0 or split_size % block_size:
        raise KernelShapeError(
            f"split_size={split_size}; expected a positive multiple of the block size {block_size}"
        )
    out = torch.empty_like(q_latent)
    if num_tokens == 0:
        return out
    if latent_cache.stride(-1) != 1:
        raise KernelShapeError("latent_cache must have a contiguous last dimension")
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    num_splits = max(1, -(-(block_tables.shape[1] * block_size) // split_size))
    partial_out = torch.empty(
        (num_tokens, num_heads, num_splits, rank), dtype=torch.float32, device=q_latent.device
    )
    partial_max = torch.empty(
        (num_tokens, num_heads, num_splits), dtype=torch.float32, device=q_latent.device
    )
    partial_sum = torch.empty_like(partial_max)
    rank_pad = max(16, next_power_of_2(rank))
    # Context positions per loop iteration: a power of two dividing split_size (so the
    # accumulation order depends on split_size only), smaller for wide latents to bound the
    # registers a [tile, rank] cache tile takes. tl.dot needs every dimension >= 16.
    tile = min(16 if rank_pad >= 256 else 32, split_size & -split_size)
    use_dot = tile >= 16
    # Heads per program: a block of 16 (tl.dot's minimum) shares each loaded cache tile.
    heads = 16 if use_dot else min(16, next_power_of_2(num_heads))
    rope_pad = max(16, next_power_of_2(rope))
    grid = (num_tokens, -(-num_heads // heads), num_splits)
    _paged_mla_split_kernel[grid](
        q_latent,
        q_rope,
        latent_cache,
        block_tables,
        context_lens,
        partial_out,
        partial_max,
        partial_sum,
        scale,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        block_tables.stride(0),
        num_heads,
        num_splits,
        RANK=rank,
        RANK_PAD=rank_pad,
        ROPE=rope,
        ROPE_PAD=rope_pad,
        HEADS=heads,
        BLOCK_SIZE=block_size,
        SPLIT_SIZE=split_size,
        TILE=tile,
        USE_DOT=use_dot,
    )
    merge_splits(partial_out, partial_max, partial_sum, context_lens, out, split_size=split_size)
    return out


def paged_mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    split_size: int = DEFAULT_SPLIT_SIZE,
) -> torch.Tensor:
    """Absorbed MLA attention over a paged latent cache, dispatched to Triton or torch.

    Args:
        q_latent: ``[T, H, R]`` no-position queries mapped into latent space.
        q_rope: ``[T, H, P]`` rotated rotary queries.
        latent_cache: ``[num_blocks, block_size, R + P]``.
        block_tables: ``[T, max_blocks]``.
        context_lens: ``[T]``, each at least 1.
        scale: Softmax scale.
        split_size: Context positions per split-KV program (Triton path).

    Returns:
        ``[T, H, R]`` in ``q_latent.dtype`` (inference only: no backward). Under
        ``torch.compile`` the call is the opaque custom op
        ``torch.ops.mcore_kernels.paged_mla_attention``.

    Raises:
        KernelShapeError: If the shapes do not match the layout above.
        KernelDtypeError: If a dtype is unsupported.
        KernelBackendError: If the requested backend cannot run on these tensors.
    """
    if _compile.compiling():
        check_paged_mla_attention_args(q_latent, q_rope, latent_cache, block_tables, context_lens)
        return _paged_mla_attention_op(
            q_latent, q_rope, latent_cache, block_tables, context_lens, float(scale), split_size
        )
    return _paged_mla_attention_run(
        q_latent, q_rope, latent_cache, block_tables, context_lens, scale, split_size
    )


def _paged_mla_attention_run(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    split_size: int,
) -> torch.Tensor:
    if use_triton(q_latent, q_rope, latent_cache):
        return paged_mla_attention_triton(
            q_latent,
            q_rope,
            latent_cache,
            block_tables,
            context_lens,
            scale=scale,
            split_size=split_size,
        )
    return paged_mla_attention_reference(
        q_latent,
        q_rope,
        latent_cache,
        block_tables,
        context_lens,
        scale=scale,
        split_size=split_size,
    )


@_compile.custom_op(
    "paged_mla_attention",
    "(Tensor q_latent, Tensor q_rope, Tensor latent_cache, Tensor block_tables, "
    "Tensor context_lens, float scale, int split_size) -> Tensor",
)
def _paged_mla_attention_op(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    split_size: int,
) -> torch.Tensor:
    out = _paged_mla_attention_run(
        q_latent, q_rope, latent_cache, block_tables, context_lens, scale, split_size
    )
    # The fake implementation promises a contiguous result, whatever the layout of the queries.
    return out.contiguous()


_paged_mla_attention_op.register_fake(lambda q_latent, *args: q_latent.new_empty(q_latent.shape))
