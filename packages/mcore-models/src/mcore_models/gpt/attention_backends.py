"""Causal self-attention kernels behind one signature: torch SDPA, FlexAttention, eager.

All functions take queries ``[B, T, Hq, D]`` and keys/values ``[B, T, Hkv, D]`` (grouped-query
attention when ``Hkv < Hq``) and return ``[B, T, Hq, D]``. Packed sequences are described by a
:class:`AttentionMask`, built once per forward pass and shared by all layers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mcore_models.errors import AttentionBackendError
from mcore_models.gpt.varlen_attention import varlen_attention_available, varlen_causal_attention
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
            allowed = allowed & (segments[:, None] == segments[None, :])
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
        mask.segment_bounds = [(cu[i], cu[i + 1]) for i in range(len(cu) - 1) if cu[i + 1] > cu[i]]
        if backend == "sdpa" and device.type == "cuda":
            starts = [0] + [end for _, end in mask.segment_bounds]
            mask.varlen_cu_seqlens = torch.tensor(starts, dtype=torch.int32).to(
                device, non_blocking=True
            )
            mask.varlen_max_seqlen = max(end - start for start, end in mask.segment_bounds)
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        segments = mask.segment_ids

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            causal = q_idx >= kv_idx
            if segments is None:
                return causal
            return causal & (segments[q_idx] == segments[kv_idx])

        mask.block_mask = create_block_mask(
            mask_mod, None, None, seq_len, seq_len, device=str(device)
        )
    return mask


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
