"""DistributedOptimizer: sharded state dicts, resharding across a data-parallel change,
gradient clipping and mixed precision, each against an independent reference.

Reference tolerance for trained parameters: fp32, ``atol=2e-6, rtol=1e-5`` (only the order of
the gradient summation differs from single-process ``torch.optim.AdamW``).
"""

import pytest
import torch
from torch import nn

from mcore_parallel import initialize
from mcore_parallel.distributed import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
)
from mcore_parallel.errors import OptimizerStateError, ParallelConfigError, ParallelStateError
from mcore_parallel.sharding import ShardedTensor
from mcore_parallel.testing import run_distributed

ATOL, RTOL = 2e-6, 1e-5
OPTIM = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STATE_KEYS = ("main_param", "exp_avg", "exp_avg_sq")


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 20), nn.Tanh(), nn.Linear(20, 7), nn.Linear(7, 3))


def make_batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 5, generator=generator), torch.randn(8, 3, generator=generator))
        for _ in range(steps)
    ]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def train(model, optimizer, batches, rank, world):
    norms = []
    for x, y in batches:
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        optimizer.zero_grad()
        loss_fn(model, x[rows], y[rows]).backward()
        norms.append(optimizer.step())
    model.finish_param_sync()
    return norms


def params_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.module.named_parameters()}


def assemble_global(sd) -> dict[str, torch.Tensor]:
    """All-gathers every rank's blocks into the full 1-D tensors, as a checkpoint would."""
    blocks = []
    for name, leaves in sd["param_state"].items():
        for key, leaf in leaves.items():
            blocks.append(
                (f"{name}/{key}", leaf.global_shape, leaf.global_offset, leaf.local.clone())
            )
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, blocks)
    full: dict[str, torch.Tensor] = {}
    for rank_blocks in gathered:
        for fqn, shape, offset, local in rank_blocks:
            tensor = full.setdefault(fqn, torch.full(shape, float("nan")))
            tensor[offset[0] : offset[0] + local.numel()] = local
    return full


def fill_from_global(sd, full) -> None:
    for name, leaves in sd["param_state"].items():
        for key, leaf in leaves.items():
            start = leaf.global_offset[0]
            leaf.local.copy_(full[f"{name}/{key}"][start : start + leaf.local.numel()])


