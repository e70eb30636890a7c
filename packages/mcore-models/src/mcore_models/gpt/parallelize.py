"""Tensor and sequence parallelism for GPTModel, applied from mcore-parallel's layers.

``parallelize(model, state)`` replaces, in place, every projection of a whole (unsharded)
model by its mcore-parallel counterpart holding this rank's shard, after torchtitan's
``parallelize_llama`` (github.com/pytorch/torchtitan). Query, key and value projections and the
MLP gate/up projections are split by output features (whole heads per rank), the attention
output and MLP down projections by input features, the embedding and output layer by
vocabulary. Because the shards are cut from the whole weights, a model built or loaded whole
and then parallelized computes what the unsharded model computes, at any TP size.

:class:`~mcore_models.GPTModel` calls ``parallelize`` itself when given a state with
``tp_size > 1``, as does :meth:`~mcore_models.GPTModel.from_hf`.

With ``config.sequence_parallel`` activations between the projections are split along the
sequence (dimension 1) over the TP ranks. Replicated weights that then see only part of the
tokens (RMSNorm weights), and the per-head QK-norm weights under TP, are marked
``param.sequence_parallel = True``: after backward call
``mcore_parallel.tensor_parallel.layers.allreduce_sequence_parallel_grads(model, state)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from mcore_models.errors import ModelConfigError
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.layer import DecoderLayer
from mcore_models.gpt.mlp import SwiGLUMLP
from mcore_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mcore_parallel.sharding import get_partition_dims
from mcore_parallel.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
)

if TYPE_CHECKING:
    from mcore_models.gpt.model import GPTModel
    from mcore_parallel.state import ParallelState

__all__ = [
    "full_state_dict",
    "gather_sequence",
    "gather_vocab_shards",
    "parallelize",
    "vocab_parallel_logits",
]

_SEQUENCE_DIM = 1


def _check_divisible(config: GPTConfig, tp: int) -> None:
    for name, value in (
        ("num_attention_heads", config.num_attention_heads),
        ("num_query_groups", config.num_kv_heads),
        ("ffn_hidden_size", config.ffn_hidden_size),
        ("vocab_size", config.vocab_size),
    ):
        if value % tp:
            raise ModelConfigError(
                f"{name}={value} must be divisible by the tensor-parallel size tp={tp}"
            )


def _copy_of(weight: torch.Tensor):
    def init(master: torch.Tensor) -> torch.Tensor:
        return master.copy_(weight.detach().to(master.dtype))

    return init


def _column(
    linear: nn.Linear, state: ParallelState, sequence_parallel: bool
) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        state=state,
        gather_output=False,
        sequence_parallel=sequence_parallel,
        sequence_dim=_SEQUENCE_DIM,
        init_method=_copy_of(linear.weight),
        dtype=linear.weight.dtype,
        device=linear.weight.device,
    )
    if linear.bias is not None and layer.bias is not None:
        with torch.no_grad():
            layer.bias.copy_(linear.bias.chunk(state.tp_size)[state.tp_rank])
    return layer


def _row(linear: nn.Linear, state: ParallelState, sequence_parallel: bool) -> RowParallelLinear:
    if linear.bias is not None:
        raise ModelConfigError(
            f"row-parallel projection {linear} has a bias; expected bias-free output projections"
        )
    return RowParallelLinear(
        linear.in_features,
        linear.out_features,
        bias=False,
        state=state,
        input_is_parallel=True,
        sequence_parallel=sequence_parallel,
        sequence_dim=_SEQUENCE_DIM,
        init_method=_copy_of(linear.weight),
        dtype=linear.weight.dtype,
        device=linear.weight.device,
    )


def _mark_partial_gradient(param: torch.Tensor) -> None:
    # mcore_parallel's allreduce_sequence_parallel_grads sums gradients marked like this.
    param.sequence_parallel = True  # type: ignore[attr-defined]


def parallelize(model_or_config: GPTModel | GPTConfig, state: ParallelState) -> GPTModel:
    """Shard a whole model over the tensor-parallel group of ``state`` (in place).

    Args:
        model_or_config: An unsharded :class:`~mcore_models.GPTModel`, or a config from which
            one is built (from ``config.seed``) first.
        state: Parallel state; with ``tp_size == 1`` only mixture-of-experts layers change
            (their experts are split over the expert-parallel group).

    Returns:
        The same model object, now holding this rank's shards.

    MLP blocks other than :class:`~mcore_models.gpt.mlp.SwiGLUMLP` are sharded by calling
    their own ``parallelize(state)`` method (reading ``config.sequence_parallel`` themselves).

    Raises:
        ModelConfigError: If heads, query groups, FFN size or vocabulary are not divisible by
            the TP size, the model is already parallelized, or an MLP type cannot be sharded.
    """
    from mcore_models.gpt.model import GPTModel

    model = model_or_config if isinstance(model_or_config, GPTModel) else GPTModel(model_or_config)
    tp = state.tp_size
    if tp == 1:
        model.state = state
        # Only mixture-of-experts layers have something to shard (experts over ep / etp).
        from mcore_models.moe.layer import MoELayer
        from mcore_models.moe.parallelize import parallelize_moe

        for layer in model.layers:
            if isinstance(layer.mlp, MoELayer):
                parallelize_moe(layer.mlp, state, sequence_parallel=False)
        return model
    if model.tp_group is not None:
        raise ModelConfigError("model is already parallelized; parallelize a whole model")
    config = model.config
    _check_divisible(config, tp)
    # Every check runs before the first layer is sharded, so an error leaves the model whole.
    from mcore_models.moe.layer import MoELayer
    from mcore_models.moe.parallelize import parallelize_moe

    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        mlp = layer.mlp
        if not isinstance(mlp, (SwiGLUMLP, MoELayer)):
            raise ModelConfigError(
                f"layer {layer.layer_idx} has an MLP of type {type(mlp).__name__}, which "
                "parallelize cannot shard"
            )
    model.state = state
    sp = config.sequence_parallel
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        attention = layer.self_attention
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attention, name, _column(getattr(attention, name), state, sp))
        attention.o_proj = _row(attention.o_proj, state, sp)  # type: ignore[assignment]
        attention.num_heads //= tp
        attention.num_kv_heads //= tp
        for norm in (attention.q_norm, attention.k_norm):
            if norm is not None:
                # Each rank normalises other heads with the shared weight: partial gradients.
                _mark_partial_gradient(norm.weight)
        mlp = layer.mlp
        if isinstance(mlp, SwiGLUMLP):
            mlp.gate_proj = _column(mlp.gate_proj, state, sp)  # type: ignore[assignment]
            mlp.up_proj = _column(mlp.up_proj, state, sp)  # type: ignore[assignment]
            mlp.down_proj = _row(mlp.down_proj, state, sp)  # type: ignore[assignment]
        else:
            assert isinstance(mlp, MoELayer)
            parallelize_moe(mlp, state, sequence_parallel=sp)
        if sp:
            _mark_partial_gradient(layer.input_norm.weight)
            _mark_partial_gradient(layer.post_attention_norm.weight)
    if sp:
        _mark_partial_gradient(model.final_norm.weight)
    embedding = model.embedding
    model.embedding = VocabParallelEmbedding(  # type: ignore[assignment]
        config.vocab_size,
        config.hidden_size,
        state=state,
        sequence_parallel=sp,
        sequence_dim=_SEQUENCE_DIM,
        init_method=_copy_of(embedding.weight),
        dtype=embedding.weight.dtype,
        device=embedding.weight.device,
    )
    if model.output_layer is not None:
        model.output_layer = _column(model.output_layer, state, False)  # type: ignore[assignment]
    model.tp_group = state.tp_group
    return model


def gather_sequence(hidden: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather sequence-parallel hidden states to the full sequence (gradient split back).

    Args:
        hidden: ``[B, T / tp, H]`` this rank's sequence chunk.
        group: Tensor-parallel group.

    Returns:
        ``[B, T, H]``.
    """
    return gather_from_sequence_parallel_region(
        hidden, group, sequence_dim=_SEQUENCE_DIM, tensor_parallel_output_grad=False
    )


