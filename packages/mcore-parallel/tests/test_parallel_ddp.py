"""DDP + DistributedOptimizer training equals single-process AdamW on the full batch.

Every configuration trains three steps on 2 gloo ranks (each rank sees half of the batch) and
must match ``torch.optim.AdamW`` on one process with the whole batch. Tolerance: fp32,
``atol=2e-6, rtol=1e-5`` on the parameters: the only difference is the order in which the
gradient halves are summed.
"""

import pytest
import torch
from torch import nn

from mcore_parallel.distributed import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
)
from mcore_parallel.errors import GradientNotFiniteError, ParallelConfigError, ParallelTypeError
from mcore_parallel.testing import run_distributed

STEPS = 3
ATOL, RTOL = 2e-6, 1e-5
OPTIM = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

CONFIGS = {
    "all_reduce": {},
    "all_reduce_overlap": {"overlap_grad_reduce": True},
    "avg_in_collective": {"average_in_collective": True, "overlap_grad_reduce": True},
    "dist_opt": {"use_distributed_optimizer": True},
    "dist_opt_overlap_both": {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
    "dist_opt_overlap_grads_fp32_reduce": {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "grad_reduce_in_fp32": True,
    },
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 24), nn.GELU(), nn.Linear(24, 24), nn.LayerNorm(24), nn.Linear(24, 3)
    )


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator))
        for _ in range(STEPS)
    ]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def reference_params() -> dict[str, torch.Tensor]:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    for x, y in make_batches():
        optimizer.zero_grad()
        loss_fn(model, x, y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _train(config: DDPConfig, device: str) -> dict[str, torch.Tensor]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = DistributedDataParallel(make_model().to(device), config)
    optimizer = DistributedOptimizer(model, OptimizerConfig(**OPTIM))
    for x, y in make_batches():
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        optimizer.zero_grad()
        loss_fn(model, x[rows].to(device), y[rows].to(device)).backward()
        optimizer.step()
    model.finish_param_sync()
    return {k: v.detach().cpu().clone() for k, v in model.module.named_parameters()}


def train_all_configs(device: str = "cpu") -> dict[str, dict[str, torch.Tensor]]:
    # Small buckets so that every configuration runs several collectives per step.
    return {
        name: _train(DDPConfig(bucket_size=200, **options), device)
        for name, options in CONFIGS.items()
    }


def accumulate_with_no_sync(overlap: bool) -> dict[str, object]:
    rank = torch.distributed.get_rank()
    model = DistributedDataParallel(
        make_model(), DDPConfig(bucket_size=200, overlap_grad_reduce=overlap)
    )
    x, y = make_batches()[0]
    # Rank r holds rows [4r, 4r + 4) as two micro-batches of two rows.
    micro = [
        (x[4 * rank + 2 * i : 4 * rank + 2 * i + 2], y[4 * rank + 2 * i : 4 * rank + 2 * i + 2])
        for i in range(2)
    ]
    with model.no_sync():
        (loss_fn(model, *micro[0]) / 2).backward()
    local_after_first = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
    (loss_fn(model, *micro[1]) / 2).backward()
    model.finish_grad_sync()
    return {
        "first": local_after_first,
        "synced": {n: p.main_grad.clone() for n, p in model.module.named_parameters()},
        "grad_is_none": all(p.grad is None for p in model.module.parameters()),
    }


def no_sync_runs() -> dict[bool, dict[str, object]]:
    return {overlap: accumulate_with_no_sync(overlap) for overlap in (False, True)}


def nan_gradient_error() -> str:
    model = DistributedDataParallel(make_model(), DDPConfig(check_for_nan_in_grad=True))
    x, y = make_batches()[0]
    if torch.distributed.get_rank() == 0:
        x = x.clone()
        x[0, 0] = float("nan")
    loss_fn(model, x, y).backward()
    try:
        model.finish_grad_sync()
    except GradientNotFiniteError as error:
        return str(error)
    return "no error"


def launched_during_backward() -> dict[bool, tuple[int, int]]:
    counts = {}
    for overlap in (False, True):
        model = DistributedDataParallel(
            make_model(), DDPConfig(bucket_size=200, overlap_grad_reduce=overlap)
        )
        x, y = make_batches()[0]
        loss_fn(model, x, y).backward()
        counts[overlap] = (sum(b.grad_work is not None for b in model.buckets), len(model.buckets))
        model.finish_grad_sync()
    return counts


def all_runs() -> dict[str, object]:
    # One process group for every check: spawning ranks dominates the suite's time.
    return {
        "trained": train_all_configs(),
        "no_sync": no_sync_runs(),
        "nan": nan_gradient_error(),
        "launched": launched_during_backward(),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return run_distributed(all_runs, 2)


@pytest.fixture(scope="module")
def trained(runs):
    return [r["trained"] for r in runs]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_three_steps_match_single_process_adamw(trained, name):
    expected = reference_params()
    for rank, results in enumerate(trained):
        for key, value in expected.items():
            torch.testing.assert_close(
                results[name][key], value, atol=ATOL, rtol=RTOL, msg=f"{name} rank {rank} {key}"
            )


def test_ranks_hold_identical_parameters_after_steps(trained):
    for name in CONFIGS:
        for key in trained[0][name]:
            assert torch.equal(trained[0][name][key], trained[1][name][key]), (name, key)


@pytest.fixture(scope="module")
def accumulated(runs):
    return [r["no_sync"] for r in runs]


@pytest.mark.parametrize("overlap", [False, True])
def test_no_sync_accumulates_full_batch_gradient(accumulated, overlap):
    model = make_model()
    x, y = make_batches()[0]
    loss_fn(model, x, y).backward()
    for rank in range(2):
        result = accumulated[rank][overlap]
        assert result["grad_is_none"]
        for name, param in model.named_parameters():
            torch.testing.assert_close(result["synced"][name], param.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_no_sync_runs_no_collective(accumulated, overlap):
    model = make_model()
    x, y = make_batches()[0]
    (loss_fn(model, x[:2], y[:2]) / 2).backward()
    for name, param in model.named_parameters():
        # Rank 0's gradient after the first micro-batch is its own, not averaged with rank 1.
        torch.testing.assert_close(accumulated[0][overlap]["first"][name], param.grad)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_three_steps_match_single_process_adamw_on_nccl():
    expected = reference_params()
    for rank, results in enumerate(run_distributed(train_all_configs, 2, "cuda", backend="nccl")):
        for name in CONFIGS:
            for key, value in expected.items():
                # cuBLAS sums in another order than the CPU reference.
                torch.testing.assert_close(
                    results[name][key], value, atol=1e-5, rtol=1e-4, msg=f"{name} {rank} {key}"
                )


def test_overlap_launches_every_bucket_during_backward(runs):
    for result in runs:
        launched, buckets = result["launched"][True]
        assert buckets > 1 and launched == buckets
        assert result["launched"][False] == (0, buckets)


def test_non_finite_gradient_raises_on_every_rank(runs):
    # Only rank 0 saw a NaN; after the reduction every rank holds it and raises.
    for result in runs:
        assert "NaN or Inf" in result["nan"]


def test_bucket_default_size_follows_dp():
    assert DDPConfig().resolved_bucket_size(8) == 40_000_000
    assert DDPConfig().resolved_bucket_size(64) == 64_000_000


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket_size": -1}, "bucket_size=-1"),
        ({"bucket_size": 1.5e6}, "bucket_size=1500000.0"),
        ({"overlap_param_gather": True}, "overlap_param_gather"),
    ],
)
def test_invalid_ddp_config_raises(kwargs, match):
    with pytest.raises(ParallelConfigError, match=match):
        DDPConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"lr": -1.0}, "lr=-1.0"), ({"betas": (0.9, 1.0)}, "betas"), ({"eps": 0.0}, "eps=0.0")],
)
def test_invalid_optimizer_config_raises(kwargs, match):
    with pytest.raises(ParallelConfigError, match=match):
        OptimizerConfig(**kwargs)


def test_wrapping_a_non_module_raises():
    with pytest.raises(ParallelTypeError, match=r"module must be an nn\.Module"):
        DistributedDataParallel(object(), DDPConfig(), state=None)  # type: ignore[arg-type]
