"""The Gluon d_act GEMM with the routed SwiGLU backward in its epilogue, off the GPU: argument
checks (typed errors naming the argument) and the fused experts' backward of CPU tensors staying
on the GEMM and the separate pass when the switch is on."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.errors import KernelDeviceError, KernelDtypeError, KernelShapeError
from mcore_kernels.moe import expert_gemms
from mcore_kernels.moe.expert_gemms import ExpertGemmRunner, ExpertGemms
from mcore_kernels.moe.gluon_grouped import gluon_d_act_swiglu
from mcore_kernels.moe.grouped_mm import PersistentTiles


def _args(rows=256, hidden=128, ffn=256, experts=2):
    offsets = torch.tensor([rows // 2, rows], dtype=torch.int32)[:experts]
    return (
        torch.zeros(rows, hidden, dtype=torch.bfloat16),
        torch.zeros(experts, hidden, ffn, dtype=torch.bfloat16),
        offsets,
        torch.zeros(rows, 2 * ffn, dtype=torch.bfloat16),
        torch.zeros(rows),
        torch.arange(rows),
    )


def test_arguments_are_checked():
    grad, w_down, offsets, gate_up, weights, order = _args()
    with pytest.raises(KernelDeviceError, match=r"grad\.device"):
        gluon_d_act_swiglu(grad, w_down, offsets, gate_up, weights, order)
    with pytest.raises(KernelDtypeError, match=r"gate_up\.dtype"):
        gluon_d_act_swiglu(grad, w_down, offsets, gate_up.float(), weights, order)
    with pytest.raises(KernelShapeError, match="multiple of 256"):
        gluon_d_act_swiglu(*_args(ffn=128))


def test_shape_errors_name_the_arguments():
    grad, w_down, offsets, gate_up, weights, order = _args()
    with pytest.raises(KernelShapeError, match=r"order=\(255,\)"):
        gluon_d_act_swiglu(grad, w_down, offsets, gate_up, weights, order[:-1])


def test_cpu_backward_stays_on_the_separate_pass(monkeypatch):
    monkeypatch.setattr(expert_gemms, "GLUON_D_ACT", True)
    monkeypatch.setattr(expert_gemms, "_GLUON_D_ACT_SHAPES", frozenset({(128, 256, 2)}))
    grad, w_down, offsets, gate_up, weights, order = _args()
    plan = ExpertGemms(d_act=PersistentTiles(block_m=128, block_n=256))
    run = ExpertGemmRunner(plan, offsets, grad.shape[0])
    assert run.d_act_swiglu(grad, w_down, gate_up, weights, order) is None
