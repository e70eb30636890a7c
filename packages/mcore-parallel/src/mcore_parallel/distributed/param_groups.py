"""Parameter groups of the distributed optimizer, and the rule of which ones get no decay.

The no-decay rule: a parameter gets no weight decay when it has fewer than two dimensions
(biases, the scales of LayerNorm/RMSNorm and other norms) or belongs to an embedding module
(``nn.Embedding``, :class:`~mcore_parallel.tensor_parallel.VocabParallelEmbedding`; an output
layer tied to the embedding shares its parameter and follows it). Decaying them shrinks
per-channel scales and rare tokens' embeddings toward zero without regularising any
interaction, which is why GPT-style training recipes (GPT-3, Llama) exempt them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mcore_parallel.errors import ParallelConfigError, ParallelTypeError
from mcore_parallel.tensor_parallel.layers import VocabParallelEmbedding

__all__ = ["no_weight_decay_names", "weight_decay_param_groups", "GROUP_OPTIONS"]

GROUP_OPTIONS = ("lr", "betas", "eps", "weight_decay")
"""Options a parameter group may set (the others come from the optimizer's config)."""

_EMBEDDINGS = (nn.Embedding, VocabParallelEmbedding)


def no_weight_decay_names(module: nn.Module) -> set[str]:
    """Returns the names of the parameters the no-decay rule exempts.

    Args:
        module: The model (unwrapped: names as in ``module.named_parameters()``).

    Returns:
        Names of parameters with fewer than two dimensions or owned by an embedding module.
    """
    names = {name for name, param in module.named_parameters() if param.dim() < 2}
    embedding_params = {
        id(param)
        for sub in module.modules()
        if isinstance(sub, _EMBEDDINGS)
        for param in sub.parameters(recurse=False)
    }
    names |= {name for name, param in module.named_parameters() if id(param) in embedding_params}
    return names


def weight_decay_param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Splits the trainable parameters into a decayed and a non-decayed group.

    Args:
        module: The model (unwrapped).
        weight_decay: Decay of the first group; the second (the no-decay rule's) gets 0.

    Returns:
        ``{"params": [...], "weight_decay": weight_decay}`` and
        ``{"params": [...], "weight_decay": 0.0}``, empty groups left out, parameters in
        ``named_parameters()`` order.
    """
    exempt = no_weight_decay_names(module)
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in trainable if n not in exempt], "weight_decay": weight_decay},
        {"params": [p for n, p in trainable if n in exempt], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def check_param_groups(
    groups: Any, trainable: list[nn.Parameter], names: dict[nn.Parameter, str]
) -> list[dict[str, Any]]:
    """Validates user parameter groups against the model's trainable parameters.

    Args:
        groups: A list of dicts, each with ``"params"`` and optional :data:`GROUP_OPTIONS`.
        trainable: The model's trainable parameters.
        names: Name of each trainable parameter (for the messages).

    Returns:
        The groups as new dicts with ``params`` as lists.

    Raises:
        ParallelTypeError: If ``groups`` is not a list of dicts with a ``params`` entry.
        ParallelConfigError: If a group sets an unknown option, a parameter is not a trainable
            parameter of the model or appears twice, or a trainable parameter is in no group.
    """
    if not isinstance(groups, (list, tuple)) or not all(
        isinstance(g, dict) and "params" in g for g in groups
    ):
        raise ParallelTypeError(
            f"param_groups must be a list of dicts with a 'params' entry, got {groups!r:.200}"
        )
    known = {id(p) for p in trainable}
    seen: set[int] = set()
    result = []
    for index, group in enumerate(groups):
        unknown = sorted(set(group) - {"params", *GROUP_OPTIONS})
        if unknown:
            raise ParallelConfigError(
                f"param_groups[{index}] sets {unknown}; a group may set {list(GROUP_OPTIONS)}"
            )
        params = list(group["params"])
        for param in params:
            if id(param) not in known:
                raise ParallelConfigError(
                    f"param_groups[{index}] holds a tensor of shape {tuple(param.shape)} that is "
                    "not a trainable parameter of the model"
                )
            if id(param) in seen:
                raise ParallelConfigError(
                    f"parameter {names[param]!r} appears in more than one of param_groups"
                )
            seen.add(id(param))
        result.append({**group, "params": params})
    missing = [names[p] for p in trainable if id(p) not in seen]
    if missing:
        raise ParallelConfigError(f"param_groups miss trainable parameters {missing[:8]}")
    return result
