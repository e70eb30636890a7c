"""Attention of new tokens over a paged KV cache (decode and chunked prefill).

Every query token attends to the first ``context_lens[t]`` positions of its own sequence, whose
keys and values live in fixed-size blocks of a shared cache addressed through a per-token block
table. The Triton path splits each token's context into chunks of a fixed ``split_size``
(split-KV, as in FlashDecoding), computes a partial softmax per chunk, then merges the chunks in
a fixed order. Because the split boundaries and the merge order depend only on the token's own
context length, never on how many tokens share the launch, a token's output is the same whatever
the batch composition (batch invariance by construction).

Shapes:

- ``q``: ``[T, Hq, D]`` (new tokens, already rotated by RoPE)
- ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, Hkv, D]``, ``Hq`` a multiple of ``Hkv``
- ``block_tables``: ``[T, max_blocks]`` int32, the physical block of each logical block
- ``context_lens``: ``[T]`` int32, positions ``0 .. context_lens[t] - 1`` are attended
- returns ``[T, Hq, D]`` in ``q.dtype``

The file holds the launch configuration (below), the Triton kernels, their launcher, the
``torch.library`` registration and the entry point; the torch reference lives in
:mod:`mcore_kernels.reference` (re-exported here).
Dispatch: Triton on CUDA, the torch reference on CPU; ``MCORE_KERNELS_BACKEND=torch|triton``
overrides (with ``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors).

Launch configuration (:class:`PagedDecodeConfig`, :func:`paged_decode_config`).
A program of the split kernel computes one split of context positions for the query heads of
one key/value head, in tiles of ``tile`` positions with an online softmax. Its products are
either

- ``"dot"`` (the default): tensor-core products with float32 accumulation. The query-key
  product takes the 16-bit queries and keys themselves (their products are exact in float32);
  for the value product the probabilities are split into a 16-bit high part and a 16-bit
  remainder, two products, so the weighted sum keeps about 16 bits of each probability
  instead of the 8 of a single rounding (flash attention's). The query group is padded to 16
  rows, the smallest tensor-core tile: for multi-head attention 15 rows are padding, which
  costs little on tensor cores, and in launches of at least ``prefill_tokens`` tokens
  (chunked prefill) the padding rows hold the next tokens of the same sequence, which then
  share every key and value load. With float32 inputs the products run in IEEE float32.
- ``"sum"``: the group broadcast against the tile in float32 (``tl.sum``, no padding rows);
  also what tiles of fewer than 16 positions run.

On one H100 (``benchmarks/bench_paged_attention.py``) the tensor-core products were the fastest
at every measured group size (1 to 8) and head dimension (64, 72, 128), ahead of float32
broadcast products (with one to eight key/value heads per program) by 1.2-2.2x, and tiles of 64
positions the best or within a few percent of it. The configuration depends only on the shape
and the dtype, never on the batch or the context lengths, so a token's output does not depend
on the other tokens of the launch.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import _interpreting, use_triton
from mcore_kernels._triton_utils import (
    TicketPool,
    device_limits,
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    prefetch_l2,
    tl,
    triton,
)
from mcore_kernels._validation import check_paged_attention_args
from mcore_kernels.errors import KernelBackendError, KernelShapeError, KernelValueError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import paged_attention_reference

__all__ = [
    "DEFAULT_MERGE",
    "DEFAULT_SPLIT_SIZE",
    "MERGES",
    "PAGED_ATTENTION_MODES",
    "WIDE_LAUNCH_PROGRAMS_PER_SM",
    "PagedDecodeConfig",
    "paged_decode_config",
    "paged_attention",
    "paged_attention_partials",
    "paged_attention_reference",
    "paged_attention_triton",
]

PAGED_ATTENTION_MODES = ("dot", "sum")
"""Product variants of the paged split kernel (see the module docstring)."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class PagedDecodeConfig:
    """How the paged split kernel computes its tiles.

    Raises:
        KernelShapeError: If a field is out of range.
    """

    mode: str = "dot"
    """One of :data:`PAGED_ATTENTION_MODES`."""
    tile: int = 64
    """Context positions per loop iteration (a power of two; capped by the split size)."""
    num_warps: int = 4
    """Warps per program (a power of two)."""
    num_stages: int = 2
    """Software-pipelining stages of the tile loop."""
    max_registers: int = 0
    """Registers per thread the compiler may use (``maxnreg``; 0: its own choice). A cap lets
    more programs share a multiprocessor."""
    prefill_tokens: int = 1024
    """Launches of at least this many tokens put consecutive tokens of one sequence into one
    program (mode ``"dot"``); results are the same either way, only the loads differ."""

    def __post_init__(self) -> None:
        if self.mode not in PAGED_ATTENTION_MODES:
            raise KernelShapeError(f"mode={self.mode!r}; expected one of {PAGED_ATTENTION_MODES}")
        for name in ("tile", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise KernelShapeError(f"{name}={value}; expected a power of two")
        if self.num_stages < 1:
            raise KernelShapeError(f"num_stages={self.num_stages}; expected at least 1")
        if self.max_registers < 0 or self.max_registers > 255:
            raise KernelShapeError(
                f"max_registers={self.max_registers}; expected 0 (no cap) to 255"
            )
        if self.prefill_tokens < 1:
            raise KernelShapeError(f"prefill_tokens={self.prefill_tokens}; expected at least 1")


WIDE_LAUNCH_PROGRAMS_PER_SM = 4
"""Decode launches with at least this many programs per multiprocessor run 2 warps per program
with at most 128 registers per thread (more programs resident per multiprocessor; the same
bits as 4 warps). One H200, Qwen2.5-0.5B heads, split 256: 8 x 32768 49.3 against 57.0 us, 4 x
32768 27.5 against 33.1 us, 512 x 160 16.9 against 21.1 us; slower from 2 programs per
multiprocessor down (16 x 2048 15.9 against 15.8 us, 1 x 32768 18.7 against 17.1 us)."""


def paged_decode_config(
    group: int,
    head_dim: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    programs_per_sm: float = 0.0,
) -> PagedDecodeConfig:
    """Default launch configuration of the paged split kernel for one attention shape.

    Args:
        group: Query heads per key/value head.
        head_dim: Channels per head.
        num_kv_heads: Key/value heads of the cache.
        dtype: Dtype of the queries and the cache.
        programs_per_sm: Programs of the decode launch per multiprocessor (0: unknown or not
            a decode launch).

    Returns:
        The configuration: tensor-core products in tiles of 64 positions for every shape
        measured so far (see the module docstring); 2 warps and at most 128 registers per
        thread in decode launches of at least :data:`WIDE_LAUNCH_PROGRAMS_PER_SM` programs per
        multiprocessor, else 4 warps.
    """
    del group, head_dim, num_kv_heads, dtype
    if programs_per_sm >= WIDE_LAUNCH_PROGRAMS_PER_SM:
        return PagedDecodeConfig(num_warps=2, max_registers=128)
    return PagedDecodeConfig()


DEFAULT_SPLIT_SIZE = 256
"""Context positions handled by one split-KV program (a multiple of the KV block size)."""
PREFETCH_KV_WITH_PDL = True
"""Under programmatic dependent launch, decode programs request their key and value rows into
L2 before waiting for the previous kernel (a hint: no value changes). One H100, Qwen2.5-0.5B
shape, batch 1 decode: 1419 against 1381 tokens/s, the same tokens."""
MERGES = ("ticket", "kernel")
"""How :func:`paged_attention_triton` merges the splits of a token (see its ``merge``)."""
DEFAULT_MERGE = "kernel"
"""The merge :func:`paged_attention_triton` uses unless told otherwise."""
MERGE_CHUNK = 8
"""Splits the ticket merge reads per step (a fixed size: the sums do not depend on the
launch's number of splits)."""
AUTO_SPLIT_PROGRAMS_PER_SM = 3
"""With ``split_size=None`` the split grows while the launch keeps at least this many programs
per multiprocessor (see :func:`auto_split_size`)."""
AUTO_SPLIT_MAX = 1024
"""Largest split :func:`auto_split_size` picks."""
MERGE_SPLITS_CHUNK = 32
"""Splits the merge kernel reads at once (a fixed size: the sums do not depend on the launch's
number of splits). One load per split in a dependent chain made the merge the larger part of a
long-context launch (about 128 splits at 32k positions)."""
_TICKETS = TicketPool()
"""Zeroed counters of the ticket reduction (this op's own: see ``TicketPool``)."""


@jit
def _attend_rows(
    q,
    ctx_rows,
    active,
    table,
    k_ptr,
    v_ptr,
    kv_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    scale,
    split_start,
    length,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT: tl.constexpr,
    ALIGN: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # Online softmax of the active rows over positions split_start .. split_start + length - 1
    # of one block table, in tiles of TILE positions; each row sees positions < its context.
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    tiles = tl.arange(0, TILE)
    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    end = split_start + length
    for i in range(0, (length + TILE - 1) // TILE):
        # A tile may span several KV blocks: gather each position's physical block.
        positions = split_start + i * TILE + tiles
        valid = positions < end
        physical = tl.load(table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slots = positions % BLOCK_SIZE
        kv_mask = valid[:, None] & dim_mask[None, :]
        k_rows = (
            physical * stride_k_block + slots * stride_k_slot + kv_head * stride_k_head
        ) * ALIGN
        k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if not DOT:
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        elif DOT_F32:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        seen = active[:, None] & (positions[None, :] < ctx_rows[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # Rows that have seen no position yet (other tokens' rows, contexts ending before
        # this split) subtract 0 instead of -inf: exact zeros rather than NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp(running_max - shift)
        probs = tl.exp(scores - shift[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        v_rows = (
            physical * stride_v_block + slots * stride_v_slot + kv_head * stride_v_head
        ) * ALIGN
        v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if not DOT:
            update = tl.sum(probs[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        else:
            # The probabilities as a 16-bit high part plus a 16-bit remainder: two products
            # keep about 16 bits of each probability (one rounding would keep 8).
            high = probs.to(v.dtype)
            low = (probs - high.to(tl.float32)).to(v.dtype)
            if DOT_F32:
                v32 = v.to(tl.float32)
                update = tl.dot(high.to(tl.float32), v32, input_precision="ieee")
                update += tl.dot(low.to(tl.float32), v32, input_precision="ieee")
            else:
                update = tl.dot(high, v)
                update += tl.dot(low, v)
        acc = acc * correction[:, None] + update
        running_max = new_max
    return running_max, running_sum, acc


@jit
def _prefetch_kv(
    k_ptr,
    v_ptr,
    block_tables_ptr,
    context_lens_ptr,
    token,
    kv_head,
    split_start,
    stride_table_token,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    ALIGN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    LINE: tl.constexpr,
):
    """Request one token's key and value rows of one split into L2 (128-byte lines)."""
    context = tl.load(context_lens_ptr + token).to(tl.int32)
    count = tl.minimum(tl.maximum(context - split_start, 0), SPLIT_SIZE)
    table = block_tables_ptr + token.to(tl.int64) * stride_table_token
    positions = tl.arange(0, 128)
    for start in range(0, count, 128):
        position = split_start + start + positions
        valid = start + positions < count
        physical = tl.load(table + position // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = tl.where(valid, position % BLOCK_SIZE, 0)
        k_rows = (
            physical * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head
        ) * ALIGN
        v_rows = (
            physical * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
        ) * ALIGN
        for offset in tl.static_range(0, HEAD_DIM, LINE):
            prefetch_l2(k_ptr + k_rows + offset)
            prefetch_l2(v_ptr + v_rows + offset)


@jit
def _load_split_chunk(
    partial_out_ptr, partial_max_ptr, partial_sum_ptr, base, used, splits, dims, dim_mask,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The maxima, sums and outputs of splits ``splits`` of rows ``base`` (only those below
    ``used``; the others read as -inf, 0 and 0)."""
    here = splits[None, :] < used[:, None]
    split_max = tl.load(
        partial_max_ptr + base[:, None] + splits[None, :],
        mask=here,
        other=float("-inf"),
        cache_modifier=".cg",
    )
    split_sum = tl.load(
        partial_sum_ptr + base[:, None] + splits[None, :],
        mask=here,
        other=0.0,
        cache_modifier=".cg",
    )
    split_out = tl.load(
        partial_out_ptr
        + (base[:, None, None] + splits[None, :, None]) * HEAD_DIM
        + dims[None, None, :],
        mask=here[:, :, None] & dim_mask[None, None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    return split_max, split_sum, split_out


@jit
def _merge_rows(
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    out_ptr,
    tokens,
    heads,
    row_ok,
    ctx_rows,
    num_q_heads,
    num_splits,
    stride_out_token,
    stride_out_head,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Merge the splits of ``ROWS`` (token, head) rows in chunks of ``CHUNK`` splits.

    Only the splits that hold a row's context are read (the others count as exact zeros), in
    chunks of a fixed size: the sums do not depend on how many splits the launch has, so a
    table cut to the context and the full-width table give the same bits.
    """
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    chunk = tl.arange(0, CHUNK)
    used = tl.where(row_ok, tl.minimum((ctx_rows + SPLIT_SIZE - 1) // SPLIT_SIZE, num_splits), 0)
    base = (tokens * num_q_heads + heads) * num_splits
    chunks = (tl.max(used, axis=0) + CHUNK - 1) // CHUNK
    # The first chunk's maxima, sums and outputs in one round trip (short contexts have one
    # chunk: then nothing is read twice); the sums below run in the same order either way.
    first_max, first_sum, first_out = _load_split_chunk(
        partial_out_ptr, partial_max_ptr, partial_sum_ptr, base, used, chunk, dims, dim_mask,
        HEAD_DIM,
    )  # fmt: skip
    total_max = tl.max(first_max, axis=1)
    for c in range(1, chunks):
        splits = c * CHUNK + chunk
        here = splits[None, :] < used[:, None]
        split_max = tl.load(
            partial_max_ptr + base[:, None] + splits[None, :],
            mask=here,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        total_max = tl.maximum(total_max, tl.max(split_max, axis=1))
    # Rows without data (padding) keep a zero shift: exact zeros, no NaN.
    shift = tl.where(total_max == float("-inf"), 0.0, total_max)
    weight = tl.exp(first_max - shift[:, None])
    total_sum = tl.zeros([ROWS], tl.float32) + tl.sum(first_sum * weight, axis=1)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32) + tl.sum(
        first_out * weight[:, :, None], axis=1
    )
    for c in range(1, chunks):
        split_max, split_sum, split_out = _load_split_chunk(
            partial_out_ptr, partial_max_ptr, partial_sum_ptr, base, used, c * CHUNK + chunk,
            dims, dim_mask, HEAD_DIM,
        )  # fmt: skip
        weight = tl.exp(split_max - shift[:, None])
        total_sum += tl.sum(split_sum * weight, axis=1)
        acc += tl.sum(split_out * weight[:, :, None], axis=1)
    out = acc / tl.where(row_ok, total_sum, 1.0)[:, None]
    tl.store(
        out_ptr
        + tokens[:, None] * stride_out_token
        + heads[:, None] * stride_out_head
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_mask[None, :],
    )


@jit(do_not_specialize=["num_tokens", "num_splits", "stride_table_token"])
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
    ticket_ptr,
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
    num_tokens,
    num_q_heads,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    TOKENS: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    SPLIT_BLOCKS_PAD: tl.constexpr,
    TILE: tl.constexpr,
    DOT: tl.constexpr,
    ALIGN: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH_KV: tl.constexpr,
    KV_LINE: tl.constexpr,
    TICKET_MERGE: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    PARTIALS: tl.constexpr = False,
):
    if USE_PDL:
        # Programmatic dependent launch: let the next kernel start, then wait for the previous
        # one (which wrote the queries and the new keys and values) before reading them.
        gdc_launch_dependents()
        if PREFETCH_KV:
            # The block tables and context lengths were written before the step's first
            # projection started: this program's key and value rows can be requested into
            # L2 already (a hint; the new token's row is read again after the wait).
            _prefetch_kv(
                k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, tl.program_id(0),
                tl.program_id(1), tl.program_id(2) * SPLIT_SIZE, stride_table_token,
                stride_k_block, stride_k_slot, stride_k_head,
                stride_v_block, stride_v_slot, stride_v_head,
                ALIGN, BLOCK_SIZE, SPLIT_SIZE, HEAD_DIM, KV_LINE,
            )  # fmt: skip
        gdc_wait()
    # Rows of the program: TOKENS consecutive tokens x GROUP_PAD query heads of one KV head,
    # padded to ROWS (16 for tensor-core products). The cache strides arrive divided by ALIGN
    # (their common divisor, at most 16 elements), so every row start is known ALIGN-aligned
    # and the loads vectorise whatever the head dimension.
    first = tl.program_id(0) * TOKENS
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    member = rows // GROUP_PAD
    tokens = first + member
    heads = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (member < TOKENS) & (rows % GROUP_PAD < GROUP) & (tokens < num_tokens)
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
    table = block_tables_ptr + first * stride_table_token
    if TOKENS == 1:
        running_max, running_sum, acc = _attend_rows(
            q, ctx_rows, row_ok, table, k_ptr, v_ptr, kv_head,
            stride_k_block, stride_k_slot, stride_k_head,
            stride_v_block, stride_v_slot, stride_v_head,
            scale, split_start, tl.max(remaining, axis=0),
            ROWS, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE, DOT, ALIGN, DOT_F32,
        )  # fmt: skip
    else:
        # Tokens of one sequence (chunked prefill) share their block table: one pass loads
        # each key and value once for all of them. A row's arithmetic is the same as in a
        # one-token program (its own context mask; later tiles add exact zeros), so the
        # grouping never changes a result. Tokens whose tables differ over this split take
        # one pass each.
        members = tl.arange(0, TOKENS)
        member_ctx = tl.load(
            context_lens_ptr + first + members, mask=first + members < num_tokens, other=0
        ).to(tl.int32)
        member_blocks = (
            tl.minimum(tl.maximum(member_ctx - split_start, 0), SPLIT_SIZE) + BLOCK_SIZE - 1
        ) // BLOCK_SIZE
        columns = tl.arange(0, SPLIT_BLOCKS_PAD)
        needed = columns[None, :] < member_blocks[:, None]
        first_block = split_start // BLOCK_SIZE + columns[None, :]
        own = tl.load(
            block_tables_ptr + (first + members)[:, None] * stride_table_token + first_block,
            mask=needed,
            other=0,
        )
        shared = tl.load(table + first_block + 0 * members[:, None], mask=needed, other=0)
        differing = tl.sum(tl.sum((own != shared).to(tl.int32), axis=1), axis=0)
        if differing == 0:
            running_max, running_sum, acc = _attend_rows(
                q, ctx_rows, row_ok, table, k_ptr, v_ptr, kv_head,
                stride_k_block, stride_k_slot, stride_k_head,
                stride_v_block, stride_v_slot, stride_v_head,
                scale, split_start, tl.max(remaining, axis=0),
                ROWS, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE, DOT, ALIGN, DOT_F32,
            )  # fmt: skip
        else:
            running_max = tl.full([ROWS], float("-inf"), tl.float32)
            running_sum = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
            for m in range(0, TOKENS):
                mine = row_ok & (member == m)
                pass_max, pass_sum, pass_acc = _attend_rows(
                    q, ctx_rows, mine, table + m * stride_table_token, k_ptr, v_ptr, kv_head,
                    stride_k_block, stride_k_slot, stride_k_head,
                    stride_v_block, stride_v_slot, stride_v_head,
                    scale, split_start, tl.max(tl.where(mine, remaining, 0), axis=0),
                    ROWS, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE, DOT, ALIGN, DOT_F32,
                )  # fmt: skip
                running_max = tl.where(mine, pass_max, running_max)
                running_sum = tl.where(mine, pass_sum, running_sum)
                acc = tl.where(mine[:, None], pass_acc, acc)
    if num_splits == 1 and not PARTIALS:
        # The merge of a single split is this division (bit for bit): no partials, no merge.
        out = acc / running_sum[:, None]
        tl.store(
            out_ptr
            + tokens[:, None] * stride_out_token
            + heads[:, None] * stride_out_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_mask[None, :],
        )
    else:
        # Row layout of the partials: [T, Hq, num_splits] (+ [D] for the outputs). Splits past
        # a token's context are never read by the merge.
        row = (tokens * num_q_heads + heads) * num_splits + split
        tl.store(partial_max_ptr + row, running_max, mask=row_ok)
        tl.store(partial_sum_ptr + row, running_sum, mask=row_ok)
        tl.store(
            partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=row_ok[:, None] & dim_mask[None, :],
        )
        if TICKET_MERGE:
            # The last of the num_splits programs of these rows (counted with an atomic
            # ticket) merges their splits: no second launch. Every thread's partials are
            # written before the ticket (release) is taken.
            tl.debug_barrier()
            ticket = ticket_ptr + tl.program_id(0) * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                _merge_rows(
                    partial_out_ptr, partial_max_ptr, partial_sum_ptr, out_ptr, tokens, heads,
                    row_ok, ctx_rows, num_q_heads, num_splits, stride_out_token,
                    stride_out_head, ROWS, HEAD_DIM, HEAD_DIM_PAD, SPLIT_SIZE, MERGE_CHUNK,
                )  # fmt: skip
                # Reset for the next launch (graph replays reuse the tickets).
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")


# The split count follows the table width, which eager steps cut to their longest context.
@jit(do_not_specialize=["num_splits"])
def _paged_attention_merge_kernel(
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    context_lens_ptr,
    out_ptr,
    stride_out_token,
    stride_out_head,
    num_q_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # One (token, head) row. Splits past the token's context hold exact zeros (max -inf):
    # merging them changes nothing, so only the splits that hold data are read, CHUNK at a
    # time (independent loads, not one dependent load per split). The chunk size is fixed, so
    # the sums depend only on the token's context, never on the launch's number of splits.
    token = tl.program_id(0)
    head = tl.program_id(1)
    context = tl.load(context_lens_ptr + token).to(tl.int32)
    used_splits = tl.minimum((context + SPLIT_SIZE - 1) // SPLIT_SIZE, num_splits)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    chunk = tl.arange(0, CHUNK)
    base = (token * num_q_heads + head) * num_splits
    total_max = tl.full([CHUNK], float("-inf"), tl.float32)
    for start in range(0, used_splits, CHUNK):
        splits = start + chunk
        total_max = tl.maximum(
            total_max,
            tl.load(
                partial_max_ptr + base + splits,
                mask=splits < used_splits,
                other=float("-inf"),
                cache_modifier=".cg",
            ),
        )
    # Split 0 always holds data (context_lens >= 1), so the maximum is finite.
    shift = tl.max(total_max, axis=0)
    sums = tl.zeros([CHUNK], tl.float32)
    acc = tl.zeros([CHUNK, HEAD_DIM_PAD], tl.float32)
    for start in range(0, used_splits, CHUNK):
        splits = start + chunk
        here = splits < used_splits
        weight = tl.exp(
            tl.load(
                partial_max_ptr + base + splits,
                mask=here,
                other=float("-inf"),
                cache_modifier=".cg",
            )
            - shift
        )
        sums += weight * tl.load(
            partial_sum_ptr + base + splits, mask=here, other=0.0, cache_modifier=".cg"
        )
        split_out = tl.load(
            partial_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
            mask=here[:, None] & dim_mask[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += split_out * weight[:, None]
    out = tl.sum(acc, axis=0) / tl.sum(sums, axis=0)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def auto_split_size(
    num_tokens: int,
    num_kv_heads: int,
    max_context: int,
    block_size: int,
    device: torch.device,
) -> int:
    """Split size of a launch with ``split_size=None``: as large as the parallelism allows.

    Starts at :data:`DEFAULT_SPLIT_SIZE` (rounded up to a multiple of the block size) and
    doubles, up to :data:`AUTO_SPLIT_MAX`, while the launch still has at least
    :data:`AUTO_SPLIT_PROGRAMS_PER_SM` programs (one per token, key/value head and split) per
    multiprocessor: longer splits stream their keys and values longer per program and leave
    fewer partials to merge (long contexts over many sequences), while short contexts or few
    sequences keep the default's parallelism. The choice depends on the launch (its token count
    and table width), so a token's result may differ in the last bits between launches of
    different sizes: callers that need batch invariance pass a fixed ``split_size``.

    Args:
        num_tokens: Query tokens of the launch.
        num_kv_heads: Key/value heads of the cache.
        max_context: Positions the block table can hold (its width times the block size).
        block_size: Positions per cache block.
        device: The launch's device (its multiprocessor count).

    Returns:
        The split size, a multiple of ``block_size``.
    """
    split = -(-DEFAULT_SPLIT_SIZE // block_size) * block_size
    target = AUTO_SPLIT_PROGRAMS_PER_SM * device_limits(device)[0]
    while (
        2 * split <= max(AUTO_SPLIT_MAX, split)
        and num_tokens * num_kv_heads * -(-max_context // (2 * split)) >= target
    ):
        split *= 2
    return split


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    split_size: int | None = DEFAULT_SPLIT_SIZE,
    config: PagedDecodeConfig | None = None,
    merge: str = DEFAULT_MERGE,
) -> torch.Tensor:
    """Split-KV Triton paged attention; launch shapes are fixed by the table width (graph-safe).

    The number of splits is ``ceil(max_blocks * block_size / split_size)``, taken from the block
    table width rather than from the context lengths, so the launch never reads a device value
    and can be captured in a CUDA graph. With one split the split kernel normalises and writes
    the output itself (one launch); otherwise the merge reads only the splits that hold a
    token's context, whatever the table width. Neither changes a result bit: the merge of one
    split is the same division, and empty splits add exact zeros.

    Args:
        q: Query of the new tokens, ``[T, Hq, D]``.
        k_cache: Key cache, ``[num_blocks, block_size, Hkv, D]``, last dim contiguous.
        v_cache: Value cache, same shape as ``k_cache``.
        block_tables: Physical block of each logical block of each token, ``[T, max_blocks]``.
        context_lens: Number of attended positions per token, ``[T]``, each at least 1.
        scale: Softmax scale applied to the dot products.
        split_size: Context positions per split; a multiple of the block size. None picks it
            for the launch (:func:`auto_split_size`): then a token's result may differ in
            the last bits between launches of different sizes.
        config: How a program computes its tiles; None picks
            :func:`~mcore_kernels.paged_attention.paged_decode_config` for the shape.
        merge: How several splits are merged: ``"ticket"`` (the last program of each token's
            key/value head, counted with an atomic ticket, merges them; one launch) or
            ``"kernel"`` (a second, merge kernel). The two sum in different orders, so they
            may differ in the last bits; each gives the same bits whatever the table width
            and the batch.

    Returns:
        The attention output, ``[T, Hq, D]`` in ``q.dtype``.

    Raises:
        KernelShapeError: If the shapes do not match, ``split_size`` is not a positive
            multiple of the block size or ``config`` does not fit the shape.
        KernelDtypeError: If a dtype is unsupported.
        KernelBackendError: If Triton is not installed.
    """
    out, partials, num_splits, split_size = _launch_splits(
        q, k_cache, v_cache, block_tables, context_lens, scale, split_size, config, merge, False
    )
    ticket_merge = merge == "ticket" and num_splits > 1
    if q.shape[0] == 0 or num_splits == 1 or ticket_merge:
        return out
    merge_splits(*partials, context_lens, out, split_size=split_size)
    return out


def paged_attention_partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    split_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split kernel's unmerged partial results, for a consumer that merges them itself.

    Every split that holds a token's context gets its partial, a single split included (its
    merge is then the division the one-split kernel does, bit for bit). :func:`merge_splits`,
    or ``_merge_rows`` inside another kernel, merges them.

    Args:
        q: Query of the new tokens, ``[T, Hq, D]``.
        k_cache: Key cache, ``[num_blocks, block_size, Hkv, D]``, last dim contiguous.
        v_cache: Value cache, same shape as ``k_cache``.
        block_tables: Physical block of each logical block of each token, ``[T, max_blocks]``.
        context_lens: Number of attended positions per token, ``[T]``, each at least 1.
        scale: Softmax scale applied to the dot products.
        split_size: Context positions per split; a multiple of the block size.

    Returns:
        float32 ``(partial_out [T, Hq, S, D], partial_max [T, Hq, S], partial_sum [T, Hq,
        S])`` with ``S = ceil(max_blocks * block_size / split_size)``; splits past a token's
        context are left unwritten.

    Raises:
        KernelShapeError: If the shapes do not match or ``split_size`` is not a positive
            multiple of the block size.
        KernelDtypeError: If a dtype is unsupported.
        KernelBackendError: If Triton is not installed.
    """
    _, partials, _, _ = _launch_splits(
        q, k_cache, v_cache, block_tables, context_lens, scale, split_size, None, "kernel", True
    )
    return partials


def _launch_splits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    split_size: int | None,
    config: PagedDecodeConfig | None,
    merge: str,
    partials_only: bool,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], int, int]:
    """Launch the split kernel: ``(out, (partial_out, partial_max, partial_sum), num_splits,
    split_size)``; ``out`` holds the result when one split holds everything or the ticket
    merge ran (and ``partials_only`` is False)."""
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    check_paged_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if split_size is None:
        split_size = auto_split_size(
            num_tokens, num_kv_heads, block_tables.shape[1] * block_size, block_size, q.device
        )
    if split_size <= 0 or split_size % block_size != 0:
        raise KernelShapeError(
            f"split_size={split_size}; expected a positive multiple of the block size {block_size}"
        )
    if merge not in MERGES:
        raise KernelValueError(f"merge={merge!r}; expected one of {MERGES}")
    group = num_q_heads // num_kv_heads
    num_splits = max(1, -(-block_tables.shape[1] * block_size // split_size))
    if config is None:
        # Decode launches: programs per multiprocessor (one per token, key/value head, split).
        decode = num_tokens < PagedDecodeConfig().prefill_tokens
        programs = num_tokens * num_kv_heads * num_splits if decode else 0
        config = paged_decode_config(
            group, head_dim, num_kv_heads, k_cache.dtype, programs / device_limits(q.device)[0]
        )
    out = torch.empty_like(q)
    # One split (short contexts, or tables cut to the step's longest context) writes the
    # output itself; the partials are then never touched.
    partial_shape = (num_tokens, num_q_heads, num_splits if num_splits > 1 or partials_only else 1)
    partial_out = torch.empty((*partial_shape, head_dim), dtype=torch.float32, device=q.device)
    partial_max = torch.empty(partial_shape, dtype=torch.float32, device=q.device)
    partial_sum = torch.empty_like(partial_max)
    partials = (partial_out, partial_max, partial_sum)
    if num_tokens == 0:
        return out, partials, num_splits, split_size
    q = q if q.stride(-1) == 1 else q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise KernelShapeError("k_cache and v_cache must have a contiguous last dimension")
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    # Tiles of positions: a power of two dividing split_size, so the accumulation order
    # depends on split_size and the config only; tensor-core products need 16 or more.
    tile = min(config.tile, split_size & -split_size)
    dot = config.mode == "dot" and tile >= 16
    strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    align = math.gcd(16, *strides)
    # The tensor-core products take 16-bit operands of one dtype; anything else (float32
    # caches, mixed dtypes, the interpreter's unusable 16-bit dot) runs them in IEEE float32.
    dot_f32 = (
        q.dtype != k_cache.dtype
        or k_cache.dtype == torch.float32
        or v_cache.dtype != k_cache.dtype
        or _interpreting()
    )
    group_pad = next_power_of_2(group)
    rows = max(16, group_pad) if dot else group_pad
    # Large launches (chunked prefill) fill the padding rows with the next tokens; the
    # grouping never changes a result, only how often keys and values are read.
    tokens = rows // group_pad if dot and num_tokens >= config.prefill_tokens else 1
    grid = (-(-num_tokens // tokens), num_kv_heads, num_splits)
    use_pdl = pdl_enabled(q.device)
    ticket_merge = merge == "ticket" and num_splits > 1
    tickets = _TICKETS.get(q.device, grid[0] * grid[1]) if ticket_merge else partial_max
    _paged_attention_split_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        partial_out,
        partial_max,
        partial_sum,
        out,
        tickets,
        scale,
        q.stride(0),
        q.stride(1),
        *(stride // align for stride in strides),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_tokens,
        num_q_heads,
        num_splits,
        GROUP=group,
        GROUP_PAD=group_pad,
        TOKENS=tokens,
        ROWS=rows,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        SPLIT_SIZE=split_size,
        SPLIT_BLOCKS_PAD=next_power_of_2(split_size // block_size),
        TILE=tile,
        DOT=dot,
        ALIGN=align,
        DOT_F32=dot_f32,
        USE_PDL=use_pdl,
        PREFETCH_KV=use_pdl and tokens == 1 and PREFETCH_KV_WITH_PDL,
        KV_LINE=max(1, 128 // k_cache.element_size()),
        TICKET_MERGE=ticket_merge,
        MERGE_CHUNK=MERGE_CHUNK,
        PARTIALS=partials_only,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"maxnreg": config.max_registers} if config.max_registers else {}),
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out, partials, num_splits, split_size


def merge_splits(
    partial_out: torch.Tensor,
    partial_max: torch.Tensor,
    partial_sum: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    split_size: int,
) -> None:
    """Merge the per-split partial results of a split-KV attention kernel into ``out``.

    Shared by every split-KV kernel (paged and MLA): splits are merged in order, reading only
    those that hold a token's context.

    Args:
        partial_out: float32 ``[T, H, S, D]`` partial outputs (probability-weighted value sums).
        partial_max: float32 ``[T, H, S]`` running maxima.
        partial_sum: float32 ``[T, H, S]`` running sums.
        context_lens: ``[T]`` attended positions per token.
        out: ``[T, H, D]`` output, written in place.
        split_size: Context positions per split.
    """
    num_tokens, num_heads, num_splits, head_dim = partial_out.shape
    _paged_attention_merge_kernel[(num_tokens, num_heads)](
        partial_out,
        partial_max,
        partial_sum,
        context_lens,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        num_splits,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        SPLIT_SIZE=split_size,
        CHUNK=MERGE_SPLITS_CHUNK,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    split_size: int | None = DEFAULT_SPLIT_SIZE,
    merge: str | None = None,
) -> torch.Tensor:
    """Attention of new tokens over a paged KV cache, dispatched to Triton or torch.

    Args:
        q: Query of the new tokens, ``[T, Hq, D]``.
        k_cache: Key cache, ``[num_blocks, block_size, Hkv, D]``.
        v_cache: Value cache, same shape as ``k_cache``.
        block_tables: Physical block of each logical block of each token, ``[T, max_blocks]``.
        context_lens: Number of attended positions per token, ``[T]``, each at least 1.
        scale: Softmax scale applied to the dot products.
        split_size: Context positions per split-KV program (Triton path); None picks it for
            the launch (:func:`auto_split_size`; :data:`DEFAULT_SPLIT_SIZE` under
            ``torch.compile``).
        merge: How the Triton path merges splits (see :func:`paged_attention_triton`; None:
            :data:`DEFAULT_MERGE`). Under ``torch.compile`` the default merge runs.

    Returns:
        The attention output, ``[T, Hq, D]`` in ``q.dtype``. Under ``torch.compile`` the call
        is the opaque custom op ``torch.ops.mcore_kernels.paged_attention`` (inference only: no
        backward).

    Raises:
        KernelShapeError: If the shapes do not match the layout above.
        KernelDtypeError: If a dtype is unsupported.
        KernelBackendError: If ``MCORE_KERNELS_BACKEND`` names an unknown backend or one that
            cannot run on these tensors.
    """
    if _compile.compiling():
        check_paged_attention_args(q, k_cache, v_cache, block_tables, context_lens)
        return _paged_attention_op(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            float(scale),
            DEFAULT_SPLIT_SIZE if split_size is None else split_size,
        )
    return _paged_attention_run(
        q, k_cache, v_cache, block_tables, context_lens, scale, split_size, merge
    )


def _paged_attention_run(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    split_size: int | None,
    merge: str | None = None,
) -> torch.Tensor:
    if use_triton(q, k_cache, v_cache):
        return paged_attention_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale=scale,
            split_size=split_size,
            merge=DEFAULT_MERGE if merge is None else merge,
        )
    return paged_attention_reference(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale=scale,
        split_size=DEFAULT_SPLIT_SIZE if split_size is None else split_size,
    )


@_compile.custom_op(
    "paged_attention",
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
    "float scale, int split_size) -> Tensor",
)
def _paged_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    split_size: int,
) -> torch.Tensor:
    out = _paged_attention_run(q, k_cache, v_cache, block_tables, context_lens, scale, split_size)
    # The fake implementation promises a contiguous result, whatever the layout of ``q``.
    return out.contiguous()


_paged_attention_op.register_fake(lambda q, *args: q.new_empty(q.shape))
