"""Packing: properties with hypothesis, the FFD bound against brute force, packed tensors."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcore_rl.errors import PackingError
from mcore_rl.packing import PackingContext, distribute_bins, pack_sequences

ALGORITHMS = ["ffd", "mffd", "next_fit"]


def _optimal_bins(lengths, capacity):
    # Brute force: branch over the bin of every item (largest first), with memoised states.
    items = sorted(lengths, reverse=True)

    @functools.cache
    def best(k, loads):
        if k == len(items):
            return len(loads)
        options = {load for load in loads if load + items[k] <= capacity}
        result = best(k + 1, tuple(sorted((*loads, items[k]))))
        for load in options:
            new = list(loads)
            new.remove(load)
            result = min(result, best(k + 1, tuple(sorted((*new, load + items[k])))))
        return result

    return best(0, ())


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    extra=st.integers(0, 30),
    limit=st.one_of(st.none(), st.integers(1, 5)),
    algorithm=st.sampled_from(ALGORITHMS),
)
def test_every_sequence_packed_once_within_capacity(lengths, extra, limit, algorithm):
    bin_size = max(lengths) + extra
    info = pack_sequences(lengths, bin_size, limit, algorithm)
    flat = sorted(i for b in info.bins for i in b)
    assert flat == list(range(len(lengths)))
    for b, tokens in zip(info.bins, info.bin_tokens):
        assert tokens <= bin_size
        assert limit is None or len(b) <= limit
    assert 0.0 < info.efficiency <= 1.0


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=8), capacity=st.integers(20, 30))
def test_ffd_within_dosa_bound_of_brute_force_optimum(lengths, capacity):
    optimum = _optimal_bins(tuple(lengths), capacity)
    for algorithm in ("ffd", "mffd"):
        bins = pack_sequences(lengths, capacity, algorithm=algorithm).num_bins
        assert optimum <= bins
    assert pack_sequences(lengths, capacity).num_bins <= 11 / 9 * optimum + 6 / 9


def test_ffd_never_worse_than_next_fit_on_a_known_instance():
    lengths = [6, 5, 5, 4, 4, 3, 2, 1]
    assert pack_sequences(lengths, 10).num_bins == 3
    assert pack_sequences(lengths, 10, algorithm="next_fit").num_bins == 4


def test_automatic_bin_size_from_longest_and_budget():
    assert pack_sequences([3, 5, 30], token_budget=16).bin_size == 32  # longest wins, rounded
    assert pack_sequences([3, 5, 7], token_budget=64).bin_size == 16  # all tokens fit, rounded
    assert pack_sequences([10] * 100, token_budget=64).bin_size == 64


def test_packing_errors_name_the_argument():
    with pytest.raises(PackingError, match="bin_size=4 is smaller than the longest sequence"):
        pack_sequences([3, 5], 4)
    with pytest.raises(PackingError, match="expected every length > 0"):
        pack_sequences([3, 0], 4)
    with pytest.raises(PackingError, match="algorithm='best'"):
        pack_sequences([3], 4, algorithm="best")  # type: ignore[arg-type]
    with pytest.raises(PackingError, match="dp_size=0"):
        distribute_bins(pack_sequences([3], 4), 0)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 16), min_size=1, max_size=30), dp=st.integers(1, 4))
def test_bins_distributed_with_equal_counts_and_balanced_tokens(lengths, dp):
    info = pack_sequences(lengths, 16)
    assignment = distribute_bins(info, dp)
    assert len({len(a) for a in assignment}) == 1
    assert sorted(b for a in assignment for b in a if b >= 0) == list(range(info.num_bins))
    work = [sum(info.bin_tokens[b] for b in a if b >= 0) for a in assignment]
    # Greedy LPT: the spread never exceeds the largest bin.
    assert max(work) - min(work) <= max(info.bin_tokens)


def test_packing_context_layout():
    sequences = [[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 4, 4]]
    prompts = [2, 1, 3]
    info = pack_sequences([len(s) for s in sequences], 8, algorithm="next_fit")
    assert info.bins == ((0, 1), (2,))
    ctx = PackingContext.build(sequences, prompts, [0.5, -1.0, 2.0], info, max_sequences_per_bin=3)
    assert ctx.input_ids[0].tolist() == [1, 5, 6, 7, 1, 8, 9, 0]
    assert ctx.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert ctx.target_ids[0].tolist() == [5, 6, 7, 0, 8, 9, 0, 0]
    assert ctx.loss_mask[0].tolist() == [0, 1, 1, 0, 1, 1, 0, 0]
    assert ctx.advantages[0].tolist() == [0, 0.5, 0.5, 0, -1, -1, 0, 0]
    assert ctx.cu_seqlens.tolist() == [[0, 4, 7, 8, 8], [0, 5, 8, 8, 8]]
    assert ctx.num_tokens == 2 + 2 + 2
    values = [torch.tensor([10.0, 11.0]), torch.tensor([20.0, 21.0]), torch.tensor([30.0, 31.0])]
    packed = ctx.scatter(values)
    back = ctx.gather(packed)
    for i in range(3):
        assert torch.equal(back[i], values[i])


def test_packing_context_empty_bin_is_all_padding():
    info = pack_sequences([3], 4)
    ctx = PackingContext.build([[1, 2, 3]], [1], [1.0], info, bin_indices=[0, -1])
    assert ctx.loss_mask[1].sum() == 0
    assert ctx.cu_seqlens[1].tolist() == [0, 4, 4]
    with pytest.raises(PackingError, match="expected 1"):
        PackingContext.build([[1, 2, 3], [1]], [1, 1], [1.0, 1.0], info)


def test_packing_context_rejects_bin_indices_out_of_range():
    info = pack_sequences([3, 2], 4)
    for bad in (info.num_bins, -2):
        with pytest.raises(PackingError, match=f"bin_indices holds {bad}"):
            PackingContext.build([[1, 2, 3], [1, 2]], [1, 1], [1.0, 1.0], info, bin_indices=[bad])


def test_scatter_takes_lists_or_tensors_and_gather_returns_them():
    sequences = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    prompts = [2, 1, 3]
    info = pack_sequences([4, 3, 5], 8, max_sequences_per_bin=2, algorithm="ffd")
    context = PackingContext.build(sequences, prompts, [0.5, -1.0, 2.0], info)
    values = [
        [0.25 * (i + 1) + j for j in range(len(s) - p)]
        for i, (s, p) in enumerate(zip(sequences, prompts))
    ]
    from_lists = context.scatter(values)
    from_tensors = context.scatter([torch.tensor(v) for v in values])
    assert torch.equal(from_lists, from_tensors)
    gathered = context.gather(from_lists)
    for i, expected in enumerate(values):
        assert gathered[i].tolist() == expected
