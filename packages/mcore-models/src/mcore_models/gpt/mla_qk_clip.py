"""QK-logit clipping of Multi-head Latent Attention heads (the MLA part of MuonClip).

In MLA a head's logit is ``q_nope . k_nope + q_rope . k_rope`` where ``q_nope``, ``k_nope``
and ``q_rope`` are per head and ``k_rope`` is shared by all heads. Kimi K2 (Moonshot AI, "Kimi
K2: Open Agentic Intelligence", 2025, section 2.1) therefore rescales only the per-head parts:
with ``gamma = t / S`` the no-position query and key rows take ``gamma ** alpha`` and
``gamma ** (1 - alpha)`` (``sqrt(gamma)`` each for ``alpha = 0.5``) and the rotary query rows
take all of ``gamma``; the shared rotary key is left alone, so no other head changes and the
head's logits shrink by exactly ``gamma``.
"""

from __future__ import annotations

import torch
from torch import nn

from mcore_models.gpt.mla import MLAttention

__all__ = ["scale_mla_heads"]


@torch.no_grad()
def scale_mla_heads(module: MLAttention, gamma: torch.Tensor, alpha: float) -> None:
    """Shrink the logits of each local head of an MLA block by its factor, in place.

    Args:
        module: The MLA block (this rank's heads under tensor parallelism).
        gamma: ``[local_heads]`` factors in ``(0, 1]``.
        alpha: Share of a head's factor applied to its no-position query rows; the
            no-position key rows (in ``kv_b_proj``) get ``1 - alpha`` and the rotary query
            rows the whole factor.
    """
    mla = module.mla
    query = module.q_proj if module.q_proj is not None else module.q_b_proj
    assert query is not None
    ones = torch.ones_like(gamma)
    query_factors = torch.cat(
        [
            (gamma**alpha)[:, None].expand(-1, mla.qk_nope_head_dim),
            gamma[:, None].expand(-1, mla.qk_rope_head_dim),
        ],
        dim=1,
    )
    key_factors = torch.cat(
        [
            (gamma ** (1.0 - alpha))[:, None].expand(-1, mla.qk_nope_head_dim),
            ones[:, None].expand(-1, mla.v_head_dim),
        ],
        dim=1,
    )
    _scale_rows(query, query_factors.flatten())
    _scale_rows(module.kv_b_proj, key_factors.flatten())


def _scale_rows(linear: nn.Module, row_factors: torch.Tensor) -> None:
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    factor = row_factors.to(device=weight.device, dtype=torch.float32)[:, None]
    weight.copy_((weight.float() * factor).to(weight.dtype))
