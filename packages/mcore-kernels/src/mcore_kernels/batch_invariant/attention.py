"""Batch-invariant causal attention: one kernel for training, chunked prefill and decode.

Every query token ``t`` attends to positions ``0 .. context_lens[t] - 1`` of its own sequence.
Its keys and values are read either from a paged KV cache (the inference engine: a block table
row per token) or from the packed key/value rows of a training forward (``kv_starts[t]``, the
row of the sequence's first token). Addressing is the only difference; the arithmetic is one
code path:

- the context is cut into splits of ``SPLIT_SIZE`` positions (a constant, never derived
  from the batch or the launch); a program computes one split of one token and one key/value
  head group in tiles of ``TILE`` positions, ascending, with an online softmax;
- a second kernel merges a token's splits in ascending order.

Splits beyond a token's context (the launch has as many as the longest context needs) hold no
position: their partial has max ``-inf`` and sum 0 and merging it multiplies by exactly 1 and
adds exactly 0, so a token's output is bitwise the same whatever the other tokens of the launch,
whether it is a decode token, part of a prefill chunk of any size or a row of a packed training
batch. Softmax statistics and accumulators are float32; with bf16/fp16 inputs the two tile
products run on tensor cores (probabilities rounded to the input dtype for the second, as flash
attention does), with float32 inputs (and in the Triton interpreter, whose bf16 ``tl.dot`` is
not usable) in IEEE float32.

Shapes: ``q [T, Hq, D]``; paged ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]`` with
``block_tables [T, max_blocks]``; packed ``k``/``v [S, Hkv, D]`` with ``kv_starts [T]``;
``context_lens [T]``; output ``[T, Hq, D]`` in ``q.dtype``.

Packed training sequences (:func:`packed_attention_batch_invariant`, at the end of this module).
Packed-sequence causal attention with the numerics of the engine's batch-invariant kernel.

The training forward of a packed row calls this: the forward is
:func:`attention_batch_invariant` reading the packed
keys and values (one start row per token), so a token equals the engine's decode or prefill of
the same sequence bitwise; consecutive tokens of a sequence share a program (query blocks), so
each key/value tile is loaded once for several tokens; the backward recomputes the attention with torch SDPA per sequence
(gradients need no invariance).

Eager calls go through ``_PackedAttention``; while ``torch.compile`` traces a call it becomes the
custom op ``torch.ops.mcore_kernels.packed_attention_batch_invariant`` with the registered
backward ``packed_attention_batch_invariant_bwd`` (the same SDPA recomputation). The torch
reference of the forward is
:func:`~mcore_kernels.batch_invariant.reference.attention_batch_invariant_reference`, which
:func:`attention_batch_invariant` runs on the CPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from mcore_kernels import _compile
from mcore_kernels._backend import _interpreting, use_triton
from mcore_kernels._triton_utils import jit, next_power_of_2, round_to, tl, triton
from mcore_kernels.batch_invariant.reference import (
    SPLIT_SIZE,
    TILE,
    attention_batch_invariant_reference,
)
from mcore_kernels.errors import KernelShapeError

__all__ = [
    "QUERY_ROWS",
    "SPLIT_SIZE",
    "TILE",
    "attention_batch_invariant",
    "packed_attention_batch_invariant",
    "query_block_tokens",
]

QUERY_ROWS = 64
"""Rows (query heads of one key/value head, times tokens) of one program's tiles."""


def query_block_tokens(q_heads: int, kv_heads: int) -> int:
    """How many tokens of one sequence a program of the invariant attention can hold.

    Args:
        q_heads: Query heads.
        kv_heads: Key/value heads (divides ``q_heads``).

    Returns:
        ``rows // group`` with ``group = q_heads / kv_heads`` and ``rows`` the program's
        query rows (``QUERY_ROWS``, or the group rounded up to a power of two when larger).
    """
    group = q_heads // kv_heads
    return max(QUERY_ROWS, next_power_of_2(group)) // group


