"""Hugging Face interop of MoE models: Mixtral, Qwen2-MoE, Qwen3-MoE and dots.llm1.

Checkpoints store one tensor per expert and projection (``experts.{e}.w1.weight`` in
Mixtral, ``experts.{e}.gate_proj.weight`` in the others); :class:`~mcore_models.moe.MoELayer`
holds the gate and up projections of all experts as one ``[E, 2, ffn, hidden]`` tensor and the
down projections as one ``[E, hidden, ffn]`` tensor. dots.llm1 (``dots1``) routes like
DeepSeek-V3: sigmoid scores, an expert score-correction bias used for the choice only,
group-limited top-k and a routed scaling factor, with Qwen3's attention (QK-norm, full
rotary). This module translates configs and tensor names in both directions;
:mod:`mcore_models.gpt.hf` calls it for MoE model types, and :func:`moe_hf_pieces` tells the
sharded loader which checkpoint tensors compose each global MoE tensor.
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
    "dots1": "Dots1ForCausalLM",
}
"""Hugging Face MoE ``model_type`` -> architecture class name."""

_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
)
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight")
_BIAS = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias")
_SHARED = re.compile(
    r"model\.layers\.(\d+)\.mlp\.(shared_experts?)\.(gate_proj|up_proj|down_proj)\.weight"
)
_SHARED_GATE = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight")
_SLOT = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}


def _dots1_fields(hf: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    if hf.get("attention_bias", False):
        raise CheckpointFormatError(
            "attention_bias=True is not supported for dots1 (its o_proj has a bias too); "
            "expected False"
        )
    layer_types = hf.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise CheckpointFormatError(
            f"layer_types={layer_types!r}: sliding-window layers are not supported; expected "
            "every layer 'full_attention'"
        )
    ffn = int(hf["moe_intermediate_size"])
    moe = MoEConfig(
        **common,
        expert_ffn_hidden_size=ffn,
        shared_expert_ffn_hidden_size=ffn * int(hf.get("n_shared_experts") or 0),
        router_score="sigmoid",
        router_expert_bias=True,
        normalize_top_k=bool(hf.get("norm_topk_prob", False)),
        router_num_groups=int(hf.get("n_group") or 1),
        router_group_top_k=int(hf.get("topk_group") or 1),
        router_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        dense_layers=tuple(range(int(hf.get("first_k_dense_replace") or 0))),
    )
    return dict(moe=moe, add_qkv_bias=False, qk_layernorm=True)


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
    num_experts = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
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
    if model_type == "dots1":
        return _dots1_fields(hf, common)
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


def _moe_model_type(config: GPTConfig) -> str:
    moe = config.moe
    assert moe is not None
    if moe.router_score == "sigmoid":
        return "dots1"
    if config.qk_layernorm:
        return "qwen3_moe"
    if moe.shared_expert_ffn_hidden_size > 0:
        return "qwen2_moe"
    return "mixtral"


def _dots1_to_hf(config: GPTConfig, hf: dict[str, Any], ffn: int) -> dict[str, Any]:
    moe = config.moe
    assert moe is not None
    first_dense = len(moe.dense_layers)
    problems = []
    if not moe.router_expert_bias:
        problems.append("router_expert_bias=True")
    if not config.qk_layernorm or config.add_qkv_bias:
        problems.append("qk_layernorm=True and add_qkv_bias=False")
    if moe.shared_expert_ffn_hidden_size == 0 or moe.shared_expert_ffn_hidden_size % ffn:
        problems.append("a shared expert whose width is a multiple of the expert width")
    if moe.shared_expert_gate:
        problems.append("shared_expert_gate=False")
    if moe.layer_step != 1 or moe.dense_layers != tuple(range(first_dense)):
        problems.append("dense layers only as a prefix (layer_step=1)")
    if problems:
        raise CheckpointFormatError(
            f"router_score='sigmoid' exports as dots1, which needs {', '.join(problems)}; got "
            f"router_expert_bias={moe.router_expert_bias}, qk_layernorm={config.qk_layernorm}, "
            f"add_qkv_bias={config.add_qkv_bias}, shared_expert_ffn_hidden_size="
            f"{moe.shared_expert_ffn_hidden_size}, shared_expert_gate={moe.shared_expert_gate}, "
            f"dense_layers={moe.dense_layers}, layer_step={moe.layer_step}"
        )
    hf.pop("use_sliding_window", None)
    hf.update(
        n_routed_experts=moe.num_experts,
        moe_intermediate_size=ffn,
        n_shared_experts=moe.shared_expert_ffn_hidden_size // ffn,
        norm_topk_prob=moe.normalize_top_k,
        n_group=moe.router_num_groups,
        topk_group=moe.router_group_top_k,
        routed_scaling_factor=moe.router_scaling_factor,
        first_k_dense_replace=first_dense,
        sliding_window=None,
        layer_types=["full_attention"] * config.num_layers,
    )
    return hf


def moe_config_to_hf(config: GPTConfig, hf: dict[str, Any]) -> dict[str, Any]:
    """Turn the dense ``config.json`` dictionary of a MoE GPTConfig into its MoE family's.

    The family is dots1 with a sigmoid router, Qwen3-MoE with QK-norm, Qwen2-MoE with a
    shared expert, Mixtral otherwise.

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
    model_type = _moe_model_type(config)
    for key in ("mlp_bias", "use_sliding_window"):
        hf.pop(key, None)
    hf.update(
        architectures=[MOE_MODEL_TYPES[model_type]],
        model_type=model_type,
        num_experts_per_tok=moe.top_k,
        output_router_logits=False,
        router_aux_loss_coef=moe.aux_loss_coeff,
    )
    if model_type == "dots1":
        return _dots1_to_hf(config, hf, ffn)
    grouped = (moe.router_num_groups, moe.router_group_top_k, moe.router_scaling_factor)
    if moe.router_expert_bias or grouped != (1, 1, 1.0):
        raise CheckpointFormatError(
            f"router_expert_bias={moe.router_expert_bias}, router_num_groups="
            f"{moe.router_num_groups}, router_group_top_k={moe.router_group_top_k}, "
            f"router_scaling_factor={moe.router_scaling_factor}: {model_type} checkpoints need a "
            "plain softmax top-k router (no expert bias, one group, scaling 1)"
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


def _block(model_type: str, layer: str) -> str:
    """Checkpoint prefix of the MoE block of a layer."""
    return f"model.layers.{layer}.{'block_sparse_moe' if model_type == 'mixtral' else 'mlp'}"


def _expert_names(model_type: str) -> dict[str, str]:
    """mcore projection -> checkpoint projection name of one expert."""
    if model_type == "mixtral":
        return {v: k for k, v in _MIXTRAL_PROJECTIONS.items()}
    return {name: name for name in _MIXTRAL_PROJECTIONS.values()}


def _shared_name(model_type: str) -> str:
    return "shared_experts" if model_type in ("dots1", "deepseek_v3") else "shared_expert"


_MCORE_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_MCORE_ROUTER = re.compile(r"layers\.(\d+)\.mlp\.router\.(weight|expert_bias)")
_MCORE_SHARED = re.compile(
    r"layers\.(\d+)\.mlp\.(?:shared_expert\.(gate_proj|up_proj|down_proj)|"
    r"(shared_expert_gate))\.weight"
)


def moe_hf_pieces(
    name: str, global_shape: tuple[int, ...], config: GPTConfig, model_type: str
) -> list[HFPiece] | None:
    """The checkpoint tensors composing one global MoE tensor, for sharded loading.

    Args:
        name: Canonical name (in the unsharded, unpipelined model), e.g.
            ``"layers.3.mlp.experts.gate_up_proj"``.
        global_shape: Shape of the global tensor.
        config: Model config.
        model_type: Hugging Face ``model_type`` of the checkpoint.

    Returns:
        The pieces (one per expert and projection for expert weights), or None if ``name`` is
        not a MoE tensor.
    """
    del config  # The names and shapes say everything; kept for the loader's uniform call.
    match = _MCORE_EXPERTS.fullmatch(name)
    if match:
        layer, projection = match.groups()
        block = _block(model_type, layer)
        names = _expert_names(model_type)
        whole = [slice(0, size) for size in global_shape]
        if projection == "down_proj":
            return [
                HFPiece(f"{block}.experts.{e}.{names['down_proj']}.weight", (e, *whole[1:]))
                for e in range(global_shape[0])
            ]
        return [
            HFPiece(f"{block}.experts.{e}.{names[part]}.weight", (e, index, *whole[2:]))
            for e in range(global_shape[0])
            for index, part in enumerate(("gate_proj", "up_proj"))
        ]
    match = _MCORE_ROUTER.fullmatch(name)
    if match:
        layer, kind = match.groups()
        hf_kind = "weight" if kind == "weight" else "e_score_correction_bias"
        region = tuple(slice(0, size) for size in global_shape)
        return [HFPiece(f"{_block(model_type, layer)}.gate.{hf_kind}", region)]
    match = _MCORE_SHARED.fullmatch(name)
    if match:
        layer, projection, gate = match.groups()
        part = "shared_expert_gate" if gate else f"{_shared_name(model_type)}.{projection}"
        region = tuple(slice(0, size) for size in global_shape)
        return [HFPiece(f"model.layers.{layer}.mlp.{part}.weight", region)]
    return None


class ExpertLoader:
    """Loads the MoE tensors of a Hugging Face checkpoint into a whole (unsharded) model.

    Args:
        params: ``dict(model.named_parameters())``.
        buffers: ``dict(model.named_buffers())`` (the routers' expert biases).
    """

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self._params: dict[str, torch.Tensor] = {**(buffers or {}), **params}
        self._slices: dict[str, set[tuple[int, int | None]]] = {}
        self.loaded: set[str] = set()
        """Names of fully loaded parameters and buffers."""

    @staticmethod
    def target(name: str) -> tuple[str, tuple[int, int | None] | None] | None:
        """Where a checkpoint tensor goes.

        Args:
            name: Hugging Face tensor name.

        Returns:
            ``(parameter name, (expert, gate/up index or None) or None)``, or None if it is
            not a MoE tensor.
        """
        match = _EXPERT.fullmatch(name)
        if match:
            layer, expert, projection = match.groups()
            target, index = _SLOT[_MIXTRAL_PROJECTIONS.get(projection, projection)]
            return f"layers.{layer}.mlp.experts.{target}", (int(expert), index)
        match = _ROUTER.fullmatch(name)
        if match:
            return f"layers.{match.group(1)}.mlp.router.weight", None
        match = _BIAS.fullmatch(name)
        if match:
            return f"layers.{match.group(1)}.mlp.router.expert_bias", None
        match = _SHARED.fullmatch(name)
        if match:
            return f"layers.{match.group(1)}.mlp.shared_expert.{match.group(3)}.weight", None
        match = _SHARED_GATE.fullmatch(name)
        if match:
            return f"layers.{match.group(1)}.mlp.shared_expert_gate.weight", None
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
        target, slot = where
        if target not in self._params:
            raise CheckpointFormatError(
                f"tensor {name!r} of the checkpoint has no place in the model (expected "
                f"{target!r} to exist)"
            )
        param = self._params[target]
        if slot is not None and slot[0] >= param.shape[0]:
            raise CheckpointFormatError(
                f"tensor {name!r} is for expert {slot[0]}; the model has {param.shape[0]} experts"
            )
        destination = param
        if slot is not None:
            destination = param[slot[0]] if slot[1] is None else param[slot[0], slot[1]]
        tensor = read(name)
        if tuple(tensor.shape) != tuple(destination.shape):
            raise CheckpointFormatError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}; the model expects "
                f"{tuple(destination.shape)} for {target!r}"
            )
        with torch.no_grad():
            destination.copy_(tensor)
        if slot is None:
            self.loaded.add(target)
            return True
        self._slices.setdefault(target, set()).add(slot)
        parts = 2 if target.endswith("gate_up_proj") else 1
        if len(self._slices[target]) == param.shape[0] * parts:
            self.loaded.add(target)
        return True

    def check_experts_complete(self) -> None:
        """Raise if some but not all experts of a projection were in the checkpoint.

        Raises:
            CheckpointFormatError: Naming the first missing expert tensor.
        """
        for target, slots in sorted(self._slices.items()):
            parts = (0, 1) if target.endswith("gate_up_proj") else (None,)
            expected = {(e, p) for e in range(self._params[target].shape[0]) for p in parts}
            missing = sorted(expected - slots, key=lambda slot: (slot[0], slot[1] or 0))
            if missing:
                expert, part = missing[0]
                projection = {0: "gate_proj", 1: "up_proj", None: "down_proj"}[part]
                raise CheckpointFormatError(
                    f"expert {expert} of {target!r} ({projection}) is missing from the "
                    f"checkpoint ({len(missing)} expert tensors missing)"
                )


