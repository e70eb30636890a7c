"""Tensor parallelism over the heads of Multi-head Latent Attention.

The per-head projections are split by heads: the query up-projection (``q_proj`` or
``q_b_proj``) and ``kv_b_proj`` by output features, ``o_proj`` by input features. The latent
projections (``q_a_proj``, ``kv_a_proj_with_mqa``) and their norms are small and replicated:
every rank computes the whole latent and the shared rotary key. The column-parallel
up-projections sum the latents' gradients over the ranks in their backward; the shared rotary
key feeds the heads directly, so a copy to the tensor-parallel region is installed in front of
them (``MLAttention.rope_key_input``), whose backward sums its partial gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from mcore_models.errors import ModelConfigError
from mcore_models.gpt.mla import MLAttention
from mcore_parallel.tensor_parallel.mappings import copy_to_tensor_parallel_region

if TYPE_CHECKING:
    from mcore_parallel.state import ParallelState

__all__ = ["parallelize_mla_attention"]


def parallelize_mla_attention(
    attention: MLAttention,
    state: ParallelState,
    *,
    column: Callable[[nn.Linear, Any, bool], nn.Module],
    row: Callable[[nn.Linear, Any, bool], nn.Module],
    mapping: Callable[[Callable[..., Any], Any], nn.Module],
    sequence_parallel: bool,
) -> None:
    """Shard one MLA block over the tensor-parallel group, in place.

    Args:
        attention: An unsharded MLA block.
        state: Parallel state (``tp_size > 1``).
        column: Builds the column-parallel counterpart of a linear layer
            (``column(linear, state, sequence_parallel)``).
        row: Builds the row-parallel counterpart of a linear layer.
        mapping: Wraps a communication function and a group into a module
            (:class:`mcore_models.gpt.parallelize.TensorParallelMapping`).
        sequence_parallel: Whether sequence parallelism was asked for.

    Raises:
        ModelConfigError: Under sequence parallelism (the replicated latent projections would
            need the whole sequence), or if the heads are not divisible by the TP size.
    """
    tp = state.tp_size
    if sequence_parallel:
        raise ModelConfigError(
            "sequence_parallel=True is not supported with attention_type='mla'; expected "
            "sequence_parallel=False"
        )
    if attention.num_heads % tp:
        raise ModelConfigError(
            f"num_attention_heads={attention.num_heads} must be divisible by the "
            f"tensor-parallel size tp={tp}"
        )
    for name in ("q_proj", "q_b_proj", "kv_b_proj"):
        linear = getattr(attention, name)
        if linear is not None:
            setattr(attention, name, column(linear, state, False))
    attention.o_proj = row(attention.o_proj, state, False)  # type: ignore[assignment]
    attention.rope_key_input = mapping(copy_to_tensor_parallel_region, state.tp_group)
    attention.num_heads //= tp