def sharded_checks() -> dict[str, object]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out: dict[str, object] = {}
    batches = make_batches()
    config = DDPConfig(bucket_size=60, use_distributed_optimizer=True, overlap_grad_reduce=True)

    model = DistributedDataParallel(make_model(), config)
    optimizer = DistributedOptimizer(model, OptimizerConfig(**OPTIM))
    train(model, optimizer, batches[:2], rank, world)
    sd = optimizer.sharded_state_dict()
    out["layout"] = {
        name: {
            key: (leaf.global_shape, leaf.global_offset, leaf.local.numel(), leaf.replica_id)
            for key, leaf in leaves.items()
        }
        for name, leaves in sd["param_state"].items()
    }
    out["step"] = sd["step"]
    out["leaves_are_sharded"] = all(
        isinstance(leaf, ShardedTensor)
        for leaves in sd["param_state"].values()
        for leaf in leaves.values()
    )
    full = assemble_global(sd)
    out["global_complete"] = all(not torch.isnan(t).any() for t in full.values())
    out["main_param_equals_model"] = all(
        torch.equal(full[f"{name}/main_param"], p.detach().reshape(-1))
        for name, p in model.module.named_parameters()
    )
    train(model, optimizer, batches[2:], rank, world)
    out["continued"] = params_of(model)

    # The wrapper's state dict is the module's, synchronised, and loading keeps the buffers.
    overlapped = DistributedDataParallel(
        make_model(),
        DDPConfig(bucket_size=60, use_distributed_optimizer=True, overlap_param_gather=True),
    )
    overlapped_optimizer = DistributedOptimizer(overlapped, OptimizerConfig(**OPTIM))
    train(overlapped, overlapped_optimizer, batches[:1], rank, world)
    overlapped_optimizer.zero_grad()
    loss_fn(overlapped, *batches[1]).backward()
    overlapped_optimizer.step()  # parameters stale now: only the first all-gather in flight
    model_sd = overlapped.state_dict()
    out["state_dict_keys"] = sorted(model_sd) == sorted(overlapped.module.state_dict())
    main = assemble_global(overlapped_optimizer.sharded_state_dict())
    out["state_dict_synced"] = all(
        torch.equal(main[f"{n}/main_param"], t.reshape(-1)) for n, t in model_sd.items()
    )
    storage = [b.param_data.data_ptr() for b in overlapped.param_grad_buffers]
    overlapped.load_state_dict(make_model().state_dict())
    out["load_keeps_buffers"] = storage == [
        b.param_data.data_ptr() for b in overlapped.param_grad_buffers
    ] and all(
        torch.equal(a, b) for a, b in zip(overlapped.module.parameters(), make_model().parameters())
    )
    with pytest.raises(ParallelConfigError, match="assign=True"):
        overlapped.load_state_dict(make_model().state_dict(), assign=True)

    # Weights loaded into the wrapper after the optimizer was built are what training starts
    # from (the optimizer's fp32 main parameters follow them).
    pretrained = DistributedDataParallel(
        make_model(), DDPConfig(bucket_size=60, use_distributed_optimizer=True)
    )
    pretrained_optimizer = DistributedOptimizer(pretrained, OptimizerConfig(**OPTIM))
    pretrained.load_state_dict(make_model(seed=1).state_dict())
    train(pretrained, pretrained_optimizer, batches, rank, world)
    out["loaded_then_trained"] = params_of(pretrained)

    # Bad state dicts change nothing.
    before = optimizer.sharded_state_dict()
    snapshot = {
        n: {k: leaf.local.clone() for k, leaf in leaves.items()}
        for n, leaves in before["param_state"].items()
    }
    missing = {"step": 2, "param_state": {n: dict(v) for n, v in before["param_state"].items()}}
    first = next(iter(missing["param_state"]))
    del missing["param_state"][first]["exp_avg_sq"]
    with pytest.raises(OptimizerStateError, match="exp_avg_sq"):
        optimizer.load_sharded_state_dict(missing)
    wrong = {
        "step": 2,
        "param_state": {
            n: {k: torch.zeros(leaf.local.numel() + 1) for k, leaf in v.items()}
            for n, v in before["param_state"].items()
        },
    }
    with pytest.raises(OptimizerStateError, match="expected"):
        optimizer.load_sharded_state_dict(wrong)
    with pytest.raises(OptimizerStateError, match="step"):
        optimizer.load_sharded_state_dict({"step": -1, "param_state": before["param_state"]})
    after = optimizer.sharded_state_dict()
    out["unchanged_after_bad_load"] = all(
        torch.equal(snapshot[n][k], leaf.local)
        for n, leaves in after["param_state"].items()
        for k, leaf in leaves.items()
    )

    # Reshard dp=2 -> dp=1 (tp=2 makes a real dp group of one rank): one more step on the
    # full batch continues the dp=2 run.
    state = initialize(tp=2)
    single = DistributedDataParallel(
        make_model(), DDPConfig(bucket_size=1000, use_distributed_optimizer=True), state
    )
    single_optimizer = DistributedOptimizer(single, OptimizerConfig(**OPTIM))
    target = single_optimizer.sharded_state_dict()
    fill_from_global(target, full)
    target["step"] = sd["step"]
    single_optimizer.load_sharded_state_dict(target)
    train(single, single_optimizer, batches[2:], 0, 1)
    out["resharded_dp1"] = params_of(single)

    # Reshard dp=2 -> dp=2 with other bucket boundaries (other shard ranges).
    other = DistributedDataParallel(
        make_model(), DDPConfig(bucket_size=25, use_distributed_optimizer=True)
    )
    other_optimizer = DistributedOptimizer(other, OptimizerConfig(**OPTIM))
    target = other_optimizer.sharded_state_dict()
    fill_from_global(target, full)
    target["step"] = sd["step"]
    other_optimizer.load_sharded_state_dict(target)
    train(other, other_optimizer, batches[2:], rank, world)
    out["resharded_buckets"] = params_of(other)

    # Global-norm clipping across shards.
    clipped = DistributedDataParallel(
        make_model(), DDPConfig(bucket_size=60, use_distributed_optimizer=True)
    )
    clipped_optimizer = DistributedOptimizer(clipped, OptimizerConfig(clip_grad=0.05, **OPTIM))
    out["clip_norms"] = train(clipped, clipped_optimizer, batches, rank, world)
    out["clipped"] = params_of(clipped)

    # bf16 parameters, fp32 gradient reduction and fp32 main parameters.
    torch.manual_seed(0)
    low = DistributedDataParallel(
        make_model().to(torch.bfloat16),
        DDPConfig(bucket_size=60, use_distributed_optimizer=True, grad_reduce_in_fp32=True),
    )
    low_optimizer = DistributedOptimizer(low, OptimizerConfig(**OPTIM))
    out["main_grad_dtypes"] = {str(p.main_grad.dtype) for p in low.module.parameters()}
    low_batches = [(x.bfloat16(), y.bfloat16()) for x, y in batches]
    train(low, low_optimizer, low_batches, rank, world)
    low_sd = assemble_global(low_optimizer.sharded_state_dict())
    out["bf16_is_rounded_main"] = all(
        torch.equal(low_sd[f"{n}/main_param"].bfloat16(), p.detach().reshape(-1))
        for n, p in low.module.named_parameters()
    )
    out["main_param_dtype"] = str(low_sd[next(iter(low_sd))].dtype)
    return out


