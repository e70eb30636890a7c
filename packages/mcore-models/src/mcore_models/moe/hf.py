"""Hugging Face interop of MoE models: Mixtral, Qwen2-MoE and Qwen3-MoE.

Checkpoints store one tensor per expert and projection (``experts.{e}.w1.weight`` in
Mixtral, ``experts.{e}.gate_proj.weight`` in Qwen); :class:`~mcore_models.moe.MoELayer` holds
each projection of all experts as one 3-D tensor. This module translates configs and tensor
names in both directions; :mod:`mcore_models.gpt.hf` calls it for MoE model types.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from mcore_models.errors import CheckpointFormatError
from mcore_models.gpt.config import GPTConfig
from mcore_models.hf_io import HFPiece
from mcore_models.moe.config import MoEConfig

__all__ = [
    "MOE_MODEL_TYPES",
    "ExpertLoader",
    "moe_config_to_hf",
    "moe_fields_from_hf",
    "moe_hf_pieces",
    "moe_tensors_to_hf",
]

MOE_MODEL_TYPES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""Hugging Face MoE ``model_type`` -> architecture class name."""

_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
)
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight")
_SHARED = re.compile(
    r"model\.layers\.(\d+)\.mlp\.(shared_expert\.(?:gate_proj|up_proj|down_proj)|"
    r"shared_expert_gate)\.weight"
)


