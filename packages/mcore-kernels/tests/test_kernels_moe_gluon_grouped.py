"""The Gluon d_act GEMM with the routed SwiGLU backward in its epilogue, off the GPU: argument
checks (typed errors naming the argument) and the fused experts' backward of CPU tensors staying
on the GEMM and the separate pass when the switch is on."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.errors import KernelDeviceError, KernelDtypeError, KernelShapeError
from mcore_kernels.moe import expert_gemms
from mcore_kernels.moe.expert_gemms import ExpertGemmRunner, ExpertGemms
from mcore_kernels.moe.gluon_d_act import gluon_d_act_swiglu
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
    with pytest.raises(KernelShapeError, match="multiple of 128"):
        gluon_d_act_swiglu(*_args(ffn=96))


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


def test_finish_kernel_adds_parts_in_order_and_zeroes_the_tail():
    from mcore_kernels.moe._launch import launch
    from mcore_kernels.moe.gluon_d_act import d_act_swiglu_finish_kernel

    rows, num_n, width2 = 70, 3, 48
    offsets = torch.tensor([20, 20, 61], dtype=torch.int32)
    order = torch.full((rows,), -1, dtype=torch.int64)
    order[:61] = torch.randperm(80)[:61]
    order[5] = -1
    part = torch.randn(rows * num_n)
    grad_w = torch.zeros(81)
    out = torch.ones(rows, width2, dtype=torch.bfloat16)
    launch(
        d_act_swiglu_finish_kernel,
        (3,),
        (part, order, offsets, 3, grad_w, out, rows, width2, 80),
        dict(NUM_N=num_n, BLOCK_R=32, BLOCK_C=32),
        device=part.device,
    )
    parts = part.view(rows, num_n)
    want = torch.zeros(80)
    for r in range(61):
        if order[r] >= 0:
            want[order[r]] = (parts[r, 0] + parts[r, 1]) + parts[r, 2]
    assert torch.equal(grad_w[:80], want)
    assert torch.count_nonzero(out[61:]) == 0 and torch.all(out[:61] == 1)
