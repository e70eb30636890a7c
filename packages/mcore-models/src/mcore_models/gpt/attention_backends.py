"""Causal self-attention kernels behind one signature: torch SDPA, FlexAttention, eager.

All functions take queries ``[B, T, Hq, D]`` and keys/values ``[B, T, Hkv, D]`` (grouped-query
attention when ``Hkv < Hq``) and return ``[B, T, Hq, D]``. Packed sequences are described by a
:class:`AttentionMask`, built once per forward pass and shared by all layers.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mcore_models.errors import AttentionBackendError
from mcore_models.gpt.varlen_attention import (
    varlen_attention_available,
    varlen_causal_attention,
    varlen_prefix_attention,
)
from mcore_models.packed_seq import PackedSeqParams

__all__ = ["AttentionMask", "attend", "build_attention_mask", "max_attention_logits"]


@dataclass(slots=True)
class AttentionMask:
    """Causal (and, for packed input, document) mask of one forward pass."""

    seq_len: int
    """Number of tokens per row."""
    segment_ids: torch.Tensor | None = None
    """int64 ``[T]`` sequence index of every token of a packed row, None when unpacked."""
    segment_bounds: list[tuple[int, int]] | None = None
    """``(start, end)`` of every packed sequence, on the host, for per-sequence kernels."""
    block_mask: Any = None
    """FlexAttention BlockMask (only for the "flex" backend)."""
    cu_seqlens: torch.Tensor | None = None
    """Under context parallelism: boundaries of the packed sequences of the full row."""
    varlen_cu_seqlens: torch.Tensor | None = None
    """int32 starts of the non-empty packed sequences on the device (CUDA "sdpa" backend): one
    varlen flash-attention call serves the whole row."""
    varlen_max_seqlen: int = 0
    """Length of the longest packed sequence (with ``varlen_cu_seqlens``)."""
    prefix_of: torch.Tensor | None = None
    """int64 ``[n]``: per packed sequence, the sequence whose tokens it also attends to (its
    shared prefix, see ``PackedSeqParams.prefix_of``) or -1; None without shared prefixes."""
    prefix_bounds: list[tuple[int, int] | None] | None = None
    """``(start, end)`` of the prefix of every entry of ``segment_bounds`` (None: none)."""
    varlen_cu_seqlens_k: torch.Tensor | None = None
    """With shared prefixes: int32 starts of every sequence's gathered keys (prefix + own)."""
    varlen_kv_index: torch.Tensor | None = None
    """With shared prefixes: int64 token indices gathering every sequence's keys and values."""
    varlen_max_seqlen_k: int = 0
    """With shared prefixes: most keys of one sequence."""

    def dense(self, device: torch.device) -> torch.Tensor:
        """Build the boolean ``[T, T]`` mask (True where a query may attend to a key).

        Args:
            device: Device of the mask.

        Returns:
            The mask.
        """
        positions = torch.arange(self.seq_len, device=device)
        allowed = positions[:, None] >= positions[None, :]
        if self.segment_ids is not None:
            segments = self.segment_ids.to(device)
            same = segments[:, None] == segments[None, :]
            if self.prefix_of is not None:
                parents = self.prefix_of.to(device)[segments]
                same = same | (parents[:, None] == segments[None, :])
            allowed = allowed & same
        return allowed


_compiled_flex: Callable[..., torch.Tensor] | None = None
# Shapes whose compilation failed once; they run uncompiled from then on.
_flex_compile_failures: set[tuple[Any, ...]] = set()


def _flex_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if not args[0].is_cuda:
        # NOTE: eager flex runs an unfused reference on CPU; compiling it there costs more
        # than it saves at test sizes, so its "use torch.compile" warning is silenced.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return flex_attention(*args, **kwargs)
    signature = (*(tuple(a.shape) for a in args[:3]), args[0].dtype)
    if signature in _flex_compile_failures:
        return flex_attention(*args, **kwargs)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    try:
        return _compiled_flex(*args, **kwargs)
    except Exception as error:  # any Inductor/Dynamo failure is recoverable here
        # NOTE: some torch releases cannot lower flex attention for every shape and mask
        # (seen on torch 2.11 with packed document masks: "NoValidChoicesError"). The uncompiled
        # flex_attention computes the same result, only slower; fall back for this signature.
        _flex_compile_failures.add(signature)
        warnings.warn(
            f"compiled flex attention failed for q/k/v shapes {signature[:3]} "
            f"({type(error).__name__}); using uncompiled flex_attention for them",
            RuntimeWarning,
            stacklevel=2,
        )
        return flex_attention(*args, **kwargs)