def moe_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig fields of a Hugging Face MoE ``config.json`` (on top of the dense ones).

    Args:
        hf: Parsed ``config.json`` with a ``model_type`` in :data:`MOE_MODEL_TYPES`.

    Returns:
        Fields including ``moe``; ``ffn_hidden_size`` is the width of dense layers.

    Raises:
        CheckpointFormatError: If the config uses an unsupported option.
    """
    model_type = hf["model_type"]
    num_experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not num_experts:
        raise CheckpointFormatError(f"model_type={model_type!r} config has no expert count")
    common: dict[str, Any] = dict(
        num_experts=int(num_experts), top_k=int(hf["num_experts_per_tok"])
    )
    if model_type == "mixtral":
        if hf.get("sliding_window") is not None:
            raise CheckpointFormatError(
                f"sliding_window={hf['sliding_window']!r} is not supported; expected None"
            )
        moe = MoEConfig(**common, expert_ffn_hidden_size=int(hf["intermediate_size"]))
        return dict(moe=moe, add_qkv_bias=False, qk_layernorm=False)
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    moe = MoEConfig(
        **common,
        expert_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        shared_expert_ffn_hidden_size=shared,
        shared_expert_gate=shared > 0,
        normalize_top_k=bool(hf.get("norm_topk_prob", False)),
        layer_step=int(hf.get("decoder_sparse_step", 1)),
        dense_layers=tuple(hf.get("mlp_only_layers") or ()),
    )
    if model_type == "qwen2_moe":
        return dict(moe=moe, add_qkv_bias=bool(hf.get("qkv_bias", True)), qk_layernorm=False)
    return dict(moe=moe, add_qkv_bias=bool(hf.get("attention_bias", False)), qk_layernorm=True)


def moe_config_to_hf(config: GPTConfig, hf: dict[str, Any]) -> dict[str, Any]:
    """Turn the dense ``config.json`` dictionary of a MoE GPTConfig into its MoE family's.

    The family is Qwen3-MoE with QK-norm, Qwen2-MoE with a shared expert, Mixtral otherwise.

    Args:
        config: The config (``config.moe`` set).
        hf: Dictionary built for the dense part by ``config_to_hf``.

    Returns:
        The updated dictionary.

    Raises:
        CheckpointFormatError: If the MoE options have no counterpart in that family.
    """
    moe = config.moe
    assert moe is not None
    ffn = moe.expert_ffn_hidden_size or config.ffn_hidden_size
    if moe.router_score != "softmax" or moe.router_expert_bias:
        raise CheckpointFormatError(
            f"router_score={moe.router_score!r}, router_expert_bias={moe.router_expert_bias}: "
            "Mixtral/Qwen MoE checkpoints need a softmax router without expert bias"
        )
    if config.qk_layernorm:
        model_type = "qwen3_moe"
    elif moe.shared_expert_ffn_hidden_size > 0:
        model_type = "qwen2_moe"
    else:
        model_type = "mixtral"
    for key in ("mlp_bias", "use_sliding_window"):
        hf.pop(key, None)
    hf.update(
        architectures=[MOE_MODEL_TYPES[model_type]],
        model_type=model_type,
        num_experts_per_tok=moe.top_k,
        output_router_logits=False,
        router_aux_loss_coef=moe.aux_loss_coeff,
    )
    if model_type == "mixtral":
        if not moe.normalize_top_k or moe.dense_layers or moe.layer_step != 1:
            raise CheckpointFormatError(
                "a Mixtral checkpoint needs normalize_top_k=True and every layer MoE; got "
                f"normalize_top_k={moe.normalize_top_k}, dense_layers={moe.dense_layers}, "
                f"layer_step={moe.layer_step}"
            )
        if config.add_qkv_bias:
            raise CheckpointFormatError("add_qkv_bias=True has no Mixtral counterpart")
        hf.update(num_local_experts=moe.num_experts, intermediate_size=ffn, sliding_window=None)
        return hf
    if model_type == "qwen2_moe" and not moe.shared_expert_gate:
        raise CheckpointFormatError(
            "shared_expert_gate=False: Qwen2-MoE gates its shared expert; expected True"
        )
    if model_type == "qwen3_moe" and moe.shared_expert_ffn_hidden_size:
        raise CheckpointFormatError(
            "Qwen3-MoE has no shared expert; expected shared_expert_ffn_hidden_size=0, got "
            f"{moe.shared_expert_ffn_hidden_size}"
        )
    hf.update(
        num_experts=moe.num_experts,
        moe_intermediate_size=ffn,
        norm_topk_prob=moe.normalize_top_k,
        decoder_sparse_step=moe.layer_step,
        mlp_only_layers=list(moe.dense_layers),
        use_sliding_window=False,
    )
    if model_type == "qwen2_moe":
        hf.update(
            shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
            qkv_bias=config.add_qkv_bias,
        )
    return hf


class ExpertLoader:
    """Loads the MoE tensors of a Hugging Face checkpoint into a whole (unsharded) model.

    Args:
        params: ``dict(model.named_parameters())``.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        self._params = params
        self._slices: dict[str, set[int]] = {}
        self.loaded: set[str] = set()
        """Names of fully loaded parameters."""

    @staticmethod
    def target(name: str) -> tuple[str, int | None] | None:
        """Where a checkpoint tensor goes.

        Args:
            name: Hugging Face tensor name.

        Returns:
            ``(parameter name, expert index or None)``, or None if it is not a MoE tensor.
        """
        match = _EXPERT.fullmatch(name)
        if match:
            layer, expert, projection = match.groups()
            projection = _MIXTRAL_PROJECTIONS.get(projection, projection)
            return f"layers.{layer}.mlp.experts.{projection}", int(expert)
        match = _ROUTER.fullmatch(name)
        if match:
            return f"layers.{match.group(1)}.mlp.router.weight", None
        match = _SHARED.fullmatch(name)
        if match:
            return f"layers.{match.group(1)}.mlp.{match.group(2)}.weight", None
        return None

    def load(self, name: str, read: Callable[[str], torch.Tensor]) -> bool:
        """Copy one checkpoint tensor into its place if it is a MoE tensor.

        Args:
            name: Hugging Face tensor name.
            read: Returns the tensor of a name (called only for MoE tensors).

        Returns:
            Whether the tensor was a MoE tensor (and was loaded).

        Raises:
            CheckpointFormatError: If the model has no such parameter or expert, or a shape
                does not match.
        """
        where = self.target(name)
        if where is None:
            return False
        target, expert = where
        if target not in self._params:
            raise CheckpointFormatError(
                f"tensor {name!r} of the checkpoint has no place in the model (expected "
                f"{target!r} to exist)"
            )
        param = self._params[target]
        if expert is not None and expert >= param.shape[0]:
            raise CheckpointFormatError(
                f"tensor {name!r} is for expert {expert}; the model has {param.shape[0]} experts"
            )
        destination = param if expert is None else param[expert]
        tensor = read(name)
        if tuple(tensor.shape) != tuple(destination.shape):
            raise CheckpointFormatError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}; the model expects "
                f"{tuple(destination.shape)} for {target!r}"
            )
        with torch.no_grad():
            destination.copy_(tensor)
        if expert is None:
            self.loaded.add(target)
        else:
            self._slices.setdefault(target, set()).add(expert)
            if len(self._slices[target]) == param.shape[0]:
                self.loaded.add(target)
        return True

    def check_experts_complete(self) -> None:
        """Raise if some but not all experts of a projection were in the checkpoint.

        Raises:
            CheckpointFormatError: Naming the first missing expert tensor.
        """
        for target, experts in sorted(self._slices.items()):
            missing = sorted(set(range(self._params[target].shape[0])) - experts)
            if missing:
                raise CheckpointFormatError(
                    f"expert {missing[0]} of {target!r} is missing from the checkpoint "
                    f"({len(missing)} experts missing)"
                )


