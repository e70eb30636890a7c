"""QK-logit clipping (MuonClip-style): rescale query/key projections whose logits grew too large.

Kimi K2 (Moonshot AI, "Kimi K2: Open Agentic Intelligence", 2025, section 2.1) bounds attention
logits by rescaling, after each optimizer step, the query and key weights of every head whose
largest pre-softmax logit ``S`` exceeded a threshold ``t``: with ``gamma = t / S`` the query
rows are multiplied by ``gamma ** alpha`` and the key rows by ``gamma ** (1 - alpha)``, so the
head's logits shrink by exactly ``gamma``. Under grouped-query attention several query heads
share one key head; the key rows of a group use the smallest ``gamma`` of its heads, which keeps
every head's logit at or below the threshold. Multi-head Latent Attention blocks are clipped
per head as :mod:`mcore_models.gpt.mla_qk_clip` describes (the shared rotary key is kept).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mcore_models.errors import ModelConfigError, ModelInputError
from mcore_models.gpt.layer import Attention
from mcore_models.gpt.mla import MLAttention
from mcore_models.gpt.mla_qk_clip import scale_mla_heads

__all__ = ["attention_logit_maxima", "clip_qk", "reset_attention_logit_maxima"]


def _attention_modules(model: nn.Module) -> list[Attention | MLAttention]:
    modules = [m for m in model.modules() if isinstance(m, (Attention, MLAttention))]
    if not modules:
        raise ModelInputError(f"model={type(model).__name__} has no attention modules")
    return modules


def attention_logit_maxima(
    model: nn.Module, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Largest pre-softmax logit of every head since the last clip or reset, for logging.

    Args:
        model: A model built with ``qk_clip_tracking=True`` that ran at least one forward
            pass (without a KV cache) since the last :func:`clip_qk`.
        group: Optional process group (e.g. data parallel) over which to take the maximum, so
            that every replica sees the same values.

    Returns:
        float32 ``[num_layers, local_heads]`` (local heads of this rank under TP).

    Raises:
        ModelConfigError: If tracking is off in the model's config.
        ModelInputError: If no forward pass was recorded since the last clip or reset.
    """
    modules = _attention_modules(model)
    if not modules[0].config.qk_clip_tracking:
        raise ModelConfigError("qk_clip_tracking=False: build the model with qk_clip_tracking=True")
    maxima = [m.max_logits for m in modules]
    if any(m is None for m in maxima):
        raise ModelInputError(
            "no attention logits were recorded since the last clip_qk; run a forward pass "
            "without a KV cache first"
        )
    stacked = torch.stack([m for m in maxima if m is not None]).float()
    if group is not None:
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
    return stacked


def reset_attention_logit_maxima(model: nn.Module) -> None:
    """Forget the recorded maxima (for example after an evaluation pass).

    Args:
        model: The model.
    """
    for module in _attention_modules(model):
        module.max_logits = None


@torch.no_grad()
def clip_qk(
    model: nn.Module,
    threshold: float,
    alpha: float = 0.5,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Rescale the query/key rows of every head whose maximum logit exceeded ``threshold``.

    Call after the optimizer step. Heads at or below the threshold are untouched (a no-op when
    no head exceeds it). The recorded maxima are reset afterwards.

    Args:
        model: A model built with ``qk_clip_tracking=True`` and ``qk_layernorm=False``.
        threshold: Largest allowed pre-softmax logit (Kimi K2 uses 100).
        alpha: Share of the rescaling applied to queries; keys get ``1 - alpha``.
        group: Optional process group over which the maxima are first max-reduced (pass the
            data-parallel group so replicas stay identical).

    Returns:
        The maxima that were used, float32 ``[num_layers, local_heads]``, for logging.

    Raises:
        ModelConfigError: If ``threshold`` or ``alpha`` is out of range, tracking is off, or
            the model normalises queries and keys (QK-norm undoes a weight rescaling).
        ModelInputError: If no forward pass was recorded since the last clip.
    """
    if not threshold > 0:
        raise ModelConfigError(f"threshold={threshold} must be positive")
    if not 0.0 <= alpha <= 1.0:
        raise ModelConfigError(f"alpha={alpha} must lie in [0, 1]")
    modules = _attention_modules(model)
    if modules[0].config.qk_layernorm:
        raise ModelConfigError(
            "qk_layernorm=True: QK-norm renormalises queries and keys, so rescaling their "
            "projection weights cannot lower the logits"
        )
    maxima = attention_logit_maxima(model, group=group)
    for module, head_max in zip(modules, maxima):
        gamma = torch.clamp(threshold / head_max, max=1.0)
        if bool((gamma < 1.0).any()) and isinstance(module, MLAttention):
            scale_mla_heads(module, gamma, alpha)
        elif bool((gamma < 1.0).any()):
            assert isinstance(module, Attention)
            group_gamma = gamma.view(module.num_kv_heads, -1).amin(dim=1)
            _scale_head_rows(module.q_proj, gamma**alpha, module.head_dim)
            _scale_head_rows(module.k_proj, group_gamma ** (1.0 - alpha), module.head_dim)
        module.max_logits = None
    return maxima


def _scale_head_rows(linear: nn.Module, factors: torch.Tensor, head_dim: int) -> None:
    row_factors = factors.repeat_interleave(head_dim)
    for name in ("weight", "bias"):
        param = getattr(linear, name, None)
        if isinstance(param, torch.Tensor):
            factor = row_factors.to(device=param.device, dtype=torch.float32)
            shape = (-1,) + (1,) * (param.dim() - 1)
            param.copy_((param.float() * factor.view(shape)).to(param.dtype))
