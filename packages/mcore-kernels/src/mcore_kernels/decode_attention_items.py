"""Triton building blocks of :func:`mcore_kernels.decode_attention_gemv.attention_o_proj` when
its projection kernel computes the attention splits itself: one split program's work as a
function (:func:`_attend_split_item`) and a barrier over the programs of one launch
(:func:`_grid_barrier`).

The split item is the paged attention split kernel's one-token program (query rows of one
key/value head, one split of positions, the same online softmax in tiles through
``_attend_rows``) writing its partial maximum, sum and output rows; the barrier lets every
program of the launch read every split's partials once all are written. A barrier inside one
launch needs every program of it resident at once: the launcher keeps such grids at most one
program per multiprocessor.
"""

from __future__ import annotations

from mcore_kernels._triton_utils import jit, tl
from mcore_kernels.paged_attention import _attend_rows


@jit
def _attend_split_item(
    item,
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    context_lens_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
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
    num_kv_heads,
    num_q_heads,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT: tl.constexpr,
    ALIGN: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Split ``item`` (token-major, then key/value head, then split): the partial results of
    the query heads of one key/value head over one split of one token's positions."""
    per_token = num_kv_heads * num_splits
    token = item // per_token
    kv_head = (item % per_token) // num_splits
    split = item % num_splits
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    member = rows // GROUP_PAD
    tokens = token + member
    heads = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (member < 1) & (rows % GROUP_PAD < GROUP)
    ctx_rows = tl.load(context_lens_ptr + tokens, mask=row_ok, other=0).to(tl.int32)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if not DOT or DOT_F32:
        q = q.to(tl.float32)
    split_start = split * SPLIT_SIZE
    remaining = tl.minimum(tl.maximum(ctx_rows - split_start, 0), SPLIT_SIZE)
    table = block_tables_ptr + token.to(tl.int64) * stride_table_token
    running_max, running_sum, acc = _attend_rows(
        q, ctx_rows, row_ok, table, k_ptr, v_ptr, kv_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        scale, split_start, tl.max(remaining, axis=0),
        ROWS, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE, DOT, ALIGN, DOT_F32,
    )  # fmt: skip
    # The split kernel's partial layout: [T, Hq, num_splits] rows (+ [D] for the outputs).
    row = (tokens * num_q_heads + heads) * num_splits + split
    tl.store(partial_max_ptr + row, running_max, mask=row_ok)
    tl.store(partial_sum_ptr + row, running_sum, mask=row_ok)
    tl.store(
        partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        acc,
        mask=row_ok[:, None] & dim_mask[None, :],
    )


@jit
def _grid_barrier(counter_ptr, programs):
    """Wait until all ``programs`` programs of the launch have arrived; what each wrote before
    is then visible to every other (read it with ``.cg`` loads: L1 is not coherent).

    ``counter_ptr`` holds two zeroed int32 counters (arrivals, departures); the last program
    to leave zeroes both for the next launch.
    """
    # Every thread's stores are issued before the (release) arrival.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") + 1
    while arrived < programs:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    departed = tl.atomic_add(counter_ptr + 1, 1, sem="relaxed", scope="gpu")
    if departed == programs - 1:
        # Every program has left the wait: the counters can start over.
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed", scope="gpu")