def vocab_parallel_logits(
    hidden: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Logits of this rank's vocabulary shard from replicated hidden states.

    Args:
        hidden: ``[..., H]`` hidden states, identical on every rank.
        weight: ``[V / tp, H]`` this rank's output weight shard.
        group: Tensor-parallel group (the gradient of ``hidden`` is summed over it).

    Returns:
        ``[..., V / tp]`` logits in the dtype of ``hidden``.
    """
    return torch.nn.functional.linear(copy_to_tensor_parallel_region(hidden, group), weight)


def gather_vocab_shards(logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather vocabulary-sharded logits (differentiable).

    Args:
        logits: ``[..., V / tp]`` shard.
        group: Tensor-parallel group.

    Returns:
        ``[..., V]`` logits.
    """
    return gather_from_tensor_parallel_region(logits, group)


def full_state_dict(model: GPTModel) -> dict[str, torch.Tensor]:
    """Gather every tensor-parallel shard into whole tensors (collective over the TP group).

    Args:
        model: A parallelized model.

    Returns:
        Unsharded state dict with the names of an unsharded model.
    """
    group = model.tp_group
    world = dist.get_world_size(group)
    params = dict(model.named_parameters())
    full: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        dims = get_partition_dims(params[name]) if name in params else {}
        if "tp" not in dims:
            full[name] = tensor
            continue
        dim = dims["tp"]
        chunks = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(chunks, tensor.contiguous(), group=group)
        full[name] = torch.cat(chunks, dim=dim)
    return full
