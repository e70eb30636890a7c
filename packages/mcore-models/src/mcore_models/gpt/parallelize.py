"""Tensor and sequence parallelism for a GPT model or pipeline stage (mcore-parallel's layers).

:func:`parallelize_gpt` replaces, in place, every projection of an unsharded model by its
mcore-parallel counterpart holding this rank's shard, after torchtitan's ``parallelize_llama``
(github.com/pytorch/torchtitan). Query, key and value projections and the MLP gate/up
projections are split by output features (whole heads per rank), the attention output and MLP
down projections by input features, the embedding and output layer by vocabulary. On a
meta-device model only the local shapes are created; on a materialised one the shards are cut
from the whole weights, so it computes what the unsharded model computes, at any TP size.
The output head's communication (copy to the TP region, vocabulary all-gather, sequence
all-gather) is installed as modules of the model, so its forward has no parallel branches.

With sequence parallelism the activations between the projections are split along the
sequence (dimension 1) over the TP ranks. Replicated weights that then see only part of the
tokens (RMSNorm weights), and the per-head QK-norm weights under TP, are marked
``param.sequence_parallel = True``: after backward call
``mcore_parallel.tensor_parallel.layers.allreduce_sequence_parallel_grads(model, state)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from mcore_models.errors import ModelConfigError
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.context_parallel import ContextParallelAttention
from mcore_models.gpt.layer import Attention, DecoderLayer
from mcore_models.gpt.mla import MLAttention
from mcore_models.gpt.mla_parallelize import parallelize_mla_attention
from mcore_models.gpt.mlp import SwiGLUMLP
from mcore_models.moe.layer import MoELayer
from mcore_models.moe.parallelize import parallelize_moe
from mcore_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mcore_parallel.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
)

if TYPE_CHECKING:
    from mcore_models.gpt.model import GPTModel
    from mcore_parallel.state import ParallelState

__all__ = ["TensorParallelMapping", "gather_sequence", "parallelize_gpt"]

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


def parallelize_gpt(
    model: GPTModel,
    state: ParallelState,
    *,
    sequence_parallel: bool,
    context_parallel_method: str = "ring",
) -> None:
    """Apply tensor (and sequence) parallelism to a GPT model or pipeline stage, in place.

    Works on a model whose parameters live on the meta device (only this rank's shapes are
    created, nothing is allocated or copied) and on a materialised one (this rank's slices are
    copied out of the whole weights). Mixture-of-experts layers are sharded by
    :func:`mcore_models.moe.parallelize.parallelize_moe` (experts over ep / etp).

    Args:
        model: An unsharded model or stage.
        state: Parallel state.
        sequence_parallel: Split the activations between the tensor-parallel regions along the
            sequence.
        context_parallel_method: Under ``state.cp_size > 1``, ``"ring"`` or ``"all_gather"``
            attention over the context-parallel group (installed as each attention's
            ``core_attention``).

    Raises:
        ModelConfigError: If heads, query groups, FFN size or vocabulary are not divisible by
            the TP size, the model is already parallelized, or an MLP type cannot be sharded.
    """
    tp = state.tp_size
    if model.tp_group is not None or model.context_parallel_size > 1:
        raise ModelConfigError("model is already parallelized; parallelize a whole model")
    config = model.config
    if tp > 1:
        _check_divisible(config, tp)
    # Every check runs before the first layer is sharded, so an error leaves the model whole.
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        mlp = layer.mlp
        if not isinstance(mlp, (SwiGLUMLP, MoELayer)):
            raise ModelConfigError(
                f"layer {layer.layer_idx} has an MLP of type {type(mlp).__name__}, which "
                "parallelize cannot shard (expected SwiGLUMLP or MoELayer)"
            )
    sp = sequence_parallel and tp > 1
    cp = state.cp_size
    if config.attention_type == "mla" and (cp > 1 or sp):
        raise ModelConfigError(
            f"cp={cp}, sequence_parallel={sp}: attention_type='mla' supports neither context "
            "nor sequence parallelism; expected cp=1 and sequence_parallel=False"
        )
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        if cp > 1:
            layer.self_attention.core_attention = ContextParallelAttention(
                state.cp_group, context_parallel_method
            )
        mlp = layer.mlp
        if isinstance(mlp, MoELayer):
            parallelize_moe(mlp, state, sequence_parallel=sp)
        if tp == 1:
            continue
        attention = layer.self_attention
        if isinstance(attention, MLAttention):
            parallelize_mla_attention(
                attention,
                state,
                column=_column,
                row=_row,
                mapping=TensorParallelMapping,
                sequence_parallel=sp,
            )
        else:
            assert isinstance(attention, Attention)
            _parallelize_attention(attention, state, sp)
        if isinstance(mlp, SwiGLUMLP):
            mlp.gate_proj = _column(mlp.gate_proj, state, sp)  # type: ignore[assignment]
            mlp.up_proj = _column(mlp.up_proj, state, sp)  # type: ignore[assignment]
            mlp.down_proj = _row(mlp.down_proj, state, sp)  # type: ignore[assignment]
        if sp:
            _mark_partial_gradient(layer.input_norm.weight)
            _mark_partial_gradient(layer.post_attention_norm.weight)
    model.context_parallel_size = cp
    if tp == 1:
        return
    if sp and model.final_norm is not None:
        _mark_partial_gradient(model.final_norm.weight)
    if model.embedding is not None:
        weight = cast(torch.Tensor, model.embedding.weight)
        model.embedding = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            state=state,
            sequence_parallel=sp,
            sequence_dim=_SEQUENCE_DIM,
            init_method=_copy_of(weight),
            dtype=weight.dtype,
            device=weight.device,
        )
    if model.output_layer is not None:
        model.output_layer = _column(model.output_layer, state, False)  # type: ignore[arg-type]
    if model.post_process:
        model.logits_input = TensorParallelMapping(copy_to_tensor_parallel_region, state.tp_group)
        model.logits_gather = TensorParallelMapping(
            gather_from_tensor_parallel_region, state.tp_group
        )
        if sp:
            model.sequence_gather = TensorParallelMapping(gather_sequence, state.tp_group)
    model.tp_group = state.tp_group
    model.sequence_parallel_size = tp if sp else 1


def _parallelize_attention(attention: Attention, state: ParallelState, sp: bool) -> None:
    """Split the heads of a grouped-query attention block over the TP group, in place."""
    tp = state.tp_size
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, _column(getattr(attention, name), state, sp))
    attention.o_proj = _row(attention.o_proj, state, sp)  # type: ignore[assignment]
    attention.num_heads //= tp
    attention.num_kv_heads //= tp
    for norm in (attention.q_norm, attention.k_norm):
        if norm is not None:
            # Each rank normalises other heads with the shared weight: partial gradients.
            _mark_partial_gradient(norm.weight)


class TensorParallelMapping(nn.Module):
    """A communication step of mcore-parallel over the tensor-parallel group, as a module.

    ``parallelize`` installs these at the output head of a model (copy to the TP region,
    all-gather of vocabulary shards, all-gather of the sequence), so the model's forward calls
    modules and never branches on the layout.

    Args:
        mapping: ``mapping(tensor, group)``, e.g.
            ``mcore_parallel.tensor_parallel.mappings.copy_to_tensor_parallel_region``.
        group: Tensor-parallel group.
    """

    def __init__(
        self, mapping: Callable[[torch.Tensor, dist.ProcessGroup], torch.Tensor], group: Any
    ) -> None:
        super().__init__()
        self.mapping = mapping
        self.group = group

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        """Apply the mapping.

        Args:
            tensor: Input activations.

        Returns:
            The mapped tensor (differentiable).
        """
        return self.mapping(tensor, self.group)


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
