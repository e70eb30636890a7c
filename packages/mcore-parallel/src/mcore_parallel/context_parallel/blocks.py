"""Attention of a block of queries against a block of keys, forward and backward, in fp32.

Each block returns its log-sum-exp, so that partial results over different key blocks merge
exactly (online softmax) and the backward pass can be recomputed block by block from the final
log-sum-exp, as FlashAttention does (Dao et al., "FlashAttention", NeurIPS 2022).

Two implementations: on CPU, blocks without a mask or with an exactly lower-triangular one run
PyTorch's fused flash-attention CPU kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``
and its backward, the kernel behind ``scaled_dot_product_attention`` on CPU, which also return
and take the log-sum-exp); every other block runs plain torch matmuls in fp32 with an explicit
log-sum-exp (grouped-query attention viewed as ``Hkv`` groups of ``Hq / Hkv`` heads, keys and
values not repeated). GPUs take the plain torch path.
"""

from __future__ import annotations

import torch

__all__ = ["MAX_SCORE_ELEMENTS", "block_forward", "block_backward", "merge_into"]


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    batch, heads, length, dim = q.shape
    return q.view(batch, kv_heads, heads // kv_heads, length, dim)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # Fully masked rows have lse = -inf; 0 there keeps exp(-inf - 0) = 0 instead of NaN.
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _grouped(q, k.shape[1]) @ k.unsqueeze(2).transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    else:
        lse = lse.reshape(scores.shape[:-1])
    return torch.exp(scores - _finite(lse).unsqueeze(-1)), lse


MAX_SCORE_ELEMENTS = 1 << 26
"""Score elements (fp32: 256 MiB) the plain torch path materialises at once; longer blocks are
processed in slices of query rows."""


def _row_slices(q: torch.Tensor, k: torch.Tensor, max_elements: int) -> list[slice]:
    length = q.shape[2]
    rows = max(1, max_elements // (q.shape[0] * q.shape[1] * k.shape[2]))
    return [slice(start, min(start + rows, length)) for start in range(0, length, rows)]


def _rows(mask: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if mask is None else mask[rows]


def _fused(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return mask is None and q.device.type == "cpu" and q.dtype == torch.float32


def _repeated(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1).contiguous()


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool = False,
    *,
    max_score_elements: int = MAX_SCORE_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and log-sum-exp of queries over one key block.

    Args:
        q: Queries ``[B, Hq, Tq, D]`` (fp32).
        k: Keys ``[B, Hkv, Tk, D]`` (fp32).
        v: Values ``[B, Hkv, Tk, D]`` (fp32).
        mask: Boolean ``[Tq, Tk]``, True where a query may attend a key; None for all (or
            for the lower triangle with ``is_causal``).
        scale: Factor applied to the scores.
        is_causal: With ``mask`` None, a square block where query ``i`` sees keys ``<= i``.
        max_score_elements: Bound of the scores materialised at once by the plain path.

    Returns:
        The normalised output ``[B, Hq, Tq, D]`` over this block and its log-sum-exp
        ``[B, Hq, Tq]`` (``-inf`` for rows with no allowed key, whose output is 0).
    """
    if _fused(q, mask):
        heads = q.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), _repeated(k, heads), _repeated(v, heads), 0.0, is_causal, scale=scale
        )
        return out, lse
    if is_causal and mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    batch, heads, _, dim = q.shape
    outs, lses = [], []
    for rows in _row_slices(q, k, max_score_elements):
        probs, lse = _probabilities(q[:, :, rows], k, _rows(mask, rows), scale, None)
        outs.append((probs @ v.unsqueeze(2)).view(batch, heads, -1, dim))
        lses.append(lse.view(batch, heads, -1))
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    delta: torch.Tensor,
    out: torch.Tensor,
    is_causal: bool = False,
    *,
    max_score_elements: int = MAX_SCORE_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the final log-sum-exp of the queries' rows.

    Args:
        q: Queries ``[B, Hq, Tq, D]`` (fp32).
        k: Keys ``[B, Hkv, Tk, D]`` (fp32).
        v: Values ``[B, Hkv, Tk, D]`` (fp32).
        mask: Boolean ``[Tq, Tk]`` or None, as in the forward pass.
        scale: Factor applied to the scores.
        lse: Log-sum-exp of each query row over ALL key blocks ``[B, Hq, Tq]``.
        grad_out: Gradient of the final output ``[B, Hq, Tq, D]`` (fp32).
        delta: ``(grad_out * out).sum(-1)`` of the final output ``[B, Hq, Tq]``.
        out: The final output of these rows ``[B, Hq, Tq, D]`` (fp32).
        is_causal: As in the forward pass.
        max_score_elements: Bound of the scores materialised at once by the plain path.

    Returns:
        This block's contributions to the gradients of ``q``, ``k`` and ``v``.
    """
    kv_heads = k.shape[1]
    if _fused(q, mask):
        heads, (batch, _, length, dim) = q.shape[1], k.shape
        grad_q, grad_k, grad_v = (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out.contiguous(),
                q.contiguous(),
                _repeated(k, heads),
                _repeated(v, heads),
                out.contiguous(),
                lse.contiguous(),
                0.0,
                is_causal,
                scale=scale,
            )
        )
        group = heads // kv_heads
        grad_k = grad_k.view(batch, kv_heads, group, length, dim).sum(dim=2)
        grad_v = grad_v.view(batch, kv_heads, group, length, dim).sum(dim=2)
        return grad_q, grad_k, grad_v
    if is_causal and mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    grad_qs = []
    grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
    for rows in _row_slices(q, k, max_score_elements):
        q_rows = q[:, :, rows]
        probs, _ = _probabilities(q_rows, k, _rows(mask, rows), scale, lse[:, :, rows])
        grad_out_g = _grouped(grad_out[:, :, rows], kv_heads)
        grad_v += (probs.transpose(-1, -2) @ grad_out_g).sum(dim=2)
        grad_probs = grad_out_g @ v.unsqueeze(2).transpose(-1, -2)
        row_delta = delta[:, :, rows].reshape(probs.shape[:-1])
        grad_scores = probs * (grad_probs - row_delta.unsqueeze(-1))
        grad_qs.append(((grad_scores @ k.unsqueeze(2)) * scale).view(q_rows.shape))
        grad_k += (grad_scores.transpose(-1, -2) @ _grouped(q_rows, kv_heads)).sum(dim=2) * scale
    return torch.cat(grad_qs, dim=2), grad_k, grad_v


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges a block's normalised output into the running output (online softmax).

    Args:
        out: Running output ``[B, H, T, D]``.
        lse: Running log-sum-exp ``[B, H, T]``.
        block_out: The block's output.
        block_lse: The block's log-sum-exp.

    Returns:
        The merged output and log-sum-exp.
    """
    merged = torch.logaddexp(lse, block_lse)
    safe = _finite(merged)
    out = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(
        block_lse - safe
    ).unsqueeze(-1)
    return out, merged
