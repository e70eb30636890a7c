"""Gluon weight-gradient kernels off the GPU: argument checks (typed errors naming the
argument), and the batched and packed weight gradients of CPU tensors staying on ``torch.bmm``
and ``torch._grouped_mm``."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.errors import KernelDeviceError, KernelShapeError, KernelValueError
from mcore_kernels.moe import expert_gemms
from mcore_kernels.moe.expert_gemms import BATCHED_PLAN, ExpertGemmRunner, ExpertGemms
from mcore_kernels.moe.gluon_wgrad import (
    GluonWeightTiles,
    gluon_k_grouped_mm,
    gluon_slot_k_grouped_mm,
)


def test_tiles_are_checked():
    with pytest.raises(KernelShapeError, match="block_n"):
        GluonWeightTiles(block_n=96)
    with pytest.raises(KernelValueError, match="stages"):
        GluonWeightTiles(stages=0)
    assert GluonWeightTiles().tile_k == 256


def test_arguments_are_checked():
    g = torch.zeros(128, 128, dtype=torch.bfloat16)
    x = torch.zeros(128, 256, dtype=torch.bfloat16)
    offsets = torch.tensor([64, 128], dtype=torch.int32)
    with pytest.raises(KernelDeviceError, match=r"g\.device"):
        gluon_k_grouped_mm(g, x, offsets)
    with pytest.raises(KernelShapeError, match="K of 256"):
        gluon_k_grouped_mm(g, x[:, :128], offsets)
    with pytest.raises(KernelShapeError, match=r"x\.shape"):
        gluon_slot_k_grouped_mm(g, x[:64], 2)


def test_batched_weight_gradients_of_cpu_tensors_stay_on_bmm(monkeypatch):
    experts, slot_rows, n, k = 2, 24, 128, 256
    monkeypatch.setattr(expert_gemms, "_GLUON_SLOT_SHAPES", {(n, k, experts): ()})
    offsets = (torch.arange(1, experts + 1) * slot_rows).to(torch.int32)
    g = torch.randn(experts * slot_rows, n)
    x = torch.randn(experts * slot_rows, k)
    got = ExpertGemmRunner(BATCHED_PLAN, offsets, experts * slot_rows).w_down(g, x)
    want = torch.bmm(g.view(experts, slot_rows, n).transpose(1, 2), x.view(experts, slot_rows, k))
    assert torch.equal(got, want)


def test_packed_weight_gradients_of_cpu_tensors_stay_on_grouped_mm(monkeypatch):
    counts = torch.tensor([5, 0, 11])
    n, k = 128, 256
    monkeypatch.setattr(expert_gemms, "_GLUON_PACKED_SHAPES", {(n, k, 3): ()})
    offsets = counts.cumsum(0).to(torch.int32)
    g = torch.randn(16, n, dtype=torch.bfloat16)
    x = torch.randn(16, k, dtype=torch.bfloat16)
    got = ExpertGemmRunner(ExpertGemms(), offsets, 16).w_gate_up(g, x)
    assert torch.equal(got, torch._grouped_mm(g.t(), x, offs=offsets))
