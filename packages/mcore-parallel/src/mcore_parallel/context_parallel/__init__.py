"""Context-parallel attention: ring attention and all-gather-KV, with load-balanced chunks.

Under context parallelism (cp) each rank of a cp group holds ``T / cp`` tokens of every
sequence: chunks ``r`` and ``2 cp - 1 - r`` of the sequence cut into ``2 cp`` chunks (packed
sequences are cut sequence by sequence), which balances causal attention work over the ranks.
Everything except attention is token-local; attention needs every rank's keys and values.

Entry point (what a model's attention calls in place of ``scaled_dot_product_attention``)::

    out = context_parallel_attention(
        q, k, v, cp_group, *, causal=True, cu_seqlens=None, scale=None, method="ring"
    )

- ``q``: ``[B, Hq, T_local, D]``, ``k`` and ``v``: ``[B, Hkv, T_local, D]`` (torch SDPA's
  layout), ``Hkv`` dividing ``Hq`` (grouped-query attention), this rank's tokens in the order
  :func:`split_sequence` gives them (RoPE applied with :func:`position_ids`).
- ``cp_group``: the context-parallel ``ProcessGroup`` (``state.group("cp")``) or a
  :class:`~mcore_parallel.state.ParallelState`.
- ``cu_seqlens``: cumulative lengths of the packed sequences of the FULL sequence (length
  ``T_local * cp``; the same tensor on every cp rank), each length a multiple of ``2 cp``;
  None for unpacked batches (then ``T_local * cp`` must be a multiple of ``2 cp``).
- ``scale``: score scale, default ``D ** -0.5``.
- ``method``: ``"ring"`` (keys/values passed round the ring with overlapped asynchronous
  point-to-point, ``O(T_local)`` extra memory) or ``"all_gather"`` (keys/values all-gathered,
  one SDPA call, ``O(T)`` extra memory).
- Returns ``[B, Hq, T_local, D]`` in ``q``'s dtype; differentiable in ``q``, ``k``, ``v``.
  Forward and backward equal single-process attention over the full sequence.

Helpers for the model's inputs: :func:`split_sequence` (this rank's tokens of any ``[B, T,
...]`` tensor), :func:`position_ids`, :func:`local_cu_seqlens` and :func:`gather_sequence`
(full order back, differentiable). With ``cp_size == 1`` all of them are the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.context_parallel.all_gather import all_gather_kv_attention
from mcore_parallel.context_parallel.layout import ChunkLayout
from mcore_parallel.context_parallel.ring import RingAttentionFunction
from mcore_parallel.context_parallel.split import (
    gather_sequence,
    local_cu_seqlens,
    position_ids,
    split_sequence,
)
from mcore_parallel.errors import ParallelConfigError, ParallelTypeError
from mcore_parallel.state import ParallelState

__all__ = [
    "context_parallel_attention",
    "ring_attention",
    "all_gather_attention",
    "split_sequence",
    "gather_sequence",
    "position_ids",
    "local_cu_seqlens",
    "ChunkLayout",
]

METHODS = ("ring", "all_gather")
"""Accepted values of ``method``."""


def _resolve_group(group: Any) -> dist.ProcessGroup:
    if isinstance(group, ParallelState):
        return group.group("cp")
    if isinstance(group, dist.ProcessGroup):
        return group
    raise ParallelTypeError(
        f"group must be a ProcessGroup or a ParallelState, got {type(group).__name__}"
    )


def _check_qkv(q: Any, k: Any, v: Any) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ParallelTypeError(f"{name} must be a 4-D tensor [B, heads, T, D], got {got}")
    if k.shape != v.shape:
        raise ParallelConfigError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    batch, heads, length, dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, length, dim):
        raise ParallelConfigError(
            f"k of shape {tuple(k.shape)} does not match q of shape {tuple(q.shape)} in batch, "
            "length or head dimension"
        )
    if heads % k.shape[1]:
        raise ParallelConfigError(
            f"q has {heads} heads, not a multiple of the {k.shape[1]} key/value heads"
        )


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | ParallelState,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    method: str = "ring",
) -> torch.Tensor:
    """Attention of this rank's queries over the keys and values of the whole cp group.

    Args:
        q: Local queries ``[B, Hq, T_local, D]``.
        k: Local keys ``[B, Hkv, T_local, D]``.
        v: Local values ``[B, Hkv, T_local, D]``.
        group: The context-parallel group, or a ParallelState (its ``"cp"`` group).
        causal: Causal (decoder) attention.
        cu_seqlens: Cumulative lengths of the packed sequences of the full sequence, or None.
        scale: Score scale; default ``D ** -0.5``.
        method: ``"ring"`` or ``"all_gather"``.

    Returns:
        The local output ``[B, Hq, T_local, D]``.

    Raises:
        ParallelTypeError: If a tensor is not 4-D or ``group`` has the wrong type.
        ParallelConfigError: If shapes disagree, ``Hkv`` does not divide ``Hq``, ``method`` is
            unknown or a sequence length is not a multiple of ``2 * cp``.
    """
    if method not in METHODS:
        raise ParallelConfigError(f"method={method!r} must be one of {list(METHODS)}")
    _check_qkv(q, k, v)
    process_group = _resolve_group(group)
    cp_size = dist.get_world_size(process_group)
    layout = ChunkLayout(q.shape[2] * cp_size, cp_size, cu_seqlens, q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if method == "all_gather":
        return all_gather_kv_attention(q, k, v, process_group, layout, causal, scale)
    return RingAttentionFunction.apply(q, k, v, process_group, layout, causal, scale)  # type: ignore[no-any-return]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | ParallelState,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Ring attention; :func:`context_parallel_attention` with ``method="ring"``.

    Args:
        q: Local queries ``[B, Hq, T_local, D]``.
        k: Local keys ``[B, Hkv, T_local, D]``.
        v: Local values ``[B, Hkv, T_local, D]``.
        group: The context-parallel group, or a ParallelState.
        causal: Causal attention.
        cu_seqlens: Cumulative lengths of the full packed sequence, or None.
        scale: Score scale; default ``D ** -0.5``.

    Returns:
        The local output ``[B, Hq, T_local, D]``.
    """
    return context_parallel_attention(
        q, k, v, group, causal=causal, cu_seqlens=cu_seqlens, scale=scale, method="ring"
    )


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | ParallelState,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """All-gather-KV attention; :func:`context_parallel_attention` with ``method="all_gather"``.

    Args:
        q: Local queries ``[B, Hq, T_local, D]``.
        k: Local keys ``[B, Hkv, T_local, D]``.
        v: Local values ``[B, Hkv, T_local, D]``.
        group: The context-parallel group, or a ParallelState.
        causal: Causal attention.
        cu_seqlens: Cumulative lengths of the full packed sequence, or None.
        scale: Score scale; default ``D ** -0.5``.

    Returns:
        The local output ``[B, Hq, T_local, D]``.
    """
    return context_parallel_attention(
        q, k, v, group, causal=causal, cu_seqlens=cu_seqlens, scale=scale, method="all_gather"
    )
