"""RNG states for dropout inside and outside tensor-parallel regions.

Activations outside a tensor-parallel region are replicated on the tp ranks, so their dropout
masks must agree: they use the default generator, seeded alike on every rank. Inside a region
each rank holds a different slice, so its masks must differ: they draw from a separate
"model-parallel" state, distinct per tp rank and shared across data-parallel replicas. The
scheme (a tracker of named states swapped into the device generator by a context manager)
follows Megatron-LM's ``CudaRNGStatesTracker``
(github.com/NVIDIA/Megatron-LM, megatron/core/tensor_parallel/random.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mcore_parallel.errors import ParallelConfigError, ParallelStateError
from mcore_parallel.state import ParallelState

__all__ = [
    "MODEL_PARALLEL_RNG",
    "EXPERT_PARALLEL_RNG",
    "RNGStatesTracker",
    "model_parallel_seed",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""Name of the state that differs across tp ranks and is shared across dp replicas."""

EXPERT_PARALLEL_RNG = "expert-parallel-rng"
"""Name of the state that differs across tp and ep ranks (dropout inside experts)."""

# Offsets that keep the derived seeds away from the default generator's seed; the values are
# Megatron-LM's (model_parallel_cuda_manual_seed), kept so that runs are comparable.
_MODEL_PARALLEL_OFFSET = 2718
_EXPERT_RANK_STRIDE = 100


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, new_state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(new_state, device)
    else:
        torch.set_rng_state(new_state)


class RNGStatesTracker:
    """Named generator states of one device, swapped in by :meth:`fork`.

    Args:
        device: The device whose default generator the states replace (``cpu`` or
            ``cuda:i``); default CPU.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device or "cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[int, str] = {}

    def add(self, name: str, seed: int) -> None:
        """Creates the state ``name`` from ``seed``; the device generator is left untouched.

        Args:
            name: Name of the new state.
            seed: Its seed; two states never share a seed.

        Raises:
            ParallelConfigError: If ``name`` or ``seed`` is already used.
        """
        if name in self._states:
            raise ParallelConfigError(f"RNG state name={name!r} already exists")
        if seed in self._seeds:
            raise ParallelConfigError(
                f"seed={seed} is already used by RNG state {self._seeds[seed]!r}"
            )
        saved = _get_state(self.device)
        try:
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self._states[name] = _get_state(self.device)
        finally:
            _set_state(self.device, saved)
        self._seeds[seed] = name

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Runs the block with the device generator in state ``name``.

        On exit (also on exceptions) the advanced state is stored back under ``name`` and the
        generator's previous state is restored, so the default stream is unaffected.

        Args:
            name: A state created by :meth:`add`.

        Yields:
            Nothing; random ops on the tracker's device inside the block draw from ``name``.

        Raises:
            ParallelStateError: If ``name`` was never added.
        """
        if name not in self._states:
            raise ParallelStateError(
                f"RNG state name={name!r} is not tracked; known: {sorted(self._states)}"
            )
        saved = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Returns a copy of every tracked state (for checkpoints).

        Returns:
            A mapping from name to generator state.
        """
        return {name: s.clone() for name, s in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replaces the tracked states (from :meth:`get_states`); seeds are forgotten.

        Args:
            states: A mapping from name to generator state.
        """
        self._states = {name: s.clone() for name, s in states.items()}
        self._seeds = {}

    def reset(self) -> None:
        """Forgets every state and seed."""
        self._states = {}
        self._seeds = {}


def model_parallel_seed(
    seed: int, state: ParallelState | None, *, device: torch.device | str | None = None
) -> RNGStatesTracker:
    """Seeds the default generator and returns a tracker of the model-parallel states.

    The default generator of ``device`` gets ``seed`` (identical on every rank). The tracker
    holds :data:`MODEL_PARALLEL_RNG` seeded ``seed + 2718 + tp_rank`` (distinct per tp rank,
    shared across dp) and :data:`EXPERT_PARALLEL_RNG` seeded
    ``seed + 2718 + 100 * (ep_rank + 1) + tp_rank`` (distinct per tp and ep rank).

    Args:
        seed: The run's seed.
        state: Parallel state; None behaves as a single rank.
        device: Device whose generator is seeded; default ``state.device`` or CPU.

    Returns:
        The tracker; use ``with tracker.fork():`` around dropout inside tp regions.
    """
    tp_rank = state.rank_in("tp") if state is not None else 0
    ep_rank = state.rank_in("ep") if state is not None else 0
    device = torch.device(device or (state.device if state is not None else "cpu"))
    tracker = RNGStatesTracker(device)
    if tracker.device.type == "cuda":
        with torch.cuda.device(tracker.device):
            torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_OFFSET + tp_rank)
    tracker.add(
        EXPERT_PARALLEL_RNG,
        seed + _MODEL_PARALLEL_OFFSET + _EXPERT_RANK_STRIDE * (ep_rank + 1) + tp_rank,
    )
    return tracker