def moe_tensors_to_hf(
    state_dict: dict[str, torch.Tensor], config: GPTConfig, model_type: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split off the MoE tensors of a state dict and name them as ``model_type`` does.

    Args:
        state_dict: Whole (unsharded) state dict of a GPTModel with MoE layers.
        config: Its config.
        model_type: "mixtral", "qwen2_moe" or "qwen3_moe".

    Returns:
        ``(hf_tensors, rest)``: the MoE tensors under Hugging Face names (one per expert and
        projection) and the remaining tensors under their GPTModel names.

    Raises:
        CheckpointFormatError: If the experts are split over expert parallelism.
    """
    assert config.moe is not None
    block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    projections = {v: k for k, v in _MIXTRAL_PROJECTIONS.items()} if model_type == "mixtral" else {}
    hf: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        expert = re.fullmatch(r"layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)", name)
        router = re.fullmatch(r"layers\.(\d+)\.mlp\.router\.weight", name)
        shared = re.fullmatch(
            r"layers\.(\d+)\.mlp\.(shared_expert\..+|shared_expert_gate\..+)", name
        )
        if expert:
            layer, projection = expert.groups()
            if tensor.shape[0] != config.moe.num_experts:
                raise CheckpointFormatError(
                    f"{name!r} holds {tensor.shape[0]} of {config.moe.num_experts} experts; "
                    "export needs every expert (build or load the model without expert "
                    "parallelism)"
                )
            for index, weight in enumerate(tensor.unbind(0)):
                hf_projection = projections.get(projection, projection)
                hf[f"model.layers.{layer}.{block}.experts.{index}.{hf_projection}.weight"] = weight
        elif router:
            hf[f"model.layers.{router.group(1)}.{block}.gate.weight"] = tensor
        elif shared:
            hf[f"model.layers.{shared.group(1)}.mlp.{shared.group(2)}"] = tensor
        else:
            rest[name] = tensor
    return hf, rest


def moe_hf_pieces(
    name: str, global_shape: tuple[int, ...], config: GPTConfig, model_type: str
) -> list[HFPiece] | None:
    """The checkpoint tensors composing a global MoE tensor (see :mod:`mcore_models.hf_io`).

    Args:
        name: Canonical mcore name (e.g. ``"layers.1.mlp.experts.gate_proj"``).
        global_shape: Shape of the global tensor.
        config: Model config.
        model_type: Hugging Face ``model_type`` of the checkpoint.

    Returns:
        One piece per expert for expert weights, one for the router and shared expert, or
        None if ``name`` is not a MoE tensor.
    """
    block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    projections = {v: k for k, v in _MIXTRAL_PROJECTIONS.items()} if model_type == "mixtral" else {}
    whole = tuple(slice(0, n) for n in global_shape)
    expert = re.fullmatch(r"layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)", name)
    if expert:
        layer, projection = expert.groups()
        hf_projection = projections.get(projection, projection)
        return [
            HFPiece(
                f"model.layers.{layer}.{block}.experts.{index}.{hf_projection}.weight",
                (
                    index,
                    *whole[1:],
                ),
            )
            for index in range(global_shape[0])
        ]
    router = re.fullmatch(r"layers\.(\d+)\.mlp\.router\.weight", name)
    if router:
        return [HFPiece(f"model.layers.{router.group(1)}.{block}.gate.weight", whole)]
    shared = re.fullmatch(r"layers\.(\d+)\.mlp\.(shared_expert\..+|shared_expert_gate\..+)", name)
    if shared:
        return [HFPiece(f"model.layers.{shared.group(1)}.mlp.{shared.group(2)}", whole)]
    return None