def build_attention_mask(
    backend: str,
    seq_len: int,
    device: torch.device,
    packed_seq_params: PackedSeqParams | None,
) -> AttentionMask:
    """Prepare the mask a backend needs for one forward pass.

    Args:
        backend: "sdpa", "flex" or "eager".
        seq_len: Tokens per row.
        device: Device of the activations.
        packed_seq_params: Packed-sequence boundaries, or None.

    Returns:
        The mask description.
    """
    mask = AttentionMask(seq_len=seq_len)
    if packed_seq_params is not None:
        mask.segment_ids = packed_seq_params.segment_ids(device)
        cu = packed_seq_params.cu_seqlens.tolist()
        kept = [i for i in range(len(cu) - 1) if cu[i + 1] > cu[i]]
        mask.segment_bounds = [(cu[i], cu[i + 1]) for i in kept]
        if packed_seq_params.prefix_of is not None:
            parents = packed_seq_params.prefix_of.tolist()
            mask.prefix_of = packed_seq_params.prefix_of.to(device=device, dtype=torch.int64)
            mask.prefix_bounds = [
                (cu[p], cu[p + 1]) if p >= 0 and cu[p + 1] > cu[p] else None
                for p in (parents[i] for i in kept)
            ]
        if backend == "sdpa" and device.type == "cuda":
            starts = [0] + [end for _, end in mask.segment_bounds]
            mask.varlen_cu_seqlens = torch.tensor(starts, dtype=torch.int32).to(
                device, non_blocking=True
            )
            mask.varlen_max_seqlen = max(end - start for start, end in mask.segment_bounds)
            if mask.prefix_bounds is not None and any(mask.prefix_bounds):
                _varlen_prefix_inputs(mask, device)
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        segments = mask.segment_ids
        token_parents = (
            mask.prefix_of[segments]
            if mask.prefix_of is not None and segments is not None
            else None
        )

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            causal = q_idx >= kv_idx
            if segments is None:
                return causal
            same = segments[q_idx] == segments[kv_idx]
            if token_parents is not None:
                same = same | (token_parents[q_idx] == segments[kv_idx])
            return causal & same

        mask.block_mask = create_block_mask(
            mask_mod, None, None, seq_len, seq_len, device=str(device)
        )
    return mask


def _varlen_prefix_inputs(mask: AttentionMask, device: torch.device) -> None:
    # Gather indices of every sequence's keys: its prefix's tokens, then its own.
    assert mask.segment_bounds is not None and mask.prefix_bounds is not None
    pieces, key_starts = [], [0]
    for (start, end), prefix in zip(mask.segment_bounds, mask.prefix_bounds):
        if prefix is not None:
            pieces.append(torch.arange(prefix[0], prefix[1]))
        pieces.append(torch.arange(start, end))
        key_starts.append(key_starts[-1] + (end - start) + (prefix[1] - prefix[0] if prefix else 0))
    mask.varlen_kv_index = torch.cat(pieces).to(device, non_blocking=True)
    mask.varlen_cu_seqlens_k = torch.tensor(key_starts, dtype=torch.int32).to(
        device, non_blocking=True
    )
    mask.varlen_max_seqlen_k = max(b - a for a, b in itertools.pairwise(key_starts))


