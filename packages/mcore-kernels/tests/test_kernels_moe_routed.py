"""Fused dropless routed experts (permute, grouped GEMMs, weighted SwiGLU, combine as one
autograd operation) through the Triton interpreter against the per-expert torch reference:
values, gradients of every input, experts that receive no token, and bitwise-equal repeats."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.moe.expert_gemms import BATCHED, BATCHED_PLAN, ExpertGemms
from mcore_kernels.moe.routed import routed_experts, routed_experts_reference

pytestmark = pytest.mark.interpreter

if not hasattr(torch, "_grouped_mm"):
    pytest.skip("torch._grouped_mm is not in this torch build", allow_module_level=True)


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _problem(tokens=24, hidden=32, ffn=16, experts=6, top_k=2, empty=(1, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    allowed = torch.tensor([e for e in range(experts) if e not in empty])
    scores = torch.rand(tokens, allowed.numel(), generator=g)
    chosen = allowed[scores.topk(top_k, dim=-1).indices]
    weights = torch.rand(tokens, top_k, generator=g).to(dtype)
    w_gu = (torch.randn(experts, 2 * ffn, hidden, generator=g) * 0.2).to(dtype)
    w_d = (torch.randn(experts, hidden, ffn, generator=g) * 0.2).to(dtype)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    counts = torch.bincount(flat, minlength=experts)
    offsets = counts.cumsum(0).to(torch.int32)
    return x, weights, w_gu, w_d, order, inverse, offsets


def _assert_close_to_reference(out, grads, ref, ref_grads):
    # Output and the four gradients against the torch reference's (bf16 tolerances).
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    for name, got, want in zip(("x", "weights", "w_gate_up", "w_down"), grads, ref_grads):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2, msg=name)


def _run(fn, x, weights, w_gu, w_d, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weights, w_gu, w_d)]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [leaf.grad for leaf in leaves]


def test_routed_experts_match_reference_with_empty_experts():
    x, weights, w_gu, w_d, order, inverse, offsets = _problem()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(x.dtype)
    out, grads = _run(
        lambda a, b, c, d: routed_experts(a, b, c, d, order, inverse, offsets),
        x,
        weights,
        w_gu,
        w_d,
        grad,
    )
    ref, ref_grads = _run(
        lambda a, b, c, d: routed_experts_reference(a, b, c, d, order, offsets),
        x,
        weights,
        w_gu,
        w_d,
        grad,
    )
    _assert_close_to_reference(out, grads, ref, ref_grads)
    # Experts 1 and 4 got no rows: their weight gradients are exactly zero.
    for expert in (1, 4):
        assert torch.count_nonzero(grads[2][expert]) == 0
        assert torch.count_nonzero(grads[3][expert]) == 0


def test_routed_experts_with_dropped_assignments_match_reference():
    # Capacity routing: each expert keeps its first 3 rows; the dropped assignments have no
    # row (inverse -1) and the rows past the kept ones hold no assignment (order -1).
    x, weights, w_gu, w_d, order, inverse, offsets = _problem(seed=9, empty=(2,))
    counts = torch.diff(offsets.long(), prepend=torch.zeros(1, dtype=torch.long))
    kept = counts.clamp(max=3)
    starts = counts.cumsum(0) - counts
    kept_starts = kept.cumsum(0) - kept
    rows = torch.full_like(order, -1)
    new_inverse = torch.full_like(inverse, -1)
    for expert in range(counts.numel()):
        for j in range(int(kept[expert])):
            assignment = order[starts[expert] + j]
            rows[kept_starts[expert] + j] = assignment
            new_inverse[assignment] = kept_starts[expert] + j
    kept_offsets = kept.cumsum(0).to(torch.int32)
    assert int((new_inverse < 0).sum()) > 0
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x.dtype)
    out, grads = _run(
        lambda a, b, c, d: routed_experts(a, b, c, d, rows, new_inverse, kept_offsets),
        x,
        weights,
        w_gu,
        w_d,
        grad,
    )
    ref, ref_grads = _run(
        lambda a, b, c, d: routed_experts_reference(a, b, c, d, rows, kept_offsets),
        x,
        weights,
        w_gu,
        w_d,
        grad,
    )
    _assert_close_to_reference(out, grads, ref, ref_grads)
    # A dropped assignment gets exactly zero weight gradient.
    dropped = (new_inverse < 0).view(weights.shape)
    assert torch.count_nonzero(grads[1][dropped]) == 0


def _slots(order, offsets, capacity):
    """Equal slots of ``capacity`` rows per expert: each expert's first ``capacity`` rows, -1
    in the empty slots; the slot of each assignment, -1 when dropped."""
    experts = offsets.numel()
    ends = offsets.long()
    starts = ends - torch.diff(ends, prepend=torch.zeros(1, dtype=torch.long))
    fillers = torch.full((experts * capacity,), -1, dtype=torch.long)
    kept = torch.full_like(order, -1)
    for expert in range(experts):
        for j in range(min(capacity, int(ends[expert] - starts[expert]))):
            assignment = order[starts[expert] + j]
            fillers[expert * capacity + j] = assignment
            kept[assignment] = expert * capacity + j
    slot_ends = (torch.arange(1, experts + 1) * capacity).to(torch.int32)
    return fillers, kept, slot_ends


@pytest.mark.parametrize("capacity", [3, 16], ids=["drops", "holds-all"])
def test_routed_experts_on_batched_slots_match_reference(capacity):
    # BATCHED: one torch.bmm per GEMM over equal slots per expert (empty slots computed as
    # zero rows). Expert 2 gets no token; at capacity 3 assignments are dropped, at 16 every
    # expert fits (padded dropless routing).
    x, weights, w_gu, w_d, order, inverse, offsets = _problem(seed=11, empty=(2,))
    fillers, kept, slot_ends = _slots(order, offsets, capacity)
    assert (int((kept < 0).sum()) > 0) == (capacity == 3)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(x.dtype)

    def batched(a, b, c, d):
        return routed_experts(a, b, c, d, fillers, kept, slot_ends, gemms=BATCHED_PLAN)

    out, grads = _run(batched, x, weights, w_gu, w_d, grad)
    ref, ref_grads = _run(
        lambda a, b, c, d: routed_experts_reference(a, b, c, d, fillers, slot_ends),
        x,
        weights,
        w_gu,
        w_d,
        grad,
    )
    _assert_close_to_reference(out, grads, ref, ref_grads)
    assert torch.count_nonzero(grads[2][2]) == 0 and torch.count_nonzero(grads[3][2]) == 0
    dropped = (kept < 0).view(weights.shape)
    assert torch.count_nonzero(grads[1][dropped]) == 0
    if capacity == 16:
        # Nothing dropped: the same results as the packed rows on torch._grouped_mm.
        packed, packed_grads = _run(
            lambda a, b, c, d: routed_experts(a, b, c, d, order, inverse, offsets),
            x,
            weights,
            w_gu,
            w_d,
            grad,
        )
        torch.testing.assert_close(out.float(), packed.float(), atol=3e-2, rtol=3e-2)
        for got, want in zip(grads, packed_grads):
            torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    again = _run(batched, x, weights, w_gu, w_d, grad)
    assert torch.equal(out, again[0])
    for a, b in zip(grads, again[1]):
        assert torch.equal(a, b)


def test_prefers_slots_only_for_the_measured_shape_on_hopper(monkeypatch):
    from mcore_kernels.moe import expert_gemms

    cpu = torch.device("cpu")
    assert not expert_gemms.prefers_slots(8192 * 8, 7168, 2048, 256, cpu)
    monkeypatch.setattr(expert_gemms, "_hopper", lambda device: True)
    # DeepSeek-V3 at 8192 tokens (256 rows per expert): yes; at 32768 tokens, or Qwen3's
    # shape: no.
    assert expert_gemms.prefers_slots(8192 * 8, 7168, 2048, 256, cpu)
    assert not expert_gemms.prefers_slots(32768 * 8, 7168, 2048, 256, cpu)
    assert not expert_gemms.prefers_slots(8192 * 8, 2048, 768, 128, cpu)


def test_batched_gemms_need_equal_slots():
    x, weights, w_gu, w_d, order, inverse, offsets = _problem(tokens=23)
    with pytest.raises(KernelShapeError, match="equal row slots"):
        routed_experts(x, weights, w_gu, w_d, order, inverse, offsets, gemms=BATCHED_PLAN)
    assert BATCHED_PLAN.slotted and ExpertGemms(w_down=BATCHED).slotted
    assert not ExpertGemms().slotted


def test_routed_experts_backward_is_bitwise_reproducible():
    x, weights, w_gu, w_d, order, inverse, offsets = _problem(seed=5, empty=())
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(x.dtype)

    def fn(a, b, c, d):
        return routed_experts(a, b, c, d, order, inverse, offsets)

    first = _run(fn, x, weights, w_gu, w_d, grad)
    second = _run(fn, x, weights, w_gu, w_d, grad)
    assert torch.equal(first[0], second[0])
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a, b)


def test_routed_experts_reject_bad_indices():
    x, weights, w_gu, w_d, order, inverse, offsets = _problem()
    with pytest.raises(KernelDtypeError, match="order"):
        routed_experts(x, weights, w_gu, w_d, order.int(), inverse, offsets)
    with pytest.raises(KernelDtypeError, match="offsets"):
        routed_experts(x, weights, w_gu, w_d, order, inverse, offsets.long())
    with pytest.raises(KernelShapeError, match="w_gate_up"):
        routed_experts(x, weights, w_gu[:, :, :-1], w_d, order, inverse, offsets)


@pytest.mark.parametrize(
    "sizes", [[0, 9, 3, 12], [20, 1, 0, 7], [7, 7, 7, 7]], ids=["first-empty", "first-long", "even"]
)
def test_cublas_loop_speculative_first_expert_prefix_equals_the_plain_loop(sizes):
    # With the group ends coming through host_ends, the first cuBLAS loop starts with expert
    # 0's GEMM over the mean rows per expert before reading the ends; rows of that prefix past
    # expert 0 are rewritten by their own expert. Every row GEMM against the per-expert
    # product, the first expert empty, longer and as long as the prefix; the backward's loops
    # (ends known by then) run plainly.
    from mcore_kernels.moe.expert_gemms import CUBLAS_LOOP_PLAN, ExpertGemmRunner

    g = torch.Generator().manual_seed(0)
    rows, experts = sum(sizes), len(sizes)
    a = torch.randn(rows, 8, generator=g)
    w = torch.randn(experts, 5, 8, generator=g)
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    ends = offsets.tolist()
    waited = []
    runner = ExpertGemmRunner(
        CUBLAS_LOOP_PLAN, offsets, rows, lambda: waited.append(1) or list(ends)
    )
    assert runner._prefix_rows(experts) == rows // experts
    out = runner.gate_up(a, w)
    assert waited == [1] and runner._prefix_rows(experts) == 0
    start = 0
    for expert, end in enumerate(ends):
        torch.testing.assert_close(out[start:end], a[start:end] @ w[expert].T)
        start = end
    plain = ExpertGemmRunner(CUBLAS_LOOP_PLAN, offsets, rows).gate_up(a, w)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("frozen", ["none", "x", "w_gate_up", "w_down"])
def test_routed_experts_on_cublas_loops_match_reference_whatever_needs_a_gradient(frozen):
    # CUBLAS_LOOP_PLAN (one GEMM per expert, the group ends read on the host): every
    # combination of needed gradients against the reference, experts 1 and 4 without tokens.
    from mcore_kernels.moe.expert_gemms import CUBLAS_LOOP_PLAN

    x, weights, w_gu, w_d, order, inverse, offsets = _problem(seed=8)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).to(x.dtype)
    index = {"x": 0, "w_gate_up": 2, "w_down": 3}.get(frozen)

    def run(fn):
        leaves = [
            t.detach().clone().requires_grad_(i != index)
            for i, t in enumerate((x, weights, w_gu, w_d))
        ]
        out = fn(*leaves)
        out.backward(grad)
        return out.detach(), [leaf.grad for leaf in leaves]

    out, grads = run(
        lambda a, b, c, d: routed_experts(
            a, b, c, d, order, inverse, offsets, gemms=CUBLAS_LOOP_PLAN
        )
    )
    ref, ref_grads = run(lambda a, b, c, d: routed_experts_reference(a, b, c, d, order, offsets))
    if index is not None:
        assert grads[index] is None and ref_grads[index] is None
        grads[index] = ref_grads[index] = torch.zeros(1)
    _assert_close_to_reference(out, grads, ref, ref_grads)
    if frozen != "w_gate_up":
        assert torch.count_nonzero(grads[2][1]) == 0 and torch.count_nonzero(grads[2][4]) == 0
