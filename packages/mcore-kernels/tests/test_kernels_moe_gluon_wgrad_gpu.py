"""Gluon weight-gradient kernels on a Hopper GPU in bfloat16: packed rows padded to 64 per
expert (experts without rows among them), packed rows of any count (masked last chunks, rows
past the last expert, non-finite rows of a neighbouring expert) and equal slots with a partial
last chunk, in each tile shape, against the torch reference; two runs bitwise equal; the batched,
aligned and packed weight gradients of a listed shape taken by the Gluon kernel."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper GPU", allow_module_level=True)

from mcore_kernels.moe import expert_gemms  # noqa: E402
from mcore_kernels.moe.expert_gemms import BATCHED_PLAN, ExpertGemmRunner, ExpertGemms  # noqa: E402
from mcore_kernels.moe.gluon_wgrad import (  # noqa: E402
    GluonWeightTiles,
    gluon_k_grouped_mm,
    gluon_slot_k_grouped_mm,
)
from mcore_kernels.moe.grouped_mm import PersistentTiles  # noqa: E402
from mcore_kernels.moe.reference import k_grouped_mm_reference  # noqa: E402

TILES = [
    GluonWeightTiles(),
    GluonWeightTiles(block_r=32, stages=6),
    GluonWeightTiles(stages=2, sync_store=True),
]
IDS = ["64-rows", "32-rows", "2-stages-sync-store"]
BF16 = dict(device="cuda", dtype=torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.float().abs().max().clamp(min=1e-6)
    assert ((got.float() - want.float()).abs().max() / scale).item() < 1e-2


@pytest.mark.parametrize("tiles", TILES, ids=IDS)
def test_packed_rows_match_reference_and_repeat_bitwise(tiles):
    counts = torch.tensor([64, 0, 192, 320, 128, 0, 64, 256])
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    rows = int(counts.sum())
    g = torch.randn(rows, 384, **BF16)
    x = torch.randn(rows, 768, **BF16)
    got = gluon_k_grouped_mm(g, x, offsets, tiles=tiles)
    _close(got, k_grouped_mm_reference(g, x, offsets))
    assert torch.count_nonzero(got[[1, 5]]) == 0
    assert torch.equal(got, gluon_k_grouped_mm(g, x, offsets, tiles=tiles))


@pytest.mark.parametrize("tiles", TILES, ids=IDS)
def test_packed_rows_of_any_count_match_reference_and_repeat_bitwise(tiles):
    counts = torch.tensor([100, 0, 1, 64, 200, 37, 0, 511])
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    rows = int(counts.sum()) + 9  # rows past the last expert (capacity routing's packed rows)
    g = torch.randn(rows, 256, **BF16)
    x = torch.randn(rows, 512, **BF16)
    # Expert 3's first rows are not finite: they fall in the last chunks of experts 0 and 2,
    # whose masking must drop them from both operands.
    g[101:106] = float("inf")
    x[106:111] = float("nan")
    keep = [0, 1, 2, 4, 5, 6, 7]
    got = gluon_k_grouped_mm(g, x, offsets, tiles=tiles, aligned=False)
    want = k_grouped_mm_reference(g, x, offsets)
    assert torch.isfinite(got[keep]).all()
    _close(got[keep], want[keep])
    assert torch.count_nonzero(got[[1, 6]]) == 0
    again = gluon_k_grouped_mm(g, x, offsets, tiles=tiles, aligned=False)
    assert torch.equal(got[keep], again[keep])


@pytest.mark.parametrize("slot_rows", [72, 312])
@pytest.mark.parametrize("tiles", TILES, ids=IDS)
def test_slots_match_batched_product(tiles, slot_rows):
    experts = 6
    g = torch.randn(experts * slot_rows, 256, **BF16)
    x = torch.randn(experts * slot_rows, 512, **BF16)
    want = torch.bmm(
        g.float().view(experts, slot_rows, -1).transpose(1, 2),
        x.float().view(experts, slot_rows, -1),
    )
    got = gluon_slot_k_grouped_mm(g, x, experts, tiles=tiles)
    _close(got, want)
    assert torch.equal(got, gluon_slot_k_grouped_mm(g, x, experts, tiles=tiles))


def test_batched_weight_gradients_of_a_listed_shape_run_on_gluon(monkeypatch):
    experts, slot_rows, n, k = 4, 320, 256, 512
    monkeypatch.setattr(expert_gemms, "_GLUON_SLOT_SHAPES", {(n, k, experts): ()})
    offsets = (torch.arange(1, experts + 1) * slot_rows).to(torch.int32).cuda()
    g = torch.randn(experts * slot_rows, n, **BF16)
    x = torch.randn(experts * slot_rows, k, **BF16)
    runner = ExpertGemmRunner(BATCHED_PLAN, offsets, experts * slot_rows)
    got = runner.w_down(g, x)
    assert torch.equal(got, gluon_slot_k_grouped_mm(g, x, experts))
    monkeypatch.setattr(expert_gemms, "GLUON_WEIGHTS", False)
    _close(got, runner.w_down(g, x))


def test_aligned_weight_gradients_of_a_listed_shape_run_on_gluon(monkeypatch):
    n, k = 256, 512
    counts = torch.tensor([128, 0, 320, 64])
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    rows = int(counts.sum())
    monkeypatch.setattr(expert_gemms, "_GLUON_ALIGNED_SHAPES", {(n, k, 4): ()})
    tiles = PersistentTiles(block_m=64, block_n=128, block_k=256, num_stages=3)
    plan = ExpertGemms(w_down=tiles, w_gate_up=tiles, row_align=64)
    g = torch.randn(rows, n, **BF16)
    x = torch.randn(rows, k, **BF16)
    got = ExpertGemmRunner(plan, offsets, rows).w_gate_up(g, x)
    assert torch.equal(got, gluon_k_grouped_mm(g, x, offsets))
    _close(got, k_grouped_mm_reference(g, x, offsets))


def test_packed_weight_gradients_of_a_listed_shape_run_on_gluon(monkeypatch):
    n, k = 256, 512
    counts = torch.tensor([130, 0, 321, 57])
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    rows = int(counts.sum())
    monkeypatch.setattr(expert_gemms, "_GLUON_PACKED_SHAPES", {(n, k, 4): ()})
    g = torch.randn(rows, n, **BF16)
    x = torch.randn(rows, k, **BF16)
    runner = ExpertGemmRunner(ExpertGemms(), offsets, rows)
    got = runner.w_gate_up(g, x)
    assert torch.equal(got, gluon_k_grouped_mm(g, x, offsets, aligned=False))
    _close(got, k_grouped_mm_reference(g, x, offsets))
    monkeypatch.setattr(expert_gemms, "GLUON_WEIGHTS", False)
    _close(got, runner.w_gate_up(g, x))
