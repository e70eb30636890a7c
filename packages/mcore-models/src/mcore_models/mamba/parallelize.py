"""Tensor and pipeline parallelism of hybrid Mamba models (applied to a plain HybridModel).

Tensor parallelism splits every mixer by heads. A Mamba layer keeps on rank ``r`` of ``tp``
the heads ``[r H/tp, (r+1) H/tp)`` and the groups ``[r G/tp, (r+1) G/tp)``: the matching rows
of each segment of ``in_proj`` (``z``, ``x``, ``B``, ``C``, ``dt``), of the convolution and of
the per-head parameters, and the matching input columns of ``out_proj``, whose output is
all-reduced; the gated RMSNorm normalises per group, so it needs no communication. Attention
and MLP layers are split as in GPT models (column-parallel input projections, row-parallel
output projections) and MoE layers by :func:`mcore_models.moe.parallelize.parallelize_moe`.
The embedding, norms and output layer stay replicated.

Pipeline parallelism hands each stage a contiguous range of layers (``stage_layer_ranges``):
the first holds the embedding, the last the final norm and output layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mcore_models.errors import ModelConfigError
from mcore_models.gpt.layer import Attention
from mcore_models.gpt.mlp import SwiGLUMLP
from mcore_models.gpt.parallelize import TensorParallelMapping, _column, _row
from mcore_models.mamba.layers import HybridLayer, SquaredReLUMLP
from mcore_models.mamba.mixer import Mamba2Mixer
from mcore_models.mamba.model import HybridModel
from mcore_models.moe.layer import MoELayer
from mcore_models.moe.parallelize import parallelize_moe
from mcore_parallel.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)

if TYPE_CHECKING:
    from mcore_models.parallelize import PipelineLayout
    from mcore_parallel.state import ParallelState

__all__ = ["mamba_shard_rows", "parallelize_hybrid", "split_hybrid_stages"]


def mamba_shard_rows(
    config_heads: int, head_dim: int, groups: int, state_size: int, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """Indices of the rows rank ``rank`` keeps of each Mamba tensor.

    Args:
        config_heads: SSM heads of the whole layer.
        head_dim: Channels per head.
        groups: B/C groups of the whole layer.
        state_size: State size.
        tp: Tensor-parallel size.
        rank: Tensor-parallel rank.

    Returns:
        ``{"in_proj", "conv", "heads", "inner"}`` -> int64 row indices.
    """
    inner = config_heads * head_dim
    bc = groups * state_size
    heads = torch.arange(config_heads).chunk(tp)[rank]
    inner_rows = torch.arange(inner).chunk(tp)[rank]
    group_rows = torch.arange(bc).chunk(tp)[rank]
    conv = torch.cat([inner_rows, inner + group_rows, inner + bc + group_rows])
    in_proj = torch.cat([inner_rows, inner + conv, 2 * inner + 2 * bc + heads])
    return {"in_proj": in_proj, "conv": conv, "heads": heads, "inner": inner_rows}


def _take(param: torch.Tensor, rows: torch.Tensor, dim: int = 0) -> nn.Parameter:
    return nn.Parameter(param.detach().index_select(dim, rows.to(param.device)).clone())


def _shard_mamba(mixer: Mamba2Mixer, state: ParallelState) -> None:
    tp, rank = state.tp_size, state.tp_rank
    rows = mamba_shard_rows(
        mixer.num_heads, mixer.head_dim, mixer.num_groups, mixer.state_size, tp, rank
    )
    in_proj = nn.Linear(
        mixer.in_proj.in_features,
        len(rows["in_proj"]),
        bias=mixer.in_proj.bias is not None,
        device="meta",
    )
    in_proj.weight = _take(mixer.in_proj.weight, rows["in_proj"])
    if mixer.in_proj.bias is not None:
        in_proj.bias = _take(mixer.in_proj.bias, rows["in_proj"])
    mixer.in_proj = in_proj
    mixer.conv_weight = _take(mixer.conv_weight, rows["conv"])
    if mixer.conv_bias is not None:
        mixer.conv_bias = _take(mixer.conv_bias, rows["conv"])
    for name in ("dt_bias", "A_log", "D"):
        setattr(mixer, name, _take(getattr(mixer, name), rows["heads"]))
    mixer.norm.weight = _take(mixer.norm.weight, rows["inner"])
    out_proj = nn.Linear(len(rows["inner"]), mixer.out_proj.out_features, bias=False, device="meta")
    out_proj.weight = _take(mixer.out_proj.weight, rows["inner"], dim=1)
    mixer.out_proj = out_proj
    mixer.num_heads //= tp
    mixer.num_groups //= tp
    mixer.norm.groups //= tp
    mixer.input_copy = TensorParallelMapping(copy_to_tensor_parallel_region, state.tp_group)
    mixer.output_reduce = TensorParallelMapping(reduce_from_tensor_parallel_region, state.tp_group)


def _check(model: HybridModel, tp: int) -> None:
    config = model.config
    sizes = {
        "mamba_num_heads": config.mamba_num_heads,
        "mamba_num_groups": config.mamba_num_groups,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_kv_heads,
        "ffn_hidden_size": config.ffn_hidden_size,
    }
    for name, value in sizes.items():
        if value % tp:
            raise ModelConfigError(f"{name}={value} must be divisible by tp={tp}")
    if config.mamba_proj_bias and "M" in config.layer_pattern:
        raise ModelConfigError(
            "mamba_proj_bias=True: out_proj's bias would be added on every TP rank"
        )


def parallelize_hybrid(model: HybridModel, state: ParallelState) -> HybridModel:
    """Shard a whole (or stage) hybrid model over ``state``'s tensor-parallel group, in place.

    Args:
        model: A materialised, unsharded model or pipeline stage.
        state: Parallel state.

    Returns:
        ``model``.

    Raises:
        ModelConfigError: If a size is not divisible by the TP size, a Mamba layer has
            projection biases, or the model is already parallelized.
    """
    tp = state.tp_size
    if model.tp_group is not None:
        raise ModelConfigError("model is already parallelized; parallelize a whole model")
    if tp == 1:
        return model
    _check(model, tp)
    for layer in model.layers:
        assert isinstance(layer, HybridLayer)
        mixer = layer.mixer
        if isinstance(mixer, Mamba2Mixer):
            _shard_mamba(mixer, state)
        elif isinstance(mixer, Attention):
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(mixer, name, _column(getattr(mixer, name), state, False))
            mixer.o_proj = _row(mixer.o_proj, state, False)  # type: ignore[assignment]
            mixer.num_heads //= tp
            mixer.num_kv_heads //= tp
        elif isinstance(mixer, SwiGLUMLP):
            mixer.gate_proj = _column(mixer.gate_proj, state, False)  # type: ignore[assignment]
            mixer.up_proj = _column(mixer.up_proj, state, False)  # type: ignore[assignment]
            mixer.down_proj = _row(mixer.down_proj, state, False)  # type: ignore[assignment]
        elif isinstance(mixer, SquaredReLUMLP):
            mixer.up_proj = _column(mixer.up_proj, state, False)  # type: ignore[assignment]
            mixer.down_proj = _row(mixer.down_proj, state, False)  # type: ignore[assignment]
        elif isinstance(mixer, MoELayer):
            parallelize_moe(mixer, state, sequence_parallel=False)
    model.tp_group = state.tp_group
    return model


def split_hybrid_stages(
    model: HybridModel, state: ParallelState, layout: PipelineLayout
) -> list[HybridModel]:
    """This rank's pipeline chunks of a whole hybrid model, made of its modules
    (:func:`mcore_models.parallelize.split_stages` of a hybrid model).

    Args:
        model: A whole, materialised model.
        state: Parallel state.
        layout: Virtual stages and layers per stage.

    Returns:
        One chunk per virtual stage, first first.

    Raises:
        ModelConfigError: If the model is already a stage or the layout does not fit.
    """
    from mcore_models.parallelize import split_stages

    return split_stages(model, state, layout)
