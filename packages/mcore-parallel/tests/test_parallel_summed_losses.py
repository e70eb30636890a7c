"""Summed (not averaged) losses: the schedule's ``average_microbatches=False`` and DDP's
``average_over_data_parallel=False`` give the gradient of the sum of every rank's microbatch
losses, against autograd on one process; a tied copy marked ``pipeline_shared_copy`` is counted
once in the distributed optimizer's gradient norm."""

import torch
from torch import nn

from mcore_parallel.distributed import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
)
from mcore_parallel.pipeline.schedules import forward_backward
from mcore_parallel.state import initialize
from mcore_parallel.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(3, 4, generator=generator) for _ in range(4)]


def _loss(output: torch.Tensor, _: object) -> torch.Tensor:
    return output.pow(2).sum()


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    sum(_loss(model(x), None) for x in _batches()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _summed_over_two_ranks() -> dict[str, torch.Tensor]:
    state = initialize()
    config = DDPConfig(average_over_data_parallel=False)
    model = DistributedDataParallel(_model(), config, state)
    rank = torch.distributed.get_rank()
    mine = _batches()[rank * 2 : rank * 2 + 2]  # two microbatches per rank
    forward_backward(
        model,
        mine,
        loss_func=_loss,
        no_sync=model.no_sync,
        average_microbatches=False,
    )
    model.finish_grad_sync()
    full = {name: p.main_grad.clone() for name, p in model.module.named_parameters()}
    state.destroy()
    return full


def test_summed_microbatches_and_ranks_equal_the_gradient_of_the_sum():
    expected = _reference()
    for grads in run_distributed(_summed_over_two_ranks, 2):
        for name, value in expected.items():
            torch.testing.assert_close(grads[name], value, atol=1e-6, rtol=1e-5)


def test_averaged_microbatches_stay_the_default():
    model = _model()
    forward_backward(model, _batches(), loss_func=_loss)
    expected = _reference()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name] / 4)


def _norm_with_a_shared_copy() -> tuple[float, float]:
    state = initialize()
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model[1].weight.copy_(model[0].weight)
    model[1].weight.pipeline_shared_copy = True
    ddp = DistributedDataParallel(model, DDPConfig(use_distributed_optimizer=True), state)
    optimizer = DistributedOptimizer(ddp, OptimizerConfig(lr=0.0, clip_grad=0.0))
    torch.manual_seed(1)
    ddp(torch.randn(2, 4)).sum().backward()
    expected = float(model[0].weight.main_grad.norm())
    norm = optimizer.step()
    state.destroy()
    return norm, expected


def test_a_pipeline_shared_copy_counts_once_in_the_gradient_norm():
    norm, first_copy_only = run_distributed(_norm_with_a_shared_copy, 1)[0]
    assert abs(norm - first_copy_only) < 1e-5