def reference(steps: int = 3, clip: float = 0.0, seed: int = 0):
    model = make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    norms = []
    for x, y in make_batches(steps):
        optimizer.zero_grad()
        loss_fn(model, x, y).backward()
        norms.append(
            float(
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
            )
        )
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}, norms


@pytest.fixture(scope="module")
def results():
    return run_distributed(sharded_checks, 2, timeout=300.0)


def assert_params_close(actual, expected, what):
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, atol=ATOL, rtol=RTOL, msg=f"{what} {key}")


def test_state_dict_blocks_tile_each_flattened_parameter(results):
    model = make_model()
    for name, param in model.named_parameters():
        for key in STATE_KEYS:
            blocks = sorted(
                (r["layout"][name][key][1][0], r["layout"][name][key][2])
                for r in results
                if r["layout"][name][key][2]
            )
            assert all(r["layout"][name][key][0] == (param.numel(),) for r in results)
            assert all(r["layout"][name][key][3] == 0 for r in results)
            covered = 0
            for offset, numel in blocks:
                assert offset == covered, (name, key, blocks)
                covered += numel
            assert covered == param.numel()


def test_state_dict_leaves_are_sharded_tensors_and_complete(results):
    for r in results:
        assert r["leaves_are_sharded"] and r["global_complete"] and r["step"] == 2
        assert r["main_param_equals_model"]


def test_continued_training_matches_reference(results):
    expected, _ = reference()
    for r in results:
        assert_params_close(r["continued"], expected, "continued")


@pytest.mark.parametrize("what", ["resharded_dp1", "resharded_buckets"])
def test_resharded_state_continues_training_exactly(results, what):
    expected, _ = reference()
    for r in results:
        assert_params_close(r[what], expected, what)


@pytest.mark.parametrize("key", ["state_dict_keys", "state_dict_synced", "load_keeps_buffers"])
def test_model_state_dict_is_synchronised_and_loads_in_place(results, key):
    assert all(r[key] for r in results)


def test_training_starts_from_weights_loaded_after_the_optimizer_was_built(results):
    expected, _ = reference(seed=1)
    for r in results:
        assert_params_close(r["loaded_then_trained"], expected, "loaded_then_trained")


def test_ddp_without_state_or_process_group_raises():
    assert not torch.distributed.is_initialized()
    with pytest.raises(ParallelStateError, match="state=None"):
        DistributedDataParallel(make_model(), DDPConfig())


def test_bad_state_dict_raises_and_changes_nothing(results):
    assert all(r["unchanged_after_bad_load"] for r in results)


def test_clipping_uses_global_norm_over_shards(results):
    expected, norms = reference(clip=0.05)
    for r in results:
        assert r["clip_norms"] == pytest.approx(norms, rel=1e-5)
        assert_params_close(r["clipped"], expected, "clipped")


def test_bf16_params_keep_fp32_main_params_and_grads(results):
    for r in results:
        assert r["main_grad_dtypes"] == {"torch.float32"}
        assert r["main_param_dtype"] == "torch.float32"
        assert r["bf16_is_rounded_main"]
