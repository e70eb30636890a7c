"""Fused MoE kernels (router, permute, combine, SwiGLU, the rows of the assignments in expert
order) through the Triton interpreter against their torch references: values, gradients,
experts that receive no token, dropped and padding rows, bitwise-equal repeated backward passes;
the rows also against their rules written out assignment by assignment."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.moe import (
    moe_router,
    permute_tokens,
    swiglu,
    unpermute_combine,
    unpermute_sum,
    weighted_swiglu,
)
from mcore_kernels.moe.reference import (
    moe_router_reference,
    permute_tokens_reference,
    swiglu_reference,
    unpermute_combine_reference,
    unpermute_sum_reference,
    weighted_swiglu_reference,
)
from mcore_kernels.moe.rows import (
    aligned_rows,
    aligned_rows_reference,
    capacity_rows,
    capacity_rows_reference,
    dropless_rows,
    dropless_rows_reference,
    padded_slots,
    padded_slots_reference,
)

pytestmark = pytest.mark.interpreter


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "score", "bias", "normalize", "scaling"),
    [
        (8, 2, "softmax", False, True, 1.0),
        (12, 3, "sigmoid", True, True, 2.5),
        (6, 1, "softmax", False, False, 1.0),
        (16, 4, "sigmoid", True, False, 0.5),
    ],
)
@pytest.mark.parametrize("score_grad", [True, False], ids=["weights+scores", "weights"])
def test_router_matches_reference_values_and_gradients(
    num_experts, top_k, score, bias, normalize, scaling, score_grad
):
    g = _generator(num_experts + top_k)
    logits = torch.randn(37, num_experts, generator=g)
    # Experts 0 and 1 never win: zero-token experts in the counts.
    logits[:, :2] -= 50.0
    expert_bias = torch.randn(num_experts, generator=g) * 0.1 if bias else None
    kwargs = dict(score=score, expert_bias=expert_bias, normalize=normalize, scaling=scaling)
    grad_w = torch.randn(37, top_k, generator=g)
    grad_s = torch.randn(37, num_experts, generator=g)
    results = []
    for fn in (moe_router, moe_router_reference):
        leaf = logits.clone().requires_grad_(True)
        weights, experts, scores, counts = fn(leaf, top_k, **kwargs)
        loss = (weights * grad_w).sum()
        if score_grad:
            loss = loss + (scores * grad_s).sum()
        loss.backward()
        results.append((weights.detach(), experts, scores.detach(), counts, leaf.grad))
    (w, e, s, c, dl), (rw, re, rs, rc, rdl) = results
    assert torch.equal(e, re) and torch.equal(c, rc)
    assert c[:2].sum() == 0 and c.sum() == 37 * top_k
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s, rs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dl, rdl, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "torch"])
def test_router_weights_in_their_final_dtype_equal_the_cast_float32_weights(
    dtype, kernel, monkeypatch
):
    # weights_dtype: the kernel stores the weights rounded once to bf16/fp16 and reads their
    # gradient in that dtype; bitwise the cast of the float32 weights, and the same logits
    # gradient as backpropagating through that cast. Counts int64 and exact.
    if not kernel:
        monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    g = _generator(3)
    logits = torch.randn(45, 12, generator=g)
    logits[:, :2] -= 50.0
    grad_w = torch.randn(45, 3, generator=g).to(dtype)
    results = []
    for weights_dtype in (dtype, None):
        leaf = logits.clone().requires_grad_(True)
        weights, experts, _, counts = moe_router(leaf, 3, weights_dtype=weights_dtype)
        weights = weights.to(dtype)
        assert weights.dtype == dtype and counts.dtype == torch.int64
        (weights * grad_w).sum().backward()
        results.append((weights.detach(), experts, counts, leaf.grad))
    for got, expected in zip(*results, strict=True):
        assert torch.equal(got, expected)
    assert int(results[0][2][:2].sum()) == 0 and int(results[0][2].sum()) == 45 * 3


def test_router_rejects_bad_arguments():
    logits = torch.randn(4, 8)
    with pytest.raises(KernelValueError, match="top_k=9"):
        moe_router(logits, 9)
    with pytest.raises(KernelValueError, match="score='relu'"):
        moe_router(logits, 2, score="relu")
    with pytest.raises(KernelDtypeError, match=r"logits\.dtype=torch\.bfloat16"):
        moe_router(logits.bfloat16(), 2)
    with pytest.raises(KernelShapeError, match=r"expert_bias.shape=\(7,\)"):
        moe_router(logits, 2, expert_bias=torch.zeros(7))


def _routing(num_tokens: int, top_k: int, num_experts: int, capacity: int | None, seed: int):
    """Slots/rows/fillers of a dropless (sorted) or drop-and-pad layout, built in torch."""
    g = _generator(seed)
    # Experts 0..num_experts-2 only: the last expert gets no token.
    experts = torch.stack(
        [torch.randperm(num_experts - 1, generator=g)[:top_k] for _ in range(num_tokens)]
    ).reshape(-1)
    assignments = experts.numel()
    if capacity is None:
        order = torch.argsort(experts, stable=True)
        slots = torch.empty_like(order).scatter_(0, order, torch.arange(assignments))
        return slots, order // top_k, order
    position = torch.zeros_like(experts)
    seen: dict[int, int] = {}
    for a, e in enumerate(experts.tolist()):
        position[a] = seen.get(e, 0)
        seen[e] = seen.get(e, 0) + 1
    keep = position < capacity
    slots = torch.where(keep, experts * capacity + position, -1)
    fillers = torch.full((num_experts * capacity,), -1, dtype=torch.int64)
    fillers[slots[keep]] = torch.arange(assignments)[keep]
    rows = torch.where(fillers < 0, -1, fillers // top_k)
    return slots, rows, fillers


@pytest.mark.parametrize("capacity", [None, 2], ids=["dropless", "drop-and-pad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_and_combine_match_reference_values_and_gradients(capacity, dtype):
    num_tokens, top_k, num_experts, hidden = 9, 2, 5, 40
    slots, rows, fillers = _routing(num_tokens, top_k, num_experts, capacity, seed=3)
    if capacity is not None:
        assert (slots < 0).any() and (rows < 0).any()  # drops and padding rows
    g = _generator(4)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    weights = torch.rand(num_tokens, top_k, generator=g).to(dtype)
    expert_w = torch.randn(hidden, hidden, generator=g).to(dtype) * 0.2
    grad = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    results = []
    for permute, combine in (
        (permute_tokens, unpermute_combine),
        (
            lambda x, r, s, k: permute_tokens_reference(x, r),
            lambda y, w, s, f: unpermute_combine_reference(y, w, s),
        ),
    ):
        xl = x.clone().requires_grad_(True)
        wl = weights.clone().requires_grad_(True)
        buffer = permute(xl, rows, slots, top_k)
        out = combine(buffer @ expert_w, wl, slots, fillers)
        (out.float() * grad.float()).sum().backward()
        results.append((buffer.detach(), out.detach(), xl.grad, wl.grad))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert torch.equal(results[0][0], results[1][0])
    for mine, reference in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(mine.float(), reference.float(), **tol)


def test_permute_and_combine_backward_is_bitwise_reproducible():
    slots, rows, fillers = _routing(16, 4, 6, None, seed=5)
    g = _generator(6)
    x = torch.randn(16, 24, generator=g)
    weights = torch.rand(16, 4, generator=g)
    grads = []
    for _ in range(2):
        xl, wl = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        out = unpermute_combine(permute_tokens(xl, rows, slots, 4).sin(), wl, slots, fillers)
        out.square().sum().backward()
        grads.append((xl.grad, wl.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_permute_rejects_bad_indices():
    x = torch.randn(3, 4)
    with pytest.raises(KernelDtypeError, match="rows must be a 1-D int64"):
        permute_tokens(x, torch.zeros(6, dtype=torch.int32), torch.zeros(6, dtype=torch.int64), 2)
    with pytest.raises(KernelShapeError, match=r"slots.shape=\(5,\) must be \(6,\)"):
        permute_tokens(x, torch.zeros(6, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_reference_values_and_gradients(dtype):
    g = _generator(7)
    gate_up = (torch.randn(11, 2 * 37, generator=g) * 2).to(dtype)
    grad = torch.randn(11, 37, generator=g).to(dtype)
    results = []
    for fn in (swiglu, swiglu_reference):
        leaf = gate_up.clone().requires_grad_(True)
        out = fn(leaf)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for mine, reference in zip(*results):
        torch.testing.assert_close(mine.float(), reference.float(), **tol)
    with pytest.raises(KernelShapeError, match=r"gate_up\.shape=\(11, 5\)"):
        swiglu(torch.zeros(11, 5))


@pytest.mark.parametrize("width", [37, 1500], ids=["one-block", "two-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_swiglu_matches_reference_values_and_gradients(dtype, width):
    # The row-weight gradient is a sum over the row's columns in one program (two column
    # blocks at width 1500); a row of weight 0 still gets its weight gradient.
    g = _generator(8)
    gate_up = (torch.randn(6, 2 * width, generator=g) * 2).to(dtype)
    weights = torch.rand(6, generator=g).to(dtype)
    weights[2] = 0
    grad = torch.randn(6, width, generator=g).to(dtype)
    results = []
    for fn in (weighted_swiglu, weighted_swiglu_reference):
        leaf = gate_up.clone().requires_grad_(True)
        wl = weights.clone().requires_grad_(True)
        out = fn(leaf, wl)
        out.backward(grad)
        results.append((out.detach(), leaf.grad, wl.grad))
    assert results[0][2].dtype == dtype and results[0][2][2] != 0
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    for mine, reference in zip(*results):
        torch.testing.assert_close(mine.float(), reference.float(), **tol)
    with pytest.raises(KernelShapeError, match=r"weights\.shape=\(5,\) must be \(6,\)"):
        weighted_swiglu(gate_up, weights[:5])


@pytest.mark.parametrize("capacity", [None, 2], ids=["dropless", "drop-and-pad"])
def test_unpermute_sum_matches_reference_values_and_gradients(capacity):
    num_tokens, top_k, num_experts, hidden = 9, 2, 5, 40
    slots, _, fillers = _routing(num_tokens, top_k, num_experts, capacity, seed=9)
    g = _generator(10)
    y = torch.randn(fillers.numel(), hidden, generator=g)
    grad = torch.randn(num_tokens, hidden, generator=g)
    results = []
    for combine in (
        lambda y: unpermute_sum(y, slots, fillers, top_k),
        lambda y: unpermute_sum_reference(y, slots, top_k),
    ):
        leaf = y.clone().requires_grad_(True)
        out = combine(leaf)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    for mine, reference in zip(*results):
        torch.testing.assert_close(mine, reference, atol=1e-6, rtol=1e-6)
    if capacity is not None:
        # Padding rows get no gradient.
        assert torch.equal(results[0][1][fillers < 0], torch.zeros_like(results[0][1][fillers < 0]))
    with pytest.raises(KernelShapeError, match="multiple of top_k=4"):
        unpermute_sum(y, slots, fillers, 4)


def _sorted_routing(num_experts: int, assignments: int, seed: int) -> tuple[torch.Tensor, ...]:
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
    experts, order, counts = _sorted_routing(7, 1500, seed=capacity)
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
    experts, order, counts = _sorted_routing(9, 3000, seed=1)
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


@pytest.mark.parametrize(
    ("align", "capacity"), [(1, None), (16, None), (16, 40)], ids=["1", "16", "16-drops"]
)
def test_aligned_rows_pad_every_expert_to_the_row_multiple(align, capacity):
    experts, order, counts = _sorted_routing(9, 700, seed=2 + align)
    compact, inverse, offsets = aligned_rows(experts, order, counts, align, capacity=capacity)
    want = aligned_rows_reference(experts, order, counts, align, capacity)
    for got, ref in zip((compact, inverse, offsets), want, strict=True):
        assert torch.equal(got, ref)
    assert compact.numel() == 700 + 9 * (align - 1) and offsets.dtype == torch.int32
    kept = counts if capacity is None else counts.clamp(max=capacity)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        assert (end - start) % align == 0 and end - start - int(kept[expert]) < align
        # The expert's (first kept) assignments in token order, then empty rows.
        mine = torch.nonzero(experts == expert).flatten()[: int(kept[expert])]
        assert torch.equal(compact[start : start + mine.numel()], mine)
        assert bool((compact[start + mine.numel() : end] == -1).all())
        start = end
    assert bool((compact[start:] == -1).all())
    rows = inverse >= 0
    assert int(rows.sum()) == int(kept.sum())
    assert torch.equal(compact[inverse[rows]], torch.nonzero(rows).flatten())
    with pytest.raises(KernelShapeError, match="align=0"):
        aligned_rows(experts, order, counts, 0)


def test_capacity_rows_of_no_assignment():
    empty = torch.zeros(0, dtype=torch.int64)
    zeros = torch.zeros(4, dtype=torch.int64)
    compact, inverse, kept, offsets = capacity_rows(empty, empty, zeros, 2)
    assert compact.numel() == inverse.numel() == 0
    assert torch.equal(kept, zeros) and torch.equal(offsets, zeros.int())
    inverse, offsets = dropless_rows(empty, zeros)
    assert inverse.numel() == 0 and torch.equal(offsets, zeros.int())


def test_capacity_rows_reject_bad_input():
    experts, order, counts = _sorted_routing(4, 20, seed=0)
    with pytest.raises(KernelShapeError, match=r"order\.shape"):
        capacity_rows(experts, order[:-1], counts, 3)
    with pytest.raises(KernelDtypeError, match=r"counts\.dtype"):
        capacity_rows(experts, order, counts.int(), 3)
    with pytest.raises(KernelDtypeError, match=r"order\.dtype"):
        dropless_rows(order.int(), counts)


@pytest.mark.parametrize("capacity", [2, 500], ids=["drops", "no-drop"])
def test_padded_slots_keep_the_first_assignments_of_each_key(capacity):
    # Keys 0..6 (5 and 6 without assignments), key 7 skipped: it takes no slot.
    keys, _, _ = _sorted_routing(8, 900, seed=3 + capacity)
    keys[::5] = 7
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=8)
    fillers, kept = padded_slots(keys, order, counts, capacity)
    want = padded_slots_reference(keys, order, counts, capacity)
    assert torch.equal(fillers, want[0]) and torch.equal(kept, want[1])
    seen = [0] * 8
    rule = []
    for key in keys.tolist():
        rank = seen[key]
        seen[key] += 1
        rule.append(key * capacity + rank if rank < capacity and key < 7 else -1)
    assert kept.tolist() == rule
    assert fillers.numel() == 7 * capacity
    used = kept[kept >= 0]
    assert torch.equal(fillers[used], torch.nonzero(kept >= 0).flatten())
    assert int((fillers >= 0).sum()) == used.numel()
