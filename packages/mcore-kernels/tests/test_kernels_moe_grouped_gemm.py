"""Grouped SwiGLU expert MLP (Triton, through the interpreter) against its torch reference:
values and gradients of tokens and weights, consecutive and capacity-strided groups, the fused
token gather, experts without rows, dropped assignments, and bad input."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.errors import (
    KernelDeviceError,
    KernelDtypeError,
    KernelShapeError,
    KernelValueError,
)
from mcore_kernels.moe import grouped_swiglu_mlp
from mcore_kernels.moe.grouped_gemm import GroupedTiles, grouped_swiglu_mlp_reference

pytestmark = pytest.mark.interpreter

EXPERTS, HIDDEN, FFN, TOKENS, TOP_K = 4, 48, 40, 21, 2


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=g) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, FFN, generator=g) * 0.2
    return gate_up, down


def _routing(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, expert order of the assignments, its inverse and per-expert counts; expert 1
    never chosen."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    experts = torch.tensor([0, 2, 3])[torch.randint(0, 3, (TOKENS * TOP_K,), generator=g)]
    order = torch.argsort(experts, stable=True)
    slots = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    counts = torch.bincount(experts, minlength=EXPERTS)
    return x, order, slots, counts


def _run(fn, inputs, grad_out, **kwargs):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves, **kwargs)
    out.backward(grad_out)
    return [out.detach()] + [leaf.grad for leaf in leaves]


def _assert_close(got, want):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_consecutive_groups_match_reference_with_an_empty_expert():
    gate_up, down = _weights(0)
    x, order, _, counts = _routing(1)
    rows = x.index_select(0, order // TOP_K)
    grad = torch.randn(rows.shape, generator=torch.Generator().manual_seed(2))
    got = _run(lambda r, a, b: grouped_swiglu_mlp(r, a, b, counts), (rows, gate_up, down), grad)
    want = _run(
        lambda r, a, b: grouped_swiglu_mlp_reference(r, a, b, counts), (rows, gate_up, down), grad
    )
    _assert_close(got, want)
    # The expert without rows gets exactly zero weight gradients.
    assert counts[1] == 0
    assert got[2][1].abs().max() == 0 and got[3][1].abs().max() == 0


def test_fused_gather_matches_permute_then_reference():
    gate_up, down = _weights(3)
    x, order, slots, counts = _routing(4)
    grad = torch.randn(TOKENS * TOP_K, HIDDEN, generator=torch.Generator().manual_seed(5))
    kwargs = dict(index=order, top_k=TOP_K)
    got = _run(
        lambda t, a, b: grouped_swiglu_mlp(t, a, b, counts, slots=slots, **kwargs),
        (x, gate_up, down),
        grad,
    )
    want = _run(
        lambda t, a, b: grouped_swiglu_mlp_reference(t, a, b, counts, **kwargs),
        (x, gate_up, down),
        grad,
    )
    _assert_close(got, want)


@pytest.mark.parametrize("gather", [False, True])
def test_capacity_groups_skip_padding_and_dropped_assignments(gather):
    gate_up, down = _weights(6)
    x, _, _, _ = _routing(7)
    capacity = 6
    g = torch.Generator().manual_seed(8)
    # Expert e keeps kept[e] of its capacity rows; expert 1 none, expert 3 all of them.
    kept = torch.tensor([4, 0, 2, capacity])
    num_rows = EXPERTS * capacity
    index = torch.full((num_rows,), -1, dtype=torch.int64)
    assignments = torch.randperm(TOKENS * TOP_K, generator=g)[: int(kept.sum())]
    slots = torch.full((TOKENS * TOP_K,), -1, dtype=torch.int64)
    used = 0
    for expert, size in enumerate(kept.tolist()):
        rows = torch.arange(expert * capacity, expert * capacity + size)
        index[rows] = assignments[used : used + size]
        slots[assignments[used : used + size]] = rows
        used += size
    grad = torch.randn(num_rows, HIDDEN, generator=g)
    if gather:
        inputs = (x, gate_up, down)
        kwargs = dict(capacity=capacity, index=index, top_k=TOP_K)
        got = _run(
            lambda t, a, b: grouped_swiglu_mlp(t, a, b, kept, slots=slots, **kwargs), inputs, grad
        )
    else:
        buffer = x.index_select(0, index.clamp(min=0) // TOP_K) * (index >= 0)[:, None]
        inputs = (buffer, gate_up, down)
        kwargs = dict(capacity=capacity)
        got = _run(lambda t, a, b: grouped_swiglu_mlp(t, a, b, kept, **kwargs), inputs, grad)
    want = _run(lambda t, a, b: grouped_swiglu_mlp_reference(t, a, b, kept, **kwargs), inputs, grad)
    _assert_close(got, want)
    padding = index < 0
    assert got[0][padding].abs().max() == 0
    if not gather:
        assert got[1][padding].abs().max() == 0


def test_repeated_backward_is_bitwise_equal():
    gate_up, down = _weights(9)
    x, order, slots, counts = _routing(10)
    grad = torch.randn(TOKENS * TOP_K, HIDDEN, generator=torch.Generator().manual_seed(11))

    def fn(t, a, b):
        return grouped_swiglu_mlp(t, a, b, counts, index=order, slots=slots, top_k=TOP_K)

    first = _run(fn, (x, gate_up, down), grad)
    second = _run(fn, (x, gate_up, down), grad)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_bad_input_raises_typed_errors():
    gate_up, down = _weights(12)
    x, order, slots, counts = _routing(13)
    with pytest.raises(KernelShapeError, match=r"gate_up\.shape"):
        grouped_swiglu_mlp(x, gate_up[:, :-1], down, counts)
    with pytest.raises(KernelShapeError, match=r"counts\.shape"):
        grouped_swiglu_mlp(x, gate_up, down, counts[:-1])
    with pytest.raises(KernelDtypeError, match=r"x\.dtype"):
        grouped_swiglu_mlp(x.double(), gate_up, down, counts)
    with pytest.raises(KernelDtypeError, match="index"):
        grouped_swiglu_mlp(x, gate_up, down, counts, index=order.int(), slots=slots, top_k=2)
    with pytest.raises(KernelShapeError, match="slots"):
        grouped_swiglu_mlp(x, gate_up, down, counts, index=order, top_k=2)
    with pytest.raises(KernelShapeError, match="capacity=5"):
        grouped_swiglu_mlp(x, gate_up, down, counts, capacity=5)
    with pytest.raises(KernelDeviceError, match="one device"):
        grouped_swiglu_mlp(x, gate_up, down, counts.to("meta"))
    with pytest.raises(KernelShapeError, match="block_n=48"):
        GroupedTiles(block_n=48)
    with pytest.raises(KernelValueError, match="num_warps=3"):
        GroupedTiles(num_warps=3)
