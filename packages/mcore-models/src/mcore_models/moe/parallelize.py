"""Expert parallelism for MoE layers (placeholder over MoELayer.parallelize until ETP lands)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mcore_models.errors import ModelConfigError

if TYPE_CHECKING:
    from mcore_models.moe.layer import MoELayer
    from mcore_parallel.state import ParallelState

__all__ = ["parallelize_moe"]


def parallelize_moe(layer: MoELayer, state: ParallelState, *, sequence_parallel: bool) -> None:
    """Shard a MoE layer's experts over the expert-parallel group (in place).

    Args:
        layer: The MoE layer.
        state: Parallel state.
        sequence_parallel: Whether the layer sees sequence-parallel activations.

    Raises:
        ModelConfigError: With sequence parallelism (not supported yet).
    """
    if sequence_parallel:
        raise ModelConfigError("sequence_parallel=True is not supported with MoE layers yet")
    layer.parallelize(state)
