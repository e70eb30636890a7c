"""The Gluon d_act GEMM with the routed SwiGLU backward in its epilogue on a Hopper GPU
(bfloat16): the gate/up gradient bitwise that of the GEMM followed by the separate pass (experts
without rows, rows without an assignment, rows past the last expert among them), the routing
weights' gradient within a rounding, two runs bitwise equal; the fused experts' backward with the
switch on against it off."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper GPU", allow_module_level=True)

from mcore_kernels.moe import expert_gemms  # noqa: E402
from mcore_kernels.moe.expert_gemms import ExpertGemms  # noqa: E402
from mcore_kernels.moe.gluon_d_act import gluon_d_act_swiglu  # noqa: E402
from mcore_kernels.moe.gluon_grouped import gluon_gate_up_swiglu  # noqa: E402
from mcore_kernels.moe.grouped_mm import PersistentTiles, m_grouped_mm  # noqa: E402
from mcore_kernels.moe.routed import (  # noqa: E402
    _routed_swiglu,
    _routed_swiglu_backward,
    routed_experts,
)

WIDE = PersistentTiles(block_m=128, block_n=256, block_k=64, num_stages=4, flatten=True)


def _inputs(counts, hidden, ffn, tail=0, holes=0, wdtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    counts_t = torch.tensor(counts)
    offsets = counts_t.cumsum(0).to(torch.int32).cuda()
    used = int(counts_t.sum())
    rows = used + tail
    order = torch.randperm(rows + 5, device="cuda", generator=g)[:rows].clone()
    order[used:] = -1
    if holes:
        order[torch.randperm(used, device="cuda", generator=g)[:holes]] = -1
    bf16 = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    grad = torch.randn(rows, hidden, **bf16)
    w_down = torch.randn(len(counts), hidden, ffn, **bf16) * 0.05
    gate_up = torch.randn(rows, 2 * ffn, **bf16) * 2
    weights = torch.rand(rows + 5, device="cuda", generator=g).to(wdtype)
    return grad, w_down, offsets, gate_up, weights, order


CASES = {
    "zero-row experts": dict(counts=[130, 0, 1, 64, 200, 0, 0, 127, 128, 129], hidden=256, ffn=256),
    "tail and holes": dict(
        counts=[3, 0, 255, 17, 0, 90, 300],
        hidden=512,
        ffn=512,
        tail=37,
        holes=9,
        wdtype=torch.bfloat16,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_gemm_and_separate_pass_and_repeats_bitwise(case):
    grad, w_down, offsets, gate_up, weights, order = _inputs(**CASES[case])
    grad_act = m_grouped_mm(grad, w_down, offsets, transpose_weight=False, tiles=WIDE)
    want_gu, want_w = _routed_swiglu_backward(gate_up, weights, order, grad_act)
    got_gu, got_w = gluon_d_act_swiglu(grad, w_down, offsets, gate_up, weights, order)
    assert torch.equal(got_gu, want_gu)
    assert got_w.dtype == want_w.dtype
    scale = want_w.float().abs().max()
    assert ((got_w.float() - want_w.float()).abs().max() / scale).item() < 1e-2
    again_gu, again_w = gluon_d_act_swiglu(grad, w_down, offsets, gate_up, weights, order)
    assert torch.equal(again_gu, got_gu) and torch.equal(again_w, got_w)


@pytest.mark.parametrize("case", list(CASES))
def test_gate_up_matches_gemm_and_separate_pass_and_repeats_bitwise(case):
    grad, w_down, offsets, _, weights, order = _inputs(**CASES[case])
    experts, hidden, ffn = w_down.shape
    x = grad
    w_gate_up = torch.randn(experts, 2 * ffn, hidden, device="cuda", dtype=torch.bfloat16) * 0.05
    want_gu = m_grouped_mm(x, w_gate_up, offsets, transpose_weight=True, tiles=WIDE)
    want_act = _routed_swiglu(want_gu, weights, order)
    got_gu, got_act = gluon_gate_up_swiglu(x, w_gate_up, offsets, weights, order)
    last = int(offsets[-1])
    assert torch.equal(got_gu[:last], want_gu[:last])
    assert torch.equal(got_act, want_act)
    again_gu, again_act = gluon_gate_up_swiglu(x, w_gate_up, offsets, weights, order)
    assert torch.equal(again_gu[:last], got_gu[:last]) and torch.equal(again_act, got_act)


def test_fused_experts_with_the_switch(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens, top_k, experts, hidden, ffn = 512, 4, 8, 256, 256
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    flat = torch.randint(0, experts, (tokens * top_k,), device="cuda", generator=g)
    flat[flat == 3] = 2  # an expert without rows
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device="cuda")
    offsets = torch.bincount(flat, minlength=experts).cumsum(0).to(torch.int32)
    weights = torch.rand(tokens, top_k, device="cuda", generator=g)
    w_gu = torch.randn(experts, 2 * ffn, hidden, device="cuda", dtype=torch.bfloat16) * 0.05
    w_d = torch.randn(experts, hidden, ffn, device="cuda", dtype=torch.bfloat16) * 0.05
    plan = ExpertGemms(gate_up=WIDE, down=WIDE, d_act=WIDE, d_x=WIDE)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    monkeypatch.setattr(expert_gemms, "_GLUON_D_ACT_SHAPES", frozenset({(hidden, ffn, experts)}))

    def run(on):
        monkeypatch.setattr(expert_gemms, "GLUON_D_ACT", on)
        monkeypatch.setattr(expert_gemms, "GLUON_GATE_UP", on)
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, weights, w_gu, w_d)]
        out = routed_experts(*leaves, order, inverse, offsets, gemms=plan)
        out.backward(dy)
        return [out.detach()] + [t.grad for t in leaves]

    off, on, again = run(False), run(True), run(True)
    # Output, token and expert weight gradients bitwise (the gate/up gradient is); the routing
    # weights' gradient sums its terms in another order.
    for index in (0, 1, 3, 4):
        assert torch.equal(on[index], off[index])
    scale = off[2].float().abs().max()
    assert ((on[2].float() - off[2].float()).abs().max() / scale).item() < 1e-2
    assert all(torch.equal(a, b) for a, b in zip(on, again))
