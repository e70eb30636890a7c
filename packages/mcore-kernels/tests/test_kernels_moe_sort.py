"""The counting sort of the routing assignments (``mcore_kernels.moe.sort.expert_rows``) through
the Triton interpreter: against its torch reference (a stable sort and the row rules), against
the rule written out assignment by assignment, with experts that receive no assignment, drops,
blocks that end inside the assignments, no assignment at all, and bitwise-equal repeated
calls."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.moe import sort
from mcore_kernels.moe.reference import expert_rows_reference
from mcore_kernels.moe.sort import expert_rows

pytestmark = pytest.mark.interpreter


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")


def _routing(num_experts: int, assignments: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # Skewed: the low experts get most assignments, the last two none.
    weights = torch.linspace(4.0, 0.5, num_experts)
    weights[-2:] = 0.0
    experts = torch.multinomial(weights, assignments, replacement=True, generator=generator)
    return experts, torch.bincount(experts, minlength=num_experts)


def _by_rule(experts: torch.Tensor, counts: torch.Tensor, capacity: int) -> list[int]:
    """Row of each assignment: experts packed in order, each keeping its first ``capacity``
    assignments in token order."""
    kept = counts.clamp(max=capacity).tolist()
    first = [sum(kept[:e]) for e in range(len(kept))]
    seen = [0] * len(kept)
    rows = []
    for expert in experts.tolist():
        rank = seen[expert]
        seen[expert] += 1
        rows.append(first[expert] + rank if rank < capacity else -1)
    return rows


@pytest.mark.parametrize(
    ("num_experts", "assignments", "capacity"),
    [
        (9, 3000, None),
        (7, 1500, 3),
        (7, 1500, 200),
        (40, 700, None),
        (5, 256, 1000),
        (6, 257, 30),
        (3, 5, None),
    ],
    ids=["dropless", "drops", "some-drops", "many-experts", "one-block", "partial-block", "few"],
)
def test_expert_rows_match_the_reference_and_the_rule(num_experts, assignments, capacity):
    experts, counts = _routing(num_experts, assignments, seed=assignments + num_experts)
    got = expert_rows(experts, counts, capacity)
    want = expert_rows_reference(experts, counts, capacity)
    for value, reference in zip(got, want, strict=True):
        assert value.dtype == reference.dtype and torch.equal(value, reference)
    order, inverse, kept, offsets = got
    keep = assignments if capacity is None else capacity
    assert inverse.tolist() == _by_rule(experts, counts, keep)
    assert torch.equal(kept, counts.clamp(max=keep))
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == [sum(kept.tolist()[: e + 1]) for e in range(num_experts)]
    total = int(kept.sum())
    for expert, end in enumerate(offsets.tolist()):
        start = 0 if expert == 0 else int(offsets[expert - 1])
        mine = torch.nonzero(experts == expert).flatten()[: int(kept[expert])]
        assert torch.equal(order[start:end], mine)
    assert bool((order[total:] == -1).all())
    if capacity is None:
        # Dropless: the stable sort by expert and its inverse.
        assert torch.equal(order, torch.argsort(experts, stable=True))
        assert torch.equal(order[inverse], torch.arange(assignments))
    again = expert_rows(experts, counts, capacity)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))


def test_expert_rows_across_many_blocks_of_block_counts(monkeypatch):
    # More blocks than one step of the prefix loop sums, several chunks per block: small
    # blocks and chunks, several prefix steps.
    monkeypatch.setattr(sort, "BLOCK", 16)
    monkeypatch.setattr(sort, "CHUNK", 4)
    monkeypatch.setattr(sort, "PREFIX_ROWS", 4)
    experts, counts = _routing(11, 300, seed=7)
    for capacity in (None, 12):
        got = expert_rows(experts, counts, capacity)
        want = expert_rows_reference(experts, counts, capacity)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_expert_rows_of_no_assignment_and_zero_capacity():
    empty = torch.zeros(0, dtype=torch.int64)
    zeros = torch.zeros(4, dtype=torch.int64)
    order, inverse, kept, offsets = expert_rows(empty, zeros)
    assert order.numel() == inverse.numel() == 0
    assert torch.equal(kept, zeros) and torch.equal(offsets, zeros.int())
    experts, counts = _routing(4, 30, seed=1)
    order, inverse, kept, offsets = expert_rows(experts, counts, 0)
    assert bool((order == -1).all()) and bool((inverse == -1).all())
    assert torch.equal(kept, zeros) and torch.equal(offsets, zeros.int())


def test_expert_rows_reject_bad_input():
    experts, counts = _routing(4, 20, seed=0)
    with pytest.raises(KernelShapeError, match=r"experts\.shape"):
        expert_rows(experts.view(4, 5), counts)
    with pytest.raises(KernelDtypeError, match=r"counts\.dtype"):
        expert_rows(experts, counts.int())
    with pytest.raises(KernelDtypeError, match=r"experts\.dtype"):
        expert_rows(experts.int(), counts)
    with pytest.raises(KernelValueError, match="capacity=-1"):
        expert_rows(experts, counts, -1)