def moe_tensors_to_hf(
    state_dict: dict[str, torch.Tensor], config: GPTConfig, model_type: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split off the MoE tensors of a state dict and name them as ``model_type`` does.

    Args:
        state_dict: Whole (unsharded) state dict of a GPTModel with MoE layers.
        config: Its config.
        model_type: "mixtral", "qwen2_moe", "qwen3_moe" or "dots1".

    Returns:
        ``(hf_tensors, rest)``: the MoE tensors under Hugging Face names (one per expert and
        projection) and the remaining tensors under their GPTModel names.

    Raises:
        CheckpointFormatError: If the experts are split over expert parallelism.
    """
    assert config.moe is not None
    names = _expert_names(model_type)
    hf: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        expert = _MCORE_EXPERTS.fullmatch(name)
        router = _MCORE_ROUTER.fullmatch(name)
        shared = _MCORE_SHARED.fullmatch(name)
        if expert:
            layer, projection = expert.groups()
            if tensor.shape[0] != config.moe.num_experts:
                raise CheckpointFormatError(
                    f"{name!r} holds {tensor.shape[0]} of {config.moe.num_experts} experts; "
                    "export needs every expert (gather the expert-parallel shards first)"
                )
            prefix = f"{_block(model_type, layer)}.experts"
            for index, weight in enumerate(tensor.unbind(0)):
                if projection == "down_proj":
                    hf[f"{prefix}.{index}.{names['down_proj']}.weight"] = weight
                else:
                    hf[f"{prefix}.{index}.{names['gate_proj']}.weight"] = weight[0]
                    hf[f"{prefix}.{index}.{names['up_proj']}.weight"] = weight[1]
        elif router or shared:
            pieces = moe_hf_pieces(name, tuple(tensor.shape), config, model_type)
            assert pieces is not None
            hf[pieces[0].hf_name] = tensor
        else:
            rest[name] = tensor
    return hf, rest
