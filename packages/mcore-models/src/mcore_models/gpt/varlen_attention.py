"""Causal attention over all packed sequences of a row in one kernel call (CUDA).

A packed training row holds many short sequences. Attending one sequence at a time launches a
forward kernel, a backward kernel and a slice/concatenate per sequence and layer (hundreds of
tiny launches per row); ``torch.nn.attention.varlen.varlen_attn`` runs the flash-attention
kernel once over the whole row with the sequence boundaries ``cu_seqlens``, forward and
backward. Its keyword set changed between torch releases (``is_causal`` in 2.10,
``window_size``/``scale``/``enable_gqa`` later), so the call is adapted to the installed
signature once.

Grouped-query attention: releases without ``enable_gqa`` (torch 2.11) accept only as many key
heads as query heads, and repeating the keys and values per group costs a copy forward and a
reduction backward in every layer. The flash kernel itself reads a key head per group, so
grouped rows call the ATen flash-attention operators directly (one autograd function); should
that call fail on some release, the repeated-heads path takes over for the rest of the process.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["varlen_attention_available", "varlen_causal_attention", "varlen_prefix_attention"]

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
_native_gqa_failed = False


class _FlashVarlenFunction(torch.autograd.Function):
    """Causal varlen flash attention through the ATen operators (grouped heads read in place)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        scale: float,
    ) -> torch.Tensor:
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, cu_seqlens, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu_seqlens,
            cu_seqlens,
            ctx.max_seqlen,
            ctx.max_seqlen,
            0.0,
            True,
            rng_state,
            unused,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None


class _FlashPrefixFunction(torch.autograd.Function):
    """Varlen flash attention whose sequences also read a shared prefix (gathered keys/values).

    The keys and values of sequence ``i`` are those of its prefix followed by its own, gathered
    with ``kv_index``; the causal mask of the flash kernel is aligned to the bottom right when a
    sequence has more keys than queries, so query ``j`` sees the whole prefix and its own first
    ``j + 1`` tokens. Backward sums the gradients of every gathered copy in float32.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        kv_index: torch.Tensor,
        max_q: int,
        max_k: int,
        scale: float,
    ) -> torch.Tensor:
        keys, values = k.index_select(0, kv_index), v.index_select(0, kv_index)
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, keys, values, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, kv_index, rng_state, unused)
        ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, cu_q, cu_k, kv_index, rng_state, unused = ctx.saved_tensors
        # The gathered copies are rebuilt rather than kept: they are small next to the layer.
        keys, values = k.index_select(0, kv_index), v.index_select(0, kv_index)
        dq, dkeys, dvalues = torch.ops.aten._flash_attention_backward(
            grad.contiguous(),
            q,
            keys,
            values,
            out,
            lse,
            cu_q,
            cu_k,
            ctx.max_q,
            ctx.max_k,
            0.0,
            True,
            rng_state,
            unused,
            scale=ctx.scale,
        )
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        dk.index_add_(0, kv_index, dkeys.float())
        dv.index_add_(0, kv_index, dvalues.float())
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def varlen_prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    kv_index: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every packed sequence over its shared prefix and itself, in one call.

    Args:
        q: ``[T, Hq, D]`` queries of the packed row.
        k: ``[T, Hkv, D]`` keys (``Hq`` a multiple of ``Hkv``).
        v: ``[T, Hkv, D]`` values.
        cu_seqlens_q: int32 ``[N + 1]`` query starts of the (non-empty) sequences, 0 to ``T``.
        cu_seqlens_k: int32 ``[N + 1]`` starts of every sequence's keys in the gathered rows
            (its prefix's length plus its own).
        kv_index: int64 token indices of the gathered keys/values: for every sequence, its
            prefix's tokens then its own.
        max_seqlen_q: Length of the longest sequence.
        max_seqlen_k: Most keys of one sequence (prefix included).
        scale: Multiplier of the query-key products.

    Returns:
        ``[T, Hq, D]`` attention output.
    """
    result = _FlashPrefixFunction.apply(
        q,
        k,
        v.contiguous(),
        cu_seqlens_q,
        cu_seqlens_k,
        kv_index,
        max_seqlen_q,
        max_seqlen_k,
        scale,
    )
    assert isinstance(result, torch.Tensor)
    return result


@functools.cache
def _varlen_function() -> tuple[Callable[..., Any], frozenset[str]] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_attention_available(q: torch.Tensor) -> bool:
    """Whether :func:`varlen_causal_attention` can serve queries like ``q``.

    Args:
        q: Queries ``[..., D]``.

    Returns:
        True on CUDA for bf16/fp16 with a head width the flash kernel takes (a multiple of 8,
        at most 256) when this torch has ``torch.nn.attention.varlen``.
    """
    head_dim = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in _SUPPORTED_DTYPES
        and head_dim % 8 == 0
        and head_dim <= 256
        and _varlen_function() is not None
    )


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every packed sequence over itself, in one call.

    Args:
        q: ``[T, Hq, D]`` queries of the packed row.
        k: ``[T, Hkv, D]`` keys (``Hq`` a multiple of ``Hkv``: grouped-query attention, query
            head ``h`` reads key head ``h // (Hq / Hkv)``).
        v: ``[T, Hkv, D]`` values.
        cu_seqlens: int32 ``[N + 1]`` sequence starts on the device of ``q``, from 0 to ``T``.
        max_seqlen: Length of the longest sequence.
        scale: Multiplier of the query-key products.

    Returns:
        ``[T, Hq, D]`` attention output.

    Raises:
        RuntimeError: If this torch has no ``torch.nn.attention.varlen``.
    """
    global _native_gqa_failed
    # Values may be strided (a slice of a fused projection); the kernels take packed rows.
    v = v.contiguous()
    found = _varlen_function()
    if found is None:
        raise RuntimeError("torch.nn.attention.varlen is not available in this torch build")
    function, params = found
    if q.shape[1] != k.shape[1] and "enable_gqa" not in params and not _native_gqa_failed:
        try:
            result = _FlashVarlenFunction.apply(q, k, v, cu_seqlens, max_seqlen, scale)
            assert isinstance(result, torch.Tensor)
            return result
        except (RuntimeError, TypeError) as error:
            # NOTE: private ATen operators; if this release's signature or kernel refuses the
            # call, the public function with repeated key/value heads computes the same.
            _native_gqa_failed = True
            warnings.warn(
                f"varlen flash attention with grouped heads failed ({type(error).__name__}: "
                f"{error}); repeating key/value heads instead",
                RuntimeWarning,
                stacklevel=2,
            )
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, q.shape[-1] ** -0.5):
        q = q * (scale * math.sqrt(q.shape[-1]))
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    out = function(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
    assert isinstance(out, torch.Tensor)
    return out
