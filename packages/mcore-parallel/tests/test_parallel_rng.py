"""RNGStatesTracker on one process: forking, restoring, determinism and errors.

The per-rank behaviour (distinct across tp, shared across dp) is checked on 4 ranks in
test_parallel_tp_layers.py.
"""

import pytest
import torch

from mcore_parallel.errors import ParallelConfigError, ParallelStateError
from mcore_parallel.tensor_parallel import (
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    model_parallel_seed,
)


def test_fork_leaves_the_default_stream_as_if_untouched():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    tracker = RNGStatesTracker()
    tracker.add("dropout", 100)
    with tracker.fork("dropout"):
        torch.rand(10)
    assert torch.equal(torch.rand(4), expected)


def test_fork_draws_from_the_named_seed_and_advances_it():
    tracker = RNGStatesTracker()
    tracker.add("dropout", 100)
    with tracker.fork("dropout"):
        first = torch.rand(4)
    with tracker.fork("dropout"):
        second = torch.rand(4)
    generator = torch.Generator().manual_seed(100)
    assert torch.equal(first, torch.rand(4, generator=generator))
    assert torch.equal(second, torch.rand(4, generator=generator))


def test_fork_restores_the_default_stream_on_exception():
    tracker = RNGStatesTracker()
    tracker.add("dropout", 7)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    with pytest.raises(KeyError), tracker.fork("dropout"):
        torch.rand(3)
        raise KeyError("inside fork")
    assert torch.equal(torch.get_rng_state(), before)


def test_get_and_set_states_replay_the_same_draws():
    tracker = RNGStatesTracker()
    tracker.add("dropout", 5)
    saved = tracker.get_states()
    with tracker.fork("dropout"):
        first = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("dropout"):
        assert torch.equal(torch.rand(3), first)


def test_model_parallel_seed_is_deterministic_and_names_both_states():
    draws = []
    for _ in range(2):
        tracker = model_parallel_seed(42, None)
        with tracker.fork(MODEL_PARALLEL_RNG):
            inside = torch.rand(3)
        with tracker.fork(EXPERT_PARALLEL_RNG):
            expert = torch.rand(3)
        draws.append((inside, expert, torch.rand(3)))
    assert all(torch.equal(a, b) for a, b in zip(*draws))
    assert not torch.equal(draws[0][0], draws[0][1])


def test_duplicate_name_or_seed_raises():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ParallelConfigError, match="name='a'"):
        tracker.add("a", 2)
    with pytest.raises(ParallelConfigError, match="seed=1"):
        tracker.add("b", 1)


def test_fork_of_unknown_state_raises():
    with (
        pytest.raises(ParallelStateError, match="name='missing'"),
        RNGStatesTracker().fork("missing"),
    ):
        pass