# The table stride (eager steps cut the table to their longest context) and the split count
# vary between steps: specialising on them would compile a kernel in the request path.
@jit(do_not_specialize=["explicit_blocks", "stride_table_token", "num_splits"])
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    kv_starts_ptr,
    context_lens_ptr,
    blocks_ptr,
    explicit_blocks,
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
    num_q_heads,
    num_splits,
    PAGED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLIT: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    DOT: tl.constexpr,
):
    # A program holds up to ROWS // GROUP consecutive tokens of one sequence (a query block:
    # first token, count) times the GROUP query heads of one key/value head, one row each. The
    # keys and values of a tile are loaded once for all of them; every row is reduced exactly as
    # it would be alone (see the module docstring).
    block_index = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Without explicit blocks (explicit_blocks == 0, not specialised: one binary either way)
    # program i holds token i alone.
    explicit = explicit_blocks != 0
    first_token = tl.load(blocks_ptr + 2 * block_index, mask=explicit, other=0).to(tl.int64)
    first_token = tl.where(explicit, first_token, block_index)
    block_tokens = tl.load(blocks_ptr + 2 * block_index + 1, mask=explicit, other=1)
    rows = tl.arange(0, ROWS)
    token_in_block = rows // GROUP
    row_mask = (token_in_block < block_tokens) & (rows < (ROWS // GROUP) * GROUP)
    tokens = first_token + token_in_block
    heads = kv_head * GROUP + rows % GROUP
    context = tl.load(context_lens_ptr + tokens, mask=row_mask, other=0).to(tl.int32)
    block_context = tl.max(context, axis=0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    first = split * SPLIT
    count = tl.minimum(tl.maximum(block_context - first, 0), SPLIT)
    offsets = tl.arange(0, TILE_SIZE)
    if not PAGED:
        kv_start = tl.load(kv_starts_ptr + first_token).to(tl.int64)
    for tile in range(0, tl.cdiv(count, TILE_SIZE)):
        positions = first + tile * TILE_SIZE + offsets
        loaded = positions < block_context
        if PAGED:
            block = tl.load(
                tables_ptr + first_token * stride_table_token + positions // BLOCK_SIZE,
                mask=loaded,
                other=0,
            ).to(tl.int64)
            slot = (positions % BLOCK_SIZE).to(tl.int64)
        else:
            block = kv_start + positions
            slot = tl.zeros_like(block)
        kv_mask = loaded[:, None] & dim_mask[None, :]
        k = tl.load(
            k_ptr
            + block[:, None] * stride_k_block
            + slot[:, None] * stride_k_slot
            + kv_head * stride_k_head
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_ptr
            + block[:, None] * stride_v_block
            + slot[:, None] * stride_v_slot
            + kv_head * stride_v_head
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if TENSOR_CORES:
            # bf16/fp16 products on tensor cores with a float32 accumulator, the numerics of
            # flash attention; every row of every program goes through the same tile shapes.
            scores = tl.dot(q, tl.trans(k.to(q.dtype))) * scale
        elif not DOT:
            # The interpreter's tl.dot rounds a row by its position in the tile (numpy BLAS).
            products = q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :]
            scores = tl.sum(products, axis=2) * scale
        else:
            scores = (
                tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            )
        valid = positions[None, :] < context[:, None]
        scores = tl.where(valid, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row whose context ended before this tile (another token of the block still reads
        # it) keeps its state exactly: its correction is 1 and its probabilities are 0.
        live = new_max > float("-inf")
        safe_max = tl.where(live, new_max, 0.0)
        correction = tl.where(live, tl.exp(running_max - safe_max), 1.0)
        probs = tl.exp(scores - safe_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        if TENSOR_CORES:
            update = tl.dot(probs.to(q.dtype), v.to(q.dtype))
        elif not DOT:
            update = tl.sum(probs[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        else:
            update = tl.dot(probs, v.to(tl.float32), input_precision="ieee")
        acc = acc * correction[:, None] + update
        running_max = new_max
    out_rows = (tokens * num_q_heads + heads) * num_splits + split
    tl.store(partial_max_ptr + out_rows, running_max, mask=row_mask)
    tl.store(partial_sum_ptr + out_rows, running_sum, mask=row_mask)
    tl.store(
        partial_out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :],
        acc,
        mask=row_mask[:, None] & dim_mask[None, :],
    )


@jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    out_ptr,
    stride_out_token,
    stride_out_head,
    num_q_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    base = (token * num_q_heads + head) * num_splits
    # Split 0 always holds position 0, so the running max is finite from the start.
    total_max = tl.load(partial_max_ptr + base)
    total_sum = tl.load(partial_sum_ptr + base)
    acc = tl.load(partial_out_ptr + base * HEAD_DIM + dims, mask=dim_mask, other=0.0)
    for split in range(1, num_splits):
        split_max = tl.load(partial_max_ptr + base + split)
        split_sum = tl.load(partial_sum_ptr + base + split)
        split_acc = tl.load(
            partial_out_ptr + (base + split) * HEAD_DIM + dims, mask=dim_mask, other=0.0
        )
        new_max = tl.maximum(total_max, split_max)
        keep = tl.exp(total_max - new_max)
        take = tl.exp(split_max - new_max)
        total_sum = total_sum * keep + split_sum * take
        acc = acc * keep + split_acc * take
        total_max = new_max
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        round_to(acc / total_sum, out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_lens: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != v.shape or k.shape[-1] != q.shape[-1]:
        raise KernelShapeError(
            f"q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}: expected q[T, Hq, D] "
            "and equal k/v with the same D"
        )
    if q.shape[1] % k.shape[-2]:
        raise KernelShapeError(
            f"q has {q.shape[1]} heads, keys {k.shape[-2]}: expected a multiple (grouped query)"
        )
    if context_lens.shape != (q.shape[0],):
        raise KernelShapeError(
            f"context_lens.shape={tuple(context_lens.shape)}; expected [{q.shape[0]}]"
        )


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor | None,
    kv_starts: torch.Tensor | None,
    context_lens: torch.Tensor,
    max_context: int,
    scale: float,
    query_blocks: torch.Tensor | None,
    rows: int,
) -> torch.Tensor:
    tokens, q_heads, dim = q.shape
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    if query_blocks is None:
        blocks, programs = context_lens, tokens
    else:
        blocks, programs = query_blocks.to(torch.int32).contiguous(), query_blocks.shape[0]
    paged = tables is not None
    if paged:
        assert tables is not None
        k4, v4 = k, v
        table = tables.contiguous()
        starts = context_lens
        block_size = k.shape[1]
    else:
        assert kv_starts is not None
        k4, v4 = k[:, None], v[:, None]
        table = context_lens
        starts = kv_starts.contiguous()
        block_size = 1
    kv_heads = k4.shape[2]
    if k4.stride(-1) != 1 or v4.stride(-1) != 1:
        raise KernelShapeError("keys and values must have a contiguous last dimension")
    q = q if q.stride(-1) == 1 else q.contiguous()
    num_splits = max(1, -(-max_context // SPLIT_SIZE))
    group = q_heads // kv_heads
    partial_out = q.new_empty((tokens, q_heads, num_splits, dim), dtype=torch.float32)
    partial_max = q.new_empty((tokens, q_heads, num_splits), dtype=torch.float32)
    partial_sum = torch.empty_like(partial_max)
    dim_pad = max(16, next_power_of_2(dim))
    _split_kernel[(programs, kv_heads, num_splits)](
        q,
        k4,
        v4,
        table,
        starts,
        context_lens.contiguous(),
        blocks,
        int(query_blocks is not None),
        partial_out,
        partial_max,
        partial_sum,
        scale,
        q.stride(0),
        q.stride(1),
        k4.stride(0),
        k4.stride(1),
        k4.stride(2),
        v4.stride(0),
        v4.stride(1),
        v4.stride(2),
        table.stride(0),
        q_heads,
        num_splits,
        PAGED=paged,
        BLOCK_SIZE=block_size,
        GROUP=group,
        ROWS=rows,
        HEAD_DIM=dim,
        HEAD_DIM_PAD=dim_pad,
        SPLIT=SPLIT_SIZE,
        TILE_SIZE=TILE,
        TENSOR_CORES=q.dtype != torch.float32 and not _interpreting(),
        DOT=not _interpreting(),
    )
    _merge_kernel[(tokens, q_heads)](
        partial_out,
        partial_max,
        partial_sum,
        out,
        out.stride(0),
        out.stride(1),
        q_heads,
        num_splits,
        HEAD_DIM=dim,
        HEAD_DIM_PAD=dim_pad,
    )
    return out


def attention_batch_invariant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    block_tables: torch.Tensor | None = None,
    kv_starts: torch.Tensor | None = None,
    max_context: int | None = None,
    query_blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention whose value for a token never depends on the other tokens of the call.

    Exactly one of ``block_tables`` (paged cache) and ``kv_starts`` (packed rows) is given.
    Dispatch: Triton on CUDA, the torch reference on CPU (``MCORE_KERNELS_BACKEND`` overrides).
    ``query_blocks`` only decides how tokens share programs (and their key/value loads), never
    a token's value.

    Args:
        q: ``[T, Hq, D]`` queries (after RoPE).
        k: Paged ``[num_blocks, block_size, Hkv, D]`` cache, or packed ``[S, Hkv, D]`` keys.
        v: Values, shaped like ``k``.
        context_lens: ``[T]`` int, each token attends to positions ``0 .. context_lens - 1``.
        scale: Multiplier of the query-key products.
        block_tables: ``[T, max_blocks]`` int physical block of each logical block (paged).
        kv_starts: ``[T]`` int row of ``k`` holding position 0 of the token's sequence.
        max_context: Host-known upper bound of ``context_lens`` (default: the table width
            times the block size when paged, else ``S``); only the launch size depends on it.
        query_blocks: ``[P, 2]`` int ``(first token, count)`` of each program's tokens:
            consecutive rows of one sequence (one table row or start), at most
            :func:`query_block_tokens` of them, covering every token once; default one token
            per program.

    Returns:
        ``[T, Hq, D]`` in ``q.dtype``.

    Raises:
        KernelShapeError: If the shapes do not fit or not exactly one addressing is given.
    """
    _check(q, k, v, context_lens)
    if query_blocks is not None and (query_blocks.dim() != 2 or query_blocks.shape[1] != 2):
        raise KernelShapeError(
            f"query_blocks.shape={tuple(query_blocks.shape)}; expected [P, 2] (first, count)"
        )
    if (block_tables is None) == (kv_starts is None):
        raise KernelShapeError(
            "expected exactly one of block_tables (paged cache) and kv_starts (packed rows)"
        )
    if block_tables is not None and (k.dim() != 4 or block_tables.shape[0] != q.shape[0]):
        raise KernelShapeError(
            f"k{tuple(k.shape)}, block_tables{tuple(block_tables.shape)}: expected a 4-D cache "
            f"and one table row per token ({q.shape[0]})"
        )
    if kv_starts is not None and (k.dim() != 3 or kv_starts.shape != (q.shape[0],)):
        raise KernelShapeError(
            f"k{tuple(k.shape)}, kv_starts{tuple(kv_starts.shape)}: expected packed [S, Hkv, D] "
            f"keys and one start per token ({q.shape[0]})"
        )
    if max_context is None:
        if block_tables is not None:
            max_context = block_tables.shape[1] * k.shape[1]
        else:
            max_context = k.shape[0]
    if use_triton(q, k, v):
        if triton is None:  # pragma: no cover - use_triton already requires it
            raise KernelShapeError("triton is not installed")
        rows = max(QUERY_ROWS, next_power_of_2(q.shape[1] // k.shape[-2]))
        return _launch(
            q, k, v, block_tables, kv_starts, context_lens, max_context, scale, query_blocks, rows
        )
    return attention_batch_invariant_reference(
        q,
        k,
        v,
        context_lens,
        scale=scale,
        block_tables=block_tables,
        kv_starts=kv_starts,
        max_context=max_context,
    )


# --- packed training sequences: autograd, custom ops, API -------------------------------------


@functools.lru_cache(maxsize=16)
def _packed_layout(
    bounds: tuple[tuple[int, int], ...], tokens: int, per_block: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Context lengths, sequence starts and query blocks of a packing, on ``device``.

    Computed once per packing (every layer of a forward, and the next steps of the same
    packing, reuse them).
    """
    starts = torch.empty(tokens, dtype=torch.int32)
    context = torch.empty(tokens, dtype=torch.int32)
    blocks = []
    longest = 1
    for start, end in bounds:
        starts[start:end] = start
        context[start:end] = torch.arange(1, end - start + 1, dtype=torch.int32)
        longest = max(longest, end - start)
        first = torch.arange(start, end, per_block, dtype=torch.int32)
        blocks.append(torch.stack((first, (end - first).clamp(max=per_block)), dim=1))
    flat = torch.cat(blocks).flatten() if blocks else torch.empty(0, dtype=torch.int32)
    layout = torch.cat([context, starts, flat]).to(device)
    context, starts, flat_blocks = layout.split([tokens, tokens, layout.numel() - 2 * tokens])
    return context, starts, flat_blocks.view(-1, 2), longest


def _equal_length_runs(bounds: tuple[tuple[int, int], ...]) -> list[tuple[int, int, int]]:
    """``(start, length, count)`` of each run of consecutive sequences of one length."""
    runs: list[tuple[int, int, int]] = []
    for start, end in bounds:
        if runs and runs[-1][1] == end - start:
            first, length, count = runs[-1]
            runs[-1] = (first, length, count + 1)
        else:
            runs.append((start, end - start, 1))
    return runs


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: tuple[tuple[int, int], ...],
    scale: float,
) -> torch.Tensor:
    context, starts, blocks, longest = _packed_layout(
        bounds, q.shape[0], query_block_tokens(q.shape[1], k.shape[1]), q.device
    )
    return attention_batch_invariant(
        q,
        k,
        v,
        context,
        scale=scale,
        kv_starts=starts,
        max_context=longest,
        query_blocks=blocks,
    )


def _backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: tuple[tuple[int, int], ...],
    scale: float,
) -> tuple[torch.Tensor, ...]:
    """Gradients of ``q, k, v`` through torch SDPA on each sequence (recomputed)."""
    from mcore_kernels.batch_invariant.mode import suspended

    with torch.enable_grad(), suspended():
        inputs = [t.detach().requires_grad_(True) for t in (q, k, v)]
        pieces = []
        # Runs of consecutive sequences of one length go through SDPA as one batch.
        for start, length, count in _equal_length_runs(bounds):
            end = start + length * count
            sq, sk, sv = (
                t[start:end].unflatten(0, (count, length)).transpose(1, 2) for t in inputs
            )
            out = F.scaled_dot_product_attention(
                sq,
                sk,
                sv,
                is_causal=True,
                scale=scale,
                enable_gqa=sq.shape[1] != sk.shape[1],
            )
            pieces.append(out.transpose(1, 2).flatten(0, 1))
        recomputed = torch.cat(pieces)
        return torch.autograd.grad(recomputed, inputs, grad)


class _PackedAttention(torch.autograd.Function):
    """Invariant forward; backward through torch SDPA on each sequence (recomputed)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bounds: tuple[tuple[int, int], ...],
        scale: float,
    ) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.bounds, ctx.scale = bounds, scale
        return _forward(q, k, v, bounds, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        grads = _backward(grad, q, k, v, ctx.bounds, ctx.scale)
        return grads[0], grads[1], grads[2], None, None


def packed_attention_batch_invariant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: list[tuple[int, int]] | tuple[tuple[int, int], ...],
    *,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed sequences with the numerics of the paged engine path.

    Token ``i`` of a sequence attends to the sequence's tokens ``0 .. i`` exactly as a decode
    or prefill token at position ``i`` does through
    :func:`~mcore_kernels.batch_invariant.attention.attention_batch_invariant` with a paged
    cache. Differentiable: the backward recomputes the attention with torch SDPA.

    Args:
        q: ``[T, Hq, D]`` queries (after RoPE).
        k: ``[T, Hkv, D]`` keys.
        v: ``[T, Hkv, D]`` values.
        bounds: ``(start, end)`` token range of every sequence, covering ``0 .. T`` in order.
        scale: Multiplier of the query-key products.

    Returns:
        ``[T, Hq, D]`` in ``q.dtype``.

    Raises:
        KernelShapeError: If the shapes do not fit or the bounds do not cover the rows.
    """
    covered = 0
    for start, end in bounds:
        if start != covered or end < start:
            raise KernelShapeError(
                f"bounds={list(bounds)}: expected consecutive (start, end) ranges from 0"
            )
        covered = end
    if covered != q.shape[0] or k.shape[0] != q.shape[0]:
        raise KernelShapeError(
            f"bounds cover {covered} tokens; q has {q.shape[0]} and k {k.shape[0]}"
        )
    nonempty = tuple((s, e) for s, e in bounds if e > s)
    if _compile.compiling():
        flat = [index for pair in nonempty for index in pair]
        return _packed_attention_op(q, k, v, flat, float(scale))
    out = _PackedAttention.apply(q, k, v, nonempty, scale)
    assert isinstance(out, torch.Tensor)
    return out


# --- torch.compile: the custom ops -----------------------------------------------------------


def _pairs(flat: list[int]) -> tuple[tuple[int, int], ...]:
    return tuple(zip(flat[::2], flat[1::2], strict=True))


@_compile.custom_op(
    "packed_attention_batch_invariant",
    "(Tensor q, Tensor k, Tensor v, int[] bounds, float scale) -> Tensor",
)
def _packed_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float
) -> torch.Tensor:
    return _forward(q, k, v, _pairs(bounds), scale).contiguous()


_packed_attention_op.register_fake(lambda q, *args: q.new_empty(q.shape))


@_compile.custom_op(
    "packed_attention_batch_invariant_bwd",
    "(Tensor grad, Tensor q, Tensor k, Tensor v, int[] bounds, float scale) "
    "-> (Tensor, Tensor, Tensor)",
)
def _packed_attention_bwd_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # A custom op runs below autograd: let it record the recomputation it differentiates.
    with _compile.autograd_inside_op():
        dq, dk, dv = _backward(grad, q, k, v, _pairs(bounds), scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


_packed_attention_bwd_op.register_fake(
    lambda grad, q, k, v, *args: (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))
)


def _setup_context(ctx, inputs, output):
    q, k, v, bounds, scale = inputs
    ctx.save_for_backward(q, k, v)
    ctx.bounds, ctx.scale = bounds, scale


def _op_backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = _packed_attention_bwd_op(grad, q, k, v, ctx.bounds, ctx.scale)
    return dq, dk, dv, None, None


_packed_attention_op.register_autograd(_op_backward, setup_context=_setup_context)
