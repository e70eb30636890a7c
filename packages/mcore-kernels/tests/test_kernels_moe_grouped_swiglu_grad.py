"""The down projection's input gradient with the routed SwiGLU's backward in its epilogue
(Triton, through the interpreter) against its torch reference and against the GEMM followed by
the separate SwiGLU pass: expert rows without an assignment, experts without rows, dropped
assignments, rows past the last expert, and the routed experts' values and gradients with the
epilogue on and off.

Float16 as in ``test_kernels_moe_grouped_mm.py`` (the interpreter reads bfloat16 tiles through
TMA descriptors wrongly)."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.moe import expert_gemms
from mcore_kernels.moe.expert_gemms import ExpertGemms
from mcore_kernels.moe.grouped_mm import PersistentTiles, m_grouped_mm
from mcore_kernels.moe.grouped_swiglu_grad import (
    m_grouped_swiglu_backward,
    m_grouped_swiglu_backward_reference,
)
from mcore_kernels.moe.routed import _routed_swiglu_backward, routed_experts

pytestmark = pytest.mark.interpreter

DTYPE = torch.float16
TILES = PersistentTiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
# Experts 0 and 3 get no rows; expert 2 spans several row tiles; 4 rows past the last expert.
COUNTS = [0, 5, 37, 0, 8, 3]
SPARE_ROWS = 4


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _randn(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DTYPE)


def _problem(hidden=32, ffn=48):
    offsets = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    rows = int(offsets[-1]) + SPARE_ROWS
    assignments = 70
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(assignments, generator=g)[:rows].clone()
    # Padding rows inside experts 2 and 4, and the rows past the last expert: no assignment.
    order[[7, 20, 44]] = -1
    order[int(offsets[-1]) :] = -1
    grad = _randn(rows, hidden, seed=2)
    w_down = _randn(len(COUNTS), hidden, ffn, seed=3, scale=0.2)
    gate_up = _randn(rows, 2 * ffn, seed=4)
    weights = torch.rand(assignments, generator=g).to(DTYPE)
    return grad, w_down, offsets, gate_up, weights, order


def test_m_grouped_swiglu_backward_matches_reference():
    grad, w_down, offsets, gate_up, weights, order = _problem()
    got_gu, got_w = m_grouped_swiglu_backward(
        grad, w_down, offsets, gate_up, weights, order, tiles=TILES
    )
    want_gu, want_w = m_grouped_swiglu_backward_reference(
        grad, w_down, offsets, gate_up, weights, order
    )
    end = int(offsets[-1])
    torch.testing.assert_close(got_gu[:end].float(), want_gu[:end].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_w.float(), want_w.float(), rtol=1e-2, atol=1e-2)
    # Expert rows without an assignment: zero gradient; assignments without a row: zero.
    assert torch.count_nonzero(got_gu[[7, 20, 44]]) == 0
    in_rows = torch.zeros(weights.shape[0], dtype=torch.bool)
    in_rows[order[order >= 0]] = True
    assert (~in_rows).any()
    assert torch.count_nonzero(got_w[~in_rows]) == 0


def test_m_grouped_swiglu_backward_equals_the_gemm_then_the_separate_pass():
    grad, w_down, offsets, gate_up, weights, order = _problem()
    got_gu, got_w = m_grouped_swiglu_backward(
        grad, w_down, offsets, gate_up, weights, order, tiles=TILES
    )
    grad_act = m_grouped_mm(grad, w_down, offsets, transpose_weight=False, tiles=TILES)
    want_gu, want_w = _routed_swiglu_backward(gate_up, weights, order, grad_act)
    end = int(offsets[-1])
    # Same GEMM tiles and the same float32 arithmetic on the rounded GEMM output.
    assert torch.equal(got_gu[:end], want_gu[:end])
    # The weights' gradient sums the columns in another order (per column tile, then tiles).
    torch.testing.assert_close(got_w.float(), want_w.float(), rtol=2e-3, atol=1e-3)


def _routed_problem(tokens=20, hidden=32, ffn=32, experts=5, top_k=2):
    g = torch.Generator().manual_seed(5)
    x = _randn(tokens, hidden, seed=6, scale=0.5)
    chosen = torch.rand(tokens, experts - 1, generator=g).topk(top_k, dim=-1).indices + 1
    weights = torch.rand(tokens, top_k, generator=g).to(DTYPE)
    w_gu = _randn(experts, 2 * ffn, hidden, seed=7, scale=0.2)
    w_d = _randn(experts, hidden, ffn, seed=8, scale=0.2)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    offsets = torch.bincount(flat, minlength=experts).cumsum(0).to(torch.int32)
    return x, weights, w_gu, w_d, order, inverse, offsets


def _run(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("d_act", [TILES, expert_gemms.GROUPED_MM], ids=["triton", "grouped_mm"])
def test_routed_experts_with_the_epilogue_on_and_off(monkeypatch, d_act):
    x, weights, w_gu, w_d, order, inverse, offsets = _routed_problem()
    grad = _randn(*x.shape, seed=9)
    plan = ExpertGemms(gate_up=TILES, down=TILES, d_act=d_act, d_x=TILES)

    def fn(*t):
        return routed_experts(*t, order, inverse, offsets, gemms=plan)

    on = _run(fn, (x, weights, w_gu, w_d), grad)
    monkeypatch.setattr(expert_gemms, "SWIGLU_GRAD_IN_D_ACT", False)
    off = _run(fn, (x, weights, w_gu, w_d), grad)
    # Output, x, w_gate_up and w_down gradients bitwise; the routing weights' gradient up to
    # its float32 summation order.
    for index in (0, 1, 3, 4):
        assert torch.equal(on[index], off[index])
    torch.testing.assert_close(on[2].float(), off[2].float(), rtol=2e-3, atol=1e-3)


def test_m_grouped_swiglu_backward_rejects_bad_input():
    grad, w_down, offsets, gate_up, weights, order = _problem()
    with pytest.raises(KernelDtypeError, match=r"gate_up\.dtype"):
        m_grouped_swiglu_backward(
            grad, w_down, offsets, gate_up.float(), weights, order, tiles=TILES
        )
    with pytest.raises(KernelDtypeError, match=r"order\.dtype"):
        m_grouped_swiglu_backward(grad, w_down, offsets, gate_up, weights, order.int(), tiles=TILES)
    with pytest.raises(KernelShapeError, match=r"gate_up\.shape"):
        m_grouped_swiglu_backward(
            grad, w_down, offsets, gate_up[:, :-16], weights, order, tiles=TILES
        )