def attend(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    scale: float,
) -> torch.Tensor:
    """Causal attention of ``q`` over ``k``/``v`` with the selected backend.

    Args:
        backend: "sdpa" (torch scaled_dot_product_attention: flash or memory-efficient kernels;
            packed rows on CUDA in bf16/fp16 run all sequences in one varlen flash-attention
            call, elsewhere one sequence at a time), "flex" (FlexAttention with a document
            block mask; on CPU with autograd, where FlexAttention has no backward, the eager
            kernel applies the same mask) or "eager" (explicit softmax, the reference).
        q: ``[B, T, Hq, D]`` queries.
        k: ``[B, T, Hkv, D]`` keys.
        v: ``[B, T, Hkv, D]`` values.
        mask: Mask from :func:`build_attention_mask` for the same backend.
        scale: Multiplier of the query-key products.

    Returns:
        ``[B, T, Hq, D]`` attention output in the dtype of ``q``.

    Raises:
        AttentionBackendError: If the backend is unknown or its mask was not prepared.
    """
    if (
        backend == "sdpa"
        and mask.varlen_cu_seqlens is not None
        and q.shape[0] == 1
        and v.shape[-1] == q.shape[-1]
        and varlen_attention_available(q)
    ):
        if mask.varlen_kv_index is not None:
            assert mask.varlen_cu_seqlens_k is not None
            out = varlen_prefix_attention(
                q[0],
                k[0],
                v[0],
                mask.varlen_cu_seqlens,
                mask.varlen_cu_seqlens_k,
                mask.varlen_kv_index,
                mask.varlen_max_seqlen,
                mask.varlen_max_seqlen_k,
                scale,
            )
            return out[None]
        out = varlen_causal_attention(
            q[0], k[0], v[0], mask.varlen_cu_seqlens, mask.varlen_max_seqlen, scale
        )
        return out[None]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[1] != k.shape[1]
    if backend == "sdpa":
        if mask.segment_bounds is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=gqa
            )
        elif mask.prefix_bounds is not None:
            out = torch.cat(
                [
                    _prefix_segment_attention(q, k, v, bounds, prefix, scale, gqa)
                    for bounds, prefix in zip(mask.segment_bounds, mask.prefix_bounds)
                ],
                dim=2,
            )
        else:
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        q[:, :, s:e],
                        k[:, :, s:e],
                        v[:, :, s:e],
                        is_causal=True,
                        scale=scale,
                        enable_gqa=gqa,
                    )
                    for s, e in mask.segment_bounds
                ],
                dim=2,
            )
    elif backend == "flex":
        if mask.block_mask is None:
            raise AttentionBackendError(
                "attention_backend='flex' needs a block mask; the mask was built for another "
                "backend"
            )
        if not q.is_cuda and torch.is_grad_enabled() and q.requires_grad:
            # NOTE: torch's FlexAttention has no CPU backward; on CPU with autograd the same
            # causal document mask is applied by the eager kernel instead.
            out = _eager_attention(q, k, v, mask, scale)
        else:
            out = _flex_attention(q, k, v, block_mask=mask.block_mask, scale=scale, enable_gqa=gqa)
    elif backend == "eager":
        out = _eager_attention(q, k, v, mask, scale)
    else:
        raise AttentionBackendError(
            f"attention_backend={backend!r} is unknown; expected 'sdpa', 'flex' or 'eager'"
        )
    return out.transpose(1, 2)


def _prefix_segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: tuple[int, int],
    prefix: tuple[int, int] | None,
    scale: float,
    gqa: bool,
) -> torch.Tensor:
    # One packed sequence ([B, H, T, D] layout) over its shared prefix (if any) and itself.
    start, end = bounds
    if prefix is None:
        return F.scaled_dot_product_attention(
            q[:, :, start:end],
            k[:, :, start:end],
            v[:, :, start:end],
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
    keys = torch.cat([k[:, :, prefix[0] : prefix[1]], k[:, :, start:end]], dim=2)
    values = torch.cat([v[:, :, prefix[0] : prefix[1]], v[:, :, start:end]], dim=2)
    length, shared = end - start, prefix[1] - prefix[0]
    allowed = torch.ones(length, shared + length, dtype=torch.bool, device=q.device).tril(shared)
    return F.scaled_dot_product_attention(
        q[:, :, start:end], keys, values, attn_mask=allowed, scale=scale, enable_gqa=gqa
    )


def _eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float
) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask.dense(q.device), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


@torch.no_grad()
def max_attention_logits(
    q: torch.Tensor, k: torch.Tensor, mask: AttentionMask, scale: float
) -> torch.Tensor:
    """Maximum pre-softmax logit of every query head over all unmasked query-key pairs.

    Computed in float32 over chunks of queries so that memory stays bounded whatever the
    backend (SDPA and FlexAttention never expose their logits).

    Args:
        q: ``[B, T, Hq, D]`` queries (after RoPE and QK-norm).
        k: ``[B, T, Hkv, D]`` keys.
        mask: Mask of the forward pass.
        scale: Multiplier of the query-key products.

    Returns:
        float32 ``[Hq]``.
    """
    batch, seq_len, heads, dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    qf = q.float().reshape(batch, seq_len, kv_heads, groups, dim)
    kf = k.float()
    allowed = mask.dense(q.device)
    chunk = max(1, (1 << 24) // max(1, batch * heads * seq_len))
    result = torch.full((heads,), float("-inf"), device=q.device)
    for start in range(0, seq_len, chunk):
        stop = min(seq_len, start + chunk)
        scores = torch.einsum("bqhgd,bkhd->bhgqk", qf[:, start:stop], kf) * scale
        scores = scores.masked_fill(~allowed[start:stop], float("-inf"))
        result = torch.maximum(result, scores.amax(dim=(0, 3, 4)).reshape(heads))
    return result
