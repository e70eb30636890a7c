"""Triton phases of a decode layer's attention inside :mod:`mcore_kernels.decode_layer_kernel`.

:func:`_attention_phase` splits each token's context into ``SPLIT``-position pieces, one work
item per (token, key/value head, piece): the piece's keys and values are gathered from the
paged cache in one load each, and the item stores the float32 softmax partials of its query
heads (running max, sum of exponentials, weighted values). After a grid barrier,
:func:`_merged_attention` rebuilds any rows of the attention output from those partials (every
program of the o projection merges the rows it multiplies), so the attention costs no kernel
of its own and no merge pass.
"""

from __future__ import annotations

from mcore_kernels._triton_utils import jit, round_to, tl


@jit
def _attention_phase(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, scale,
    M, num_splits, stride_table, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
    stride_vh, NUM_Q_HEADS, NUM_KV_HEADS, pid, programs,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Softmax partials of every (token, key/value head, split) item of this program.

    Partials are laid out ``[M, NUM_Q_HEADS, num_splits]`` (``part_acc`` with ``HEAD_DIM``
    more); splits past a token's context are skipped (the merge never reads them).
    """
    dims = tl.arange(0, HEAD_DIM)
    offsets = tl.arange(0, SPLIT)
    group = tl.arange(0, GROUP_PAD)
    group_mask = group < GROUP
    items = M * NUM_KV_HEADS * num_splits
    for item in range(pid, items, programs):
        split = item % num_splits
        kv_head = (item // num_splits) % NUM_KV_HEADS
        token = item // (num_splits * NUM_KV_HEADS)
        context = tl.load(lens_ptr + token)
        if split * SPLIT < context:
            positions = split * SPLIT + offsets
            valid = positions < context
            blocks = tl.load(
                table_ptr + token * stride_table + positions // BLOCK_SIZE, mask=valid, other=0
            ).to(tl.int64)
            slots = positions % BLOCK_SIZE
            keys = tl.load(
                k_ptr
                + (blocks * stride_kb + slots * stride_ks + kv_head * stride_kh)[:, None]
                + dims[None, :],
                mask=valid[:, None],
                other=0.0,
            ).to(tl.float32)
            values = tl.load(
                v_ptr
                + (blocks * stride_vb + slots * stride_vs + kv_head * stride_vh)[:, None]
                + dims[None, :],
                mask=valid[:, None],
                other=0.0,
            ).to(tl.float32)
            heads = kv_head * GROUP + group
            q = tl.load(
                q_ptr
                + token * (NUM_Q_HEADS * HEAD_DIM)
                + heads[:, None] * HEAD_DIM
                + dims[None, :],
                mask=group_mask[:, None],
                other=0.0,
            ).to(tl.float32)
            scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            top = tl.max(scores, axis=1)
            probs = tl.exp(scores - top[:, None])
            total = tl.sum(probs, axis=1)
            weighted = tl.dot(probs, values, input_precision="ieee")
            row = (token * NUM_Q_HEADS + heads) * num_splits + split
            tl.store(part_max_ptr + row, top, mask=group_mask)
            tl.store(part_sum_ptr + row, total, mask=group_mask)
            tl.store(
                part_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :],
                weighted,
                mask=group_mask[:, None],
            )


@jit
def _merged_attention(
    part_acc_ptr, part_max_ptr, part_sum_ptr, lens_ptr, offs_m, m_mask, num_splits,
    NUM_Q_HEADS, DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Attention output rows ``offs_m`` (``[BLOCK_M, BLOCK_K]``, rounded to ``DTYPE``).

    Column ``c`` is channel ``c % HEAD_DIM`` of query head ``c // HEAD_DIM``; the splits of a
    row merge in chunks of ``CHUNK`` with a running maximum.
    """
    columns = tl.arange(0, BLOCK_K)
    heads = columns // HEAD_DIM
    channel = columns % HEAD_DIM
    column_mask = columns < NUM_Q_HEADS * HEAD_DIM
    chunk = tl.arange(0, CHUNK)
    context = tl.load(lens_ptr + offs_m, mask=m_mask, other=0)
    used = tl.where(m_mask, (context + SPLIT - 1) // SPLIT, 0)
    running_max = tl.full([offs_m.shape[0], BLOCK_K], float("-inf"), tl.float32)
    running_sum = tl.zeros([offs_m.shape[0], BLOCK_K], tl.float32)
    acc = tl.zeros([offs_m.shape[0], BLOCK_K], tl.float32)
    base = (offs_m[:, None] * NUM_Q_HEADS + heads[None, :]) * num_splits
    for start in range(0, tl.max(used, axis=0), CHUNK):
        splits = start + chunk
        here = (splits[None, :, None] < used[:, None, None]) & column_mask[None, None, :]
        row = base[:, None, :] + splits[None, :, None]
        split_max = tl.load(
            part_max_ptr + row, mask=here, other=float("-inf"), cache_modifier=".cg"
        )
        split_sum = tl.load(part_sum_ptr + row, mask=here, other=0.0, cache_modifier=".cg")
        split_acc = tl.load(
            part_acc_ptr + row * HEAD_DIM + channel[None, None, :],
            mask=here,
            other=0.0,
            cache_modifier=".cg",
        )
        new_max = tl.maximum(running_max, tl.max(split_max, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp(running_max - shift)
        weight = tl.exp(split_max - shift[:, None, :])
        running_sum = running_sum * correction + tl.sum(split_sum * weight, axis=1)
        acc = acc * correction + tl.sum(split_acc * weight, axis=1)
        running_max = new_max
    out = acc / tl.where(running_sum > 0.0, running_sum, 1.0)
    return round_to(out, DTYPE).to(tl.float32)
