"""Build this rank's pipeline chunks of a GPT directly on the meta device, then materialise."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel
from mcore_models.mamba.config import HybridConfig
from mcore_models.parallelize import PipelineLayout, materialize, parallelize

if TYPE_CHECKING:
    from mcore_parallel.state import ParallelState

__all__ = ["build_pipeline_stages"]


def build_pipeline_stages(
    config: GPTConfig | HybridConfig,
    state: ParallelState,
    *,
    virtual_stages: int = 1,
    layout: tuple[int, ...] | None = None,
    sequence_parallel: bool | None = None,
    device: torch.device | str | None = None,
    context_parallel_method: str = "ring",
) -> list[Any]:
    """Build this rank's pipeline chunk(s) of a model, sharded and initialised.

    The model is built on the meta device, split, sharded, and only this rank's blocks are
    allocated and initialised, with the values the unsharded model gets from ``config.seed``.

    Args:
        config: Model config (a :class:`~mcore_models.mamba.HybridConfig` builds a hybrid
            Mamba model, initialised whole on ``device`` and then split and sharded).
        state: Parallel state.
        virtual_stages: Model chunks per pipeline rank.
        layout: Decoder layers of every stage (``pp * virtual_stages`` entries); None splits
            evenly.
        sequence_parallel: See :func:`parallelize`.
        device: Device of the parameters (default ``state.device``).
        context_parallel_method: See :func:`parallelize` (GPT models under ``cp > 1``).

    Returns:
        This rank's chunks, first chunk first (one per virtual stage).

    Raises:
        ModelConfigError: If the layout does not fit the model.
    """
    pipeline = PipelineLayout(virtual_stages=virtual_stages, layers_per_stage=layout)
    if isinstance(config, HybridConfig):
        from mcore_models.mamba.model import HybridModel

        # Hybrid models are initialised whole (from config.seed) and then split and sharded.
        whole = HybridModel(config, device=device if device is not None else state.device)
        hybrid = parallelize(cast(Any, whole), state, pipeline=pipeline)
        return hybrid if isinstance(hybrid, list) else [hybrid]
    result = parallelize(
        GPTModel(config, device="meta"),
        state,
        sequence_parallel=sequence_parallel,
        pipeline=pipeline,
        context_parallel_method=context_parallel_method,
    )
    chunks = result if isinstance(result, list) else [result]
    materialize(chunks, device if device is not None else state.device)
    return chunks
