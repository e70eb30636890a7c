"""``parallelize``: apply tensor, sequence, expert and pipeline parallelism to a plain model.

The torchtitan split (github.com/pytorch/torchtitan): the model file has no parallel code, and
this module applies the parallelisms of a :class:`~mcore_parallel.ParallelState` to it:

1. pipeline split: this rank keeps the decoder layers of its stage(s) (``pp_size`` stages, or
   ``pp_size x virtual_stages`` interleaved chunks: chunk ``c`` of pipeline rank ``r`` is stage
   ``c * pp + r``, the order of mcore-parallel's interleaved schedule); the first stage keeps the
   embedding, the last the final norm and the output layer (a copy of the embedding when tied);
2. tensor / sequence parallelism on each kept chunk, experts over ep (and etp);
3. every parameter records its place in the global tensor (canonical name, global shape and
   offset), which initialisation, Hugging Face loading and export read.

Build large models on the meta device and materialise after parallelizing: nothing but this
rank's shards is ever allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn

from mcore_models.errors import ModelConfigError
from mcore_models.gpt.parallelize import parallelize_gpt
from mcore_models.materialize import materialize_module, place_parameters

if TYPE_CHECKING:
    from mcore_models.gpt.model import GPTModel
    from mcore_models.mamba.model import HybridModel
    from mcore_parallel.state import ParallelState

_Model = TypeVar("_Model", "GPTModel", "HybridModel")

__all__ = [
    "PipelineLayout",
    "materialize",
    "parallelize",
    "split_stages",
    "stage_layer_ranges",
]


@dataclass(kw_only=True, slots=True)
class PipelineLayout:
    """How the decoder layers are split into pipeline stages."""

    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B when > 1)."""
    layers_per_stage: tuple[int, ...] | None = None
    """Decoder layers of every stage in stage order (``pp * virtual_stages`` entries, each
    >= 1, summing to ``num_layers``); None splits evenly (then ``num_layers`` must be
    divisible by the number of stages)."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.virtual_stages, bool)
            or not isinstance(self.virtual_stages, int)
            or self.virtual_stages < 1
        ):
            raise ModelConfigError(f"virtual_stages={self.virtual_stages!r} must be an int >= 1")
        if self.layers_per_stage is not None:
            self.layers_per_stage = tuple(self.layers_per_stage)
            if not all(isinstance(n, int) and n >= 1 for n in self.layers_per_stage):
                raise ModelConfigError(
                    f"layers_per_stage={self.layers_per_stage} must hold ints >= 1"
                )


def stage_layer_ranges(
    num_layers: int, pp: int, layout: PipelineLayout | None = None
) -> list[range]:
    """Global decoder-layer indices of every pipeline stage, in stage order.

    Args:
        num_layers: Decoder layers of the model.
        pp: Pipeline-parallel size.
        layout: Virtual stages and an explicit split; None: one chunk per rank, even split.

    Returns:
        ``pp * virtual_stages`` ranges.

    Raises:
        ModelConfigError: If the layers cannot be split as asked.
    """
    layout = layout or PipelineLayout()
    stages = pp * layout.virtual_stages
    counts = layout.layers_per_stage
    if counts is None:
        if num_layers % stages:
            raise ModelConfigError(
                f"num_layers={num_layers} is not divisible by pp * virtual_stages = {pp} * "
                f"{layout.virtual_stages} = {stages}; pass PipelineLayout(layers_per_stage=...)"
            )
        counts = (num_layers // stages,) * stages
    if len(counts) != stages or sum(counts) != num_layers:
        raise ModelConfigError(
            f"layers_per_stage={counts} must have pp * virtual_stages = {stages} entries "
            f"summing to num_layers={num_layers}"
        )
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def split_stages(model: _Model, state: ParallelState, layout: PipelineLayout) -> list[_Model]:
    """This rank's pipeline chunks of a whole model, made of the modules of ``model``.

    Each chunk is a model of the same class holding its stage's layers (the modules of
    ``model``, not copies); the first stage gets the embedding, the last the final norm and
    output layer (a copy of a tied embedding's weight where the last stage lacks it).

    Args:
        model: A whole :class:`~mcore_models.GPTModel` or
            :class:`~mcore_models.mamba.HybridModel`, on the meta device or materialised.
        state: Parallel state (its pp size and rank).
        layout: Virtual stages and layers per stage.

    Returns:
        One chunk per virtual stage, first first.

    Raises:
        ModelConfigError: If the model is already a stage or the layout does not fit.
    """
    if not (model.pre_process and model.post_process) or len(model.layers) != (
        model.config.num_layers
    ):
        raise ModelConfigError(
            f"{type(model).__name__} is split into pipeline stages whole; this one is already "
            "a stage"
        )
    pp, rank = state.pp_size, state.pp_rank
    ranges = stage_layer_ranges(model.config.num_layers, pp, layout)
    last = len(ranges) - 1
    chunks = []
    for chunk in range(layout.virtual_stages):
        stage = chunk * pp + rank
        part = type(model)(
            model.config,
            device="meta",
            layers=ranges[stage],
            pre_process=stage == 0,
            post_process=stage == last,
        )
        part.layers = nn.ModuleList(model.layers[i] for i in ranges[stage])
        rotary = getattr(model, "rotary", None)
        if rotary is not None:  # a GPT's rotary table, shared by its stages
            part.rotary = rotary
        if part.pre_process:
            part.embedding = model.embedding
        if part.post_process:
            part.final_norm = model.final_norm
            if model.output_layer is not None:
                part.output_layer = model.output_layer
            elif part.output_layer is not None and model.embedding is not None:
                # Tied embedding on a last stage without it: start from a copy.
                source = cast(torch.Tensor, model.embedding.weight)
                copy = nn.Linear(source.shape[1], source.shape[0], bias=False, device="meta")
                copy.weight = nn.Parameter(source.detach().clone())
                part.output_layer = copy
        chunks.append(part)
    return chunks


def parallelize(
    model: GPTModel,
    state: ParallelState,
    *,
    sequence_parallel: bool | None = None,
    pipeline: PipelineLayout | None = None,
    context_parallel_method: str = "ring",
) -> GPTModel | list[GPTModel]:
    """Apply the parallel layout of ``state`` to a whole model.

    Args:
        model: A whole :class:`~mcore_models.GPTModel` (dense or MoE), on the meta device (then
            call :func:`materialize` or load weights) or materialised (its slices are kept).
        state: Parallel state (tp, pp, ep, etp, cp sizes and groups).
        sequence_parallel: Split activations along the sequence between tensor-parallel
            regions; default ``model.config.sequence_parallel``.
        pipeline: Virtual stages and layer split when ``state.pp_size > 1`` (or virtual
            stages on one rank); default one even chunk per pipeline rank.
        context_parallel_method: With ``state.cp_size > 1``, ``"ring"`` (default) or
            ``"all_gather"`` attention over the context-parallel group. The model then takes
            this rank's load-balanced tokens (``mcore_parallel.context_parallel.split_sequence``)
            with their ``position_ids`` and the full row's ``packed_seq_params``.

    Returns:
        The parallelized model: this rank's stage, or the list of its model chunks when
        ``pipeline.virtual_stages > 1`` (feed it to mcore-parallel's interleaved schedule).
        Without pipeline parallelism ``model`` itself is returned, sharded in place.

    Raises:
        ModelConfigError: If the layout does not fit the model (sizes not divisible, a bad
            layer split, a model that is already a stage or already parallelized).
    """
    from mcore_models.mamba.model import HybridModel

    layout = pipeline or PipelineLayout()
    if isinstance(model, HybridModel):
        return _parallelize_hybrid(model, state, layout)
    sp = model.config.sequence_parallel if sequence_parallel is None else sequence_parallel
    if context_parallel_method not in ("ring", "all_gather"):
        raise ModelConfigError(
            f"context_parallel_method={context_parallel_method!r} must be 'ring' or 'all_gather'"
        )
    if state.pp_size > 1 or layout.virtual_stages > 1:
        chunks = split_stages(model, state, layout)
    else:
        chunks = [model]
    for chunk in chunks:
        parallelize_gpt(
            chunk, state, sequence_parallel=sp, context_parallel_method=context_parallel_method
        )
        place_parameters(chunk, state, chunk.canonical_name)
    return chunks if layout.virtual_stages > 1 else chunks[0]


def _parallelize_hybrid(model: Any, state: ParallelState, layout: PipelineLayout) -> Any:
    """Pipeline split and tensor parallelism of a materialised hybrid Mamba model."""
    from mcore_models.mamba.parallelize import parallelize_hybrid

    if state.pp_size > 1 or layout.virtual_stages > 1:
        chunks = split_stages(model, state, layout)
    else:
        chunks = [model]
    for chunk in chunks:
        parallelize_hybrid(chunk, state)
    return chunks if layout.virtual_stages > 1 else chunks[0]


def materialize(model: GPTModel | list[GPTModel], device: torch.device | str | None = None) -> None:
    """Allocate a meta-device model (or chunks) and initialise this rank's blocks.

    Every layout gets the slices of the same full weights (``config.seed``); see
    :mod:`mcore_models.init`.

    Args:
        model: A model or list of chunks built with ``device="meta"`` and parallelized.
        device: Target device (default: the current default device).
    """
    target = torch.device(device) if device is not None else torch.empty(0).device
    for chunk in model if isinstance(model, list) else [model]:
        config = chunk.config
        materialize_module(
            chunk,
            target,
            seed=config.seed,
            init_std=config.init_std,
            initialize=config.perform_initialization,
        )
