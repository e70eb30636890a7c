"""Packed-sequence causal attention with the numerics of the engine's batch-invariant kernel.

The training forward of a packed row calls this: the forward is
:func:`~mcore_kernels.batch_invariant.attention.attention_batch_invariant` reading the packed
keys and values (one start row per token), so a token equals the engine's decode or prefill of
the same sequence bitwise; consecutive tokens of a sequence share a program (query blocks), so
each key/value tile is loaded once for several tokens; the backward recomputes the attention with torch SDPA per sequence
(gradients need no invariance).

Eager calls go through ``_PackedAttention``; while ``torch.compile`` traces a call it becomes the
custom op ``torch.ops.mcore_kernels.packed_attention_batch_invariant`` with the registered
backward ``packed_attention_batch_invariant_bwd`` (the same SDPA recomputation). The torch
reference of the forward is
:func:`~mcore_kernels.batch_invariant.reference.attention_batch_invariant_reference`, which
:func:`~mcore_kernels.batch_invariant.attention.attention_batch_invariant` runs on the CPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from mcore_kernels import _compile
from mcore_kernels.batch_invariant.attention import attention_batch_invariant, query_block_tokens
from mcore_kernels.errors import KernelShapeError

__all__ = ["packed_attention_batch_invariant"]


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
