"""The paged split kernel as it was before the per-shape modes, kept for before/after runs.

Every program multiplies its (16-row padded) query group with ``tl.dot`` in IEEE float32.
Used only by ``bench_paged_attention.py``.
"""

from __future__ import annotations

import torch

from mcore_kernels._triton_utils import jit, next_power_of_2, tl
from mcore_kernels.paged_attention import merge_splits


@jit
def _paged_attention_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    context_lens_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    out_ptr,
    scale,
    stride_q_token,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_table_token,
    stride_out_token,
    stride_out_head,
    num_q_heads,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    USE_DOT: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_lens_ptr + token).to(tl.int32)
    group_offsets = tl.arange(0, GROUP_PAD)
    dim_offsets = tl.arange(0, HEAD_DIM_PAD)
    tile_offsets = tl.arange(0, TILE)
    group_mask = group_offsets < GROUP
    dim_mask = dim_offsets < HEAD_DIM
    heads = kv_head * GROUP + group_offsets
    q = tl.load(
        q_ptr + token * stride_q_token + heads[:, None] * stride_q_head + dim_offsets[None, :],
        mask=group_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    split_start = split * SPLIT_SIZE
    remaining = tl.minimum(tl.maximum(context - split_start, 0), SPLIT_SIZE)
    num_tiles = (remaining + TILE - 1) // TILE
    table = block_tables_ptr + token * stride_table_token
    for i in range(0, num_tiles):
        # A tile may span several KV blocks: gather each position's physical block.
        positions = split_start + i * TILE + tile_offsets
        valid = positions < context
        physical = tl.load(table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slots = positions % BLOCK_SIZE
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(
            k_ptr
            + physical[:, None] * stride_k_block
            + slots[:, None] * stride_k_slot
            + kv_head * stride_k_head
            + dim_offsets[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            v_ptr
            + physical[:, None] * stride_v_block
            + slots[:, None] * stride_v_slot
            + kv_head * stride_v_head
            + dim_offsets[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        if USE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        if USE_DOT:
            update = tl.dot(probs, v, input_precision="ieee")
        else:
            update = tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        acc = acc * correction[:, None] + update
        running_max = new_max
    if SINGLE_SPLIT:
        # The merge of a single split is this division (bit for bit): no partials, no merge.
        out = acc / running_sum[:, None]
        tl.store(
            out_ptr
            + token * stride_out_token
            + heads[:, None] * stride_out_head
            + dim_offsets[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=group_mask[:, None] & dim_mask[None, :],
        )
        return
    # Row layout of the partials: [T, Hq, num_splits] (+ [D] for the outputs).
    row = (token * num_q_heads + heads) * num_splits + split
    tl.store(partial_max_ptr + row, running_max, mask=group_mask)
    tl.store(partial_sum_ptr + row, running_sum, mask=group_mask)
    tl.store(
        partial_out_ptr + row[:, None] * HEAD_DIM + dim_offsets[None, :],
        acc,
        mask=group_mask[:, None] & dim_mask[None, :],
    )


def baseline_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    split_size: int = 256,
) -> torch.Tensor:
    """Launch the pre-change split kernel (and the shared merge) like the old entry point."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks_total, block_size, num_kv_heads, _ = k_cache.shape
    del num_blocks_total
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    max_context = block_tables.shape[1] * block_size
    num_splits = max(1, -(-max_context // split_size))
    group = num_q_heads // num_kv_heads
    single = num_splits == 1
    # One split (short contexts, or tables cut to the step's longest context) writes the
    # output itself; the partials are then never touched.
    partial_shape = (num_tokens, num_q_heads, 1 if single else num_splits)
    partial_out = torch.empty((*partial_shape, head_dim), dtype=torch.float32, device=q.device)
    partial_max = torch.empty(partial_shape, dtype=torch.float32, device=q.device)
    partial_sum = torch.empty_like(partial_max)
    head_dim_pad = max(16, next_power_of_2(head_dim))
    # Context positions per loop iteration: a power of two dividing split_size, so the
    # accumulation order depends on split_size only. tl.dot needs every dimension >= 16.
    tile = min(64, split_size & -split_size)
    use_dot = tile >= 16
    group_pad = max(16, next_power_of_2(group)) if use_dot else next_power_of_2(group)
    _paged_attention_split_kernel[(num_tokens, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        partial_out,
        partial_max,
        partial_sum,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_q_heads,
        num_splits,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        SPLIT_SIZE=split_size,
        TILE=tile,
        USE_DOT=use_dot,
        SINGLE_SPLIT=single,
    )
    if single:
        return out
    merge_splits(partial_out, partial_max, partial_sum, context_lens, out, split_size=split_size)
    return out
