"""Torch references of the batch-invariant ops (their CPU paths): attention and the GEMMs.

The attention reference runs the kernel's algorithm with torch ops: the same splits of ``SPLIT_SIZE`` positions, the
same tiles of ``TILE`` (both defined here and used by the Triton kernel), the same online softmax
and in-order merge, every token through the same fixed-shape reductions, so a token's value does
not depend on the other tokens of the call. The GEMMs' reference multiplies fixed
``REFERENCE_CHUNK_ROWS``-row chunks (see :mod:`mcore_kernels.batch_invariant.matmul`).
"""

from __future__ import annotations

import torch

__all__ = [
    "REFERENCE_CHUNK_ROWS",
    "SPLIT_SIZE",
    "TILE",
    "attention_batch_invariant_reference",
    "matmul_reference",
]

SPLIT_SIZE = 512
"""Context positions per split-KV program (fixed: part of the numerics of the mode)."""
TILE = 32
"""Context positions per loop iteration inside a split."""
REFERENCE_CHUNK_ROWS = 16
"""Rows per BLAS call of the GEMMs' reference (every call has this many rows)."""


def _gather_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor | None,
    kv_starts: torch.Tensor | None,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values ``[T, P, Hkv, D]`` at ``positions [T, P]`` (clamped to valid rows)."""
    if tables is not None:
        block_size = k.shape[1]
        column = (positions // block_size).clamp(max=tables.shape[1] - 1)
        blocks = tables.long().gather(1, column)
        flat = blocks * block_size + positions % block_size
        return k.flatten(0, 1)[flat], v.flatten(0, 1)[flat]
    assert kv_starts is not None
    rows = (kv_starts.long()[:, None] + positions).clamp(max=k.shape[0] - 1)
    return k[rows], v[rows]


def attention_batch_invariant_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    block_tables: torch.Tensor | None = None,
    kv_starts: torch.Tensor | None = None,
    max_context: int | None = None,
) -> torch.Tensor:
    """Torch reference of the batch-invariant attention (the same splits and tiles).

    The reference of :func:`~mcore_kernels.batch_invariant.attention.attention_batch_invariant`.

    Every token runs the same sequence of fixed-shape tile operations (reductions over the
    head dimension and over ``TILE`` positions), so a row does not depend on the others.

    Args:
        q: ``[T, Hq, D]`` queries.
        k: Paged ``[num_blocks, block_size, Hkv, D]`` cache or packed ``[S, Hkv, D]`` keys.
        v: Values, shaped like ``k``.
        context_lens: ``[T]`` attended positions per token.
        scale: Multiplier of the query-key products.
        block_tables: ``[T, max_blocks]`` (paged), or None.
        kv_starts: ``[T]`` first key row of each token's sequence (packed), or None.
        max_context: Upper bound of ``context_lens`` (default: read from the tensor).

    Returns:
        ``[T, Hq, D]`` in ``q.dtype``.
    """
    tokens, q_heads, dim = q.shape
    kv_heads = k.shape[-2]
    group = q_heads // kv_heads
    if max_context is None:
        max_context = int(context_lens.max()) if tokens else 1
    num_splits = max(1, -(-max_context // SPLIT_SIZE))
    qf = q.float().view(tokens, kv_heads, group, dim)
    context = context_lens.long()
    offsets = torch.arange(TILE, device=q.device)
    partials = []
    for split in range(num_splits):
        running_max = q.new_full((tokens, kv_heads, group), float("-inf"), dtype=torch.float32)
        running_sum = torch.zeros_like(running_max)
        acc = q.new_zeros((tokens, kv_heads, group, dim), dtype=torch.float32)
        for tile in range(SPLIT_SIZE // TILE):
            start = split * SPLIT_SIZE + tile * TILE
            if start >= max_context:
                break
            positions = (start + offsets).expand(tokens, TILE)
            valid = positions < context[:, None]
            keys, values = _gather_kv(k, v, block_tables, kv_starts, positions)
            keys = keys.float().masked_fill(~valid[:, :, None, None], 0.0)
            values = values.float().masked_fill(~valid[:, :, None, None], 0.0)
            # [T, Hkv, G, TILE]: products summed over D, one fixed-length reduction per score.
            scores = (qf[:, :, :, None, :] * keys.permute(0, 2, 1, 3)[:, :, None]).sum(-1)
            scores = (scores * scale).masked_fill(~valid[:, None, None, :], float("-inf"))
            new_max = torch.maximum(running_max, scores.amax(-1))
            live = new_max > float("-inf")
            safe_max = torch.where(live, new_max, 0.0)
            correction = torch.where(live, torch.exp(running_max - safe_max), 1.0)
            probs = torch.exp(scores - safe_max[..., None])
            running_sum = running_sum * correction + probs.sum(-1)
            update = (probs[..., None] * values.permute(0, 2, 1, 3)[:, :, None]).sum(-2)
            acc = acc * correction[..., None] + update
            running_max = new_max
        partials.append((running_max, running_sum, acc))
    total_max, total_sum, acc = partials[0]
    for split_max, split_sum, split_acc in partials[1:]:
        new_max = torch.maximum(total_max, split_max)
        keep = torch.exp(total_max - new_max)
        take = torch.exp(split_max - new_max)
        total_sum = total_sum * keep + split_sum * take
        acc = acc * keep[..., None] + split_acc * take[..., None]
        total_max = new_max
    return (acc / total_sum[..., None]).reshape(tokens, q_heads, dim).to(q.dtype)


def _chunked_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as fixed ``REFERENCE_CHUNK_ROWS``-row BLAS calls (the CPU-invariant product)."""
    rows = a.shape[0]
    pad = -rows % REFERENCE_CHUNK_ROWS
    if pad:
        a = torch.cat([a, a.new_zeros((pad, a.shape[1]))])
    chunks = [chunk @ b for chunk in a.split(REFERENCE_CHUNK_ROWS)]
    out = torch.cat(chunks) if chunks else a.new_empty((0, b.shape[1]))
    return out[:rows]


def matmul_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    group_ends: torch.Tensor | None = None,
    rows_per_group: int | None = None,
) -> torch.Tensor:
    """Torch reference of the grouped batch-invariant product.

    Args:
        a: ``[M, K]`` rows.
        b: ``[G, K, N]`` one matrix per group.
        group_ends: ``[G]`` end row of each group (variable groups), or None.
        rows_per_group: Rows of every group when ``group_ends`` is None (default ``M / G``).

    Returns:
        ``[M, N]`` in ``a.dtype``.
    """
    groups = b.shape[0]
    if group_ends is None:
        size = rows_per_group if rows_per_group is not None else a.shape[0] // max(groups, 1)
        ends = [size * (g + 1) for g in range(groups)]
    else:
        ends = [int(e) for e in group_ends.tolist()]
    pieces, start = [], 0
    for g, end in enumerate(ends):
        pieces.append(_chunked_mm(a[start:end], b[g]))
        start = end
    if start < a.shape[0]:
        pieces.append(a.new_zeros((a.shape[0] - start, b.shape[2])))
    return torch.cat(pieces) if pieces else a.new_empty((0, b.shape[2]))
