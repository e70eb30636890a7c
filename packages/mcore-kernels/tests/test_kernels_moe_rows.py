"""Rows of routing assignments in expert order (Triton, through the interpreter) against the
torch references and against the rules written out assignment by assignment: the inverse of
the sort and the experts' end rows (dropless), the packed kept rows of capacity routing with
experts over capacity, experts without assignments, no drop at all; zero assignments, bad
input."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.moe.rows import (
    capacity_rows,
    capacity_rows_reference,
    dropless_rows,
    dropless_rows_reference,
)

pytestmark = pytest.mark.interpreter


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _routing(num_experts: int, assignments: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    # Skewed: the low experts get most assignments, the last two none.
    weights = torch.linspace(4.0, 0.5, num_experts)
    weights[-2:] = 0.0
    experts = torch.multinomial(weights, assignments, replacement=True, generator=generator)
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=num_experts)
    return experts, order, counts


def _by_rule(experts: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
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
    return torch.tensor(rows)


@pytest.mark.parametrize("capacity", [3, 9, 1000], ids=["drops", "some-drops", "no-drop"])
def test_capacity_rows_match_the_drop_rule_and_the_reference(capacity):
    experts, order, counts = _routing(7, 1500, seed=capacity)
    compact, inverse, kept, offsets = capacity_rows(experts, order, counts, capacity)
    want = capacity_rows_reference(experts, order, counts, capacity)
    for got, ref in zip((compact, inverse, kept, offsets), want, strict=True):
        assert torch.equal(got, ref)
    rows = _by_rule(experts, counts, capacity)
    assert torch.equal(inverse, rows)
    total = int(kept.sum())
    kept_rows = rows[rows >= 0]
    assert torch.equal(compact[kept_rows], torch.nonzero(rows >= 0).flatten())
    assert bool((compact[total:] == -1).all())
    assert torch.equal(kept, counts.clamp(max=capacity))
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == [sum(kept.tolist()[: e + 1]) for e in range(kept.numel())]


def test_dropless_rows_invert_the_sort_and_end_each_expert():
    experts, order, counts = _routing(9, 3000, seed=1)
    inverse, offsets = dropless_rows(order, counts)
    want_inverse, want_offsets = dropless_rows_reference(order, counts)
    assert torch.equal(inverse, want_inverse) and torch.equal(offsets, want_offsets)
    assert torch.equal(order[inverse], torch.arange(order.numel()))
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == [sum(counts.tolist()[: e + 1]) for e in range(9)]
    # The rows of each expert hold its assignments in token order.
    for expert, end in enumerate(offsets.tolist()):
        start = 0 if expert == 0 else offsets[expert - 1]
        assert torch.equal(order[start:end], torch.nonzero(experts == expert).flatten())


def test_capacity_rows_of_no_assignment():
    empty = torch.zeros(0, dtype=torch.int64)
    zeros = torch.zeros(4, dtype=torch.int64)
    compact, inverse, kept, offsets = capacity_rows(empty, empty, zeros, 2)
    assert compact.numel() == inverse.numel() == 0
    assert torch.equal(kept, zeros) and torch.equal(offsets, zeros.int())
    inverse, offsets = dropless_rows(empty, zeros)
    assert inverse.numel() == 0 and torch.equal(offsets, zeros.int())


def test_capacity_rows_reject_bad_input():
    experts, order, counts = _routing(4, 20, seed=0)
    with pytest.raises(KernelShapeError, match=r"order\.shape"):
        capacity_rows(experts, order[:-1], counts, 3)
    with pytest.raises(KernelDtypeError, match=r"counts\.dtype"):
        capacity_rows(experts, order, counts.int(), 3)
    with pytest.raises(KernelDtypeError, match=r"order\.dtype"):
        dropless_rows(order.int(), counts)
