"""The d_act GEMM with the routed SwiGLU's backward in its epilogue on the GPU in bfloat16,
against the GEMM followed by the separate SwiGLU pass (Qwen3-30B-A3B's row tiles, three column
tiles per row tile, experts without rows, rows without an assignment), and two runs bitwise
equal."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.moe.grouped_mm import PersistentTiles, m_grouped_mm
from mcore_kernels.moe.grouped_swiglu_grad import m_grouped_swiglu_backward
from mcore_kernels.moe.routed import _routed_swiglu_backward

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a Hopper (or newer) GPU", allow_module_level=True)

TILES = PersistentTiles(block_m=128, block_n=256, block_k=64, num_stages=4, flatten=True)
EXPERTS, HIDDEN, FFN = 16, 512, 768


def test_epilogue_matches_the_gemm_then_the_separate_pass_and_repeats_bitwise():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 400, (EXPERTS,), generator=g)
    counts[[0, 7, EXPERTS - 1]] = 0
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    rows = int(offsets[-1])
    order = torch.randperm(rows + 50, generator=g)[:rows].cuda()
    order[::37] = -1  # padding rows inside the experts
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(rows, HIDDEN, **bf16)
    w_down = torch.randn(EXPERTS, HIDDEN, FFN, **bf16) * 0.05
    gate_up = torch.randn(rows, 2 * FFN, **bf16)
    weights = torch.rand(rows + 50, device="cuda").to(torch.bfloat16)
    grad_act = m_grouped_mm(grad, w_down, offsets, transpose_weight=False, tiles=TILES)
    want_gu, want_w = _routed_swiglu_backward(gate_up, weights, order, grad_act)
    got_gu, got_w = m_grouped_swiglu_backward(
        grad, w_down, offsets, gate_up, weights, order, tiles=TILES
    )
    # The same rounded GEMM output and float32 arithmetic (up to the compiler's contractions).
    scale = want_gu.float().abs().max()
    assert ((got_gu.float() - want_gu.float()).abs().max() / scale).item() < 1e-2
    scale = want_w.float().abs().max()
    assert ((got_w.float() - want_w.float()).abs().max() / scale).item() < 1e-2
    assert torch.count_nonzero(got_gu[::37]) == 0
    again_gu, again_w = m_grouped_swiglu_backward(
        grad, w_down, offsets, gate_up, weights, order, tiles=TILES
    )
    assert torch.equal(again_gu, got_gu) and torch.equal(again_w, got_w)
