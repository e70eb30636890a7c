"""The policy at the generation layout, and how new weights reach it after every step.

When the generation layout splits the model like the training layout (same tp, pp, ep, no
virtual stages, no sequence parallelism) the engine runs the training chunk itself and nothing
moves. Otherwise a second copy of the model is built at the generation layout on the same
ranks (only this rank's blocks are allocated). Either way one long-lived
:class:`InferenceEngine` (:meth:`InferencePolicy.engine_for`) generates every step, so its KV
cache and CUDA graphs are made once; :meth:`InferencePolicy.push` copies the trained weights into it through a
:class:`mcore_models.Resharder` plan (point-to-point, each rank receiving only its slices, never
a whole model on one rank, never through disk), writing the parameters in place so the engine's
captured CUDA graphs stay valid.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mcore_inference import InferenceConfig, InferenceEngine
from mcore_models import GPTModel, materialize, parallelize
from mcore_models.reshard import Resharder, ReshardStats
from mcore_parallel import ParallelState
from mcore_parallel.state import initialize
from mcore_rl.config import ParallelConfig

__all__ = ["InferencePolicy"]


class InferencePolicy:
    """The model the inference engine runs, at the generation layout.

    Collective: every rank of the run constructs it (with the same layouts) and calls
    :meth:`push` together.

    Args:
        train_chunks: This rank's training chunks (the source of the weights).
        train_state: The training layout's state.
        train_layout: The training layout.
        infer_layout: The generation layout.
        engine_config: Config of the long-lived engine.
        keep_engine: Also keep an engine when the layouts are shared (the engine then runs the
            training chunk itself); a separate inference model always gets one.

    Raises:
        RLConfigError: If the generation layout does not fit the world.
    """

    def __init__(
        self,
        train_chunks: list[GPTModel],
        train_state: ParallelState,
        train_layout: ParallelConfig,
        infer_layout: ParallelConfig,
        engine_config: InferenceConfig,
        *,
        keep_engine: bool = True,
    ) -> None:
        world = torch.distributed.get_world_size()
        infer_layout.data_parallel_size(world)
        self.shared = train_layout.same_model_layout(infer_layout)
        """True when the engine runs the training chunk itself (nothing is resharded)."""
        self.engine: InferenceEngine | None = None
        """The long-lived engine, built by :meth:`engine_for` (None before, and always when
        the layouts are shared and ``keep_engine`` is False)."""
        self._engine_config: InferenceConfig | None = engine_config
        self._resharder: Resharder | None = None
        self._owns_state = False
        if self.shared:
            self.state = train_state
            self.model: GPTModel = train_chunks[0]
            if not keep_engine:
                self._engine_config = None
            return
        self.state = initialize(
            tp=infer_layout.tp, pp=infer_layout.pp, ep=infer_layout.ep, etp=infer_layout.etp
        )
        self._owns_state = True
        config = train_chunks[0].config
        built = parallelize(GPTModel(config, device="meta"), self.state, sequence_parallel=False)
        assert isinstance(built, GPTModel)
        materialize(built, train_state.device)
        self.model = built.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self._resharder = Resharder(list(train_chunks), [self.model])
        self.push()

    def engine_for(self, sequence_length: int) -> InferenceEngine | None:
        """The long-lived engine, sized for requests of up to ``sequence_length`` tokens.

        The engine is built on the first call and kept: its KV cache (``max_batch_size``
        sequences) and CUDA graphs are made once. Its length is ``sequence_length`` rounded up
        to a power-of-two number of KV blocks, at most the engine config's
        ``max_sequence_length`` (the model's context); a later call that needs more builds it
        again, larger. Collective when the generation layout is model-parallel: every rank
        calls it with the same length.

        Args:
            sequence_length: Prompt plus new tokens of the longest request to come.

        Returns:
            The engine, or None when the layouts are shared and ``keep_engine`` is False
            (every rollout call then builds its own).
        """
        config = self._engine_config
        if config is None:
            return None
        if self.engine is not None and self.engine.config.max_sequence_length >= sequence_length:
            return self.engine
        blocks = -(-max(sequence_length, 1) // config.block_size)
        length = min(
            config.max_sequence_length, (1 << (blocks - 1).bit_length()) * config.block_size
        )
        length = max(length, sequence_length)
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        sized = dataclasses.replace(config, max_sequence_length=length)
        self.engine = InferenceEngine(self.model, sized, state=self.state)
        return self.engine

    @property
    def dp_group(self) -> Any:
        """The data-parallel group of the generation layout (None for one replica).

        Returns:
            The group or None.
        """
        return self.state.group("dp") if self.state.size("dp") > 1 else None

    @torch.no_grad()
    def push(self) -> ReshardStats:
        """Copies the training weights into the inference model (collective).

        Call it with the training parameters complete (after the optimizer's parameter
        all-gather) on every rank at the same time.

        Returns:
            Bytes this rank sent, received and copied locally, and the seconds it took; all
            zero when the engine runs the training model itself.
        """
        if self._resharder is None:
            return ReshardStats()
        return self._resharder.push()

    def close(self) -> None:
        """Closes the engine and destroys the generation layout's groups (idempotent)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self._owns_state:
            self.state.destroy()
            self._owns_state = False
