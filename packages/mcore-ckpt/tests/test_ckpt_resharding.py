"""Resharding on 4 real gloo ranks: TP=2 x DP=2 -> TP=4 / TP=1, optimizer state DP=4 -> 2, 3, 1.

The last phases use the real DistributedDataParallel + DistributedOptimizer of mcore-parallel
with overlapped parameter all-gather: the save must force the pending all-gather, and the
optimizer state saved under DP=4 must load under DP=2 and in one process.

One spawn of 4 ranks runs every distributed phase (spawning is the expensive part); the tests
then check its results against slices of the reference tensors, and load the same checkpoints
again in this process (no torch.distributed) under further layouts.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import mcore_ckpt
from mcore_ckpt.errors import CheckpointMismatchError
from mcore_ckpt.layout import resolve_checkpoint_dir
from mcore_parallel.distributed import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
)
from mcore_parallel.sharding import ShardedTensor
from mcore_parallel.state import initialize
from mcore_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from mcore_parallel.testing import run_distributed

# name -> (shape, dtype, tensor-parallel split dimension or None for replicated)
MODEL = {
    "embedding.weight": ((8, 6), torch.float32, 0),
    "layers.0.qkv.weight": ((12, 6), torch.float32, 0),
    "layers.0.proj.weight": ((6, 12), torch.bfloat16, 1),
    "layers.0.proj.bias": ((6,), torch.float32, None),
    "layers.0.norm.weight": ((6,), torch.float32, None),
}
OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")


def reference_model() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return {
        name: torch.randn(shape, generator=generator).to(dtype)
        for name, (shape, dtype, _) in MODEL.items()
    }


def reference_optimizer_buffers() -> dict[str, torch.Tensor]:
    """Flat fp32 state buffers covering all parameters back to back, as a distributed optimizer holds them."""
    generator = torch.Generator().manual_seed(99)
    numel = sum(math.prod(shape) for shape, _, _ in MODEL.values())
    return {key: torch.randn(numel, generator=generator) for key in OPTIMIZER_KEYS}


def param_ranges() -> dict[str, tuple[int, int]]:
    ranges, start = {}, 0
    for name, (shape, _, _) in MODEL.items():
        ranges[name] = (start, start + math.prod(shape))
        start += math.prod(shape)
    return ranges


def tp_shard(full: dict[str, torch.Tensor], tp_rank: int, tp: int, dp_rank: int) -> dict:
    """This rank's model blocks under tensor parallelism tp (replicas get replica_id > 0)."""
    out = {}
    for name, (shape, _, dim) in MODEL.items():
        tensor = full[name]
        if dim is None:
            out[name] = ShardedTensor(
                tensor.clone(), shape, (0,) * len(shape), replica_id=tp_rank + tp * dp_rank
            )
            continue
        size = shape[dim] // tp
        offset = [0] * len(shape)
        offset[dim] = tp_rank * size
        block = tensor.narrow(dim, tp_rank * size, size).clone()
        out[name] = ShardedTensor(block, shape, tuple(offset), replica_id=dp_rank)
    return out


def dp_shard_optimizer(buffers: dict[str, torch.Tensor], dp_rank: int, dp: int) -> dict:
    """This rank's range of the flat state buffers, as per-parameter 1-D blocks (views)."""
    total = next(iter(buffers.values())).numel()
    per_rank = -(-total // dp)
    lo_rank, hi_rank = dp_rank * per_rank, min(total, (dp_rank + 1) * per_rank)
    state: dict = {}
    for name, (start, end) in param_ranges().items():
        lo, hi = max(start, lo_rank), min(end, hi_rank)
        if lo >= hi:
            continue
        state[name] = {
            key: ShardedTensor(buffers[key][lo:hi], (end - start,), (lo - start,))
            for key in OPTIMIZER_KEYS
        }
    return {"state": state, "step": 11}


def _locals(tree: dict) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _locals(value).items()})
        elif isinstance(value, ShardedTensor):
            out[key] = value.local
        else:
            out[key] = value
    return out


def _distributed_phases(root: str) -> dict:
    state = initialize(tp=2)
    rank = state.rank
    reference = reference_model()
    results: dict = {"tp_rank": state.tp_rank, "dp_rank": state.dp_rank}

    tp_root = Path(root) / "tp"
    saved = {"model": tp_shard(reference, state.tp_rank, 2, state.dp_rank), "iteration": 7}
    mcore_ckpt.save(tp_root, saved, state=state)
    mcore_ckpt.save(Path(root) / "tp_model", {"model": TPBlock(state, SAVED_SEEDS)}, state=state)

    zeros = {name: torch.zeros_like(t) for name, t in reference.items()}
    as_tp4 = {"model": tp_shard(zeros, rank, 4, 0)}
    mcore_ckpt.load(tp_root, as_tp4)
    results["tp4"] = _locals(as_tp4)

    as_tp1 = {"model": {name: t.clone() for name, t in zeros.items()}, "iteration": None}
    mcore_ckpt.load(tp_root, as_tp1)
    results["tp1"] = _locals(as_tp1)

    # A key missing on one rank only must fail on every rank instead of hanging the others.
    wrong = {"model": {"embedding.weight": zeros["embedding.weight"].clone()}}
    if rank == 1:
        wrong = {"model": {"missing.weight": torch.zeros(3)}}
    try:
        mcore_ckpt.load(tp_root, wrong)
        results["mismatch_error"] = None
    except CheckpointMismatchError as error:
        results["mismatch_error"] = str(error)

    buffers = reference_optimizer_buffers()
    live = {key: t.clone() for key, t in buffers.items()}
    handle = mcore_ckpt.save(
        Path(root) / "opt", {"optimizer": dp_shard_optimizer(live, rank, 4)}, async_save=True
    )
    for tensor in live.values():  # changes after save() returned must not reach the checkpoint
        tensor.add_(1000.0)
    handle.wait()

    target = {key: torch.zeros_like(t) for key, t in buffers.items()}
    as_dp2 = {"optimizer": dp_shard_optimizer(target, rank % 2, 2)}
    mcore_ckpt.load(Path(root) / "opt", as_dp2)
    results["dp2"] = _locals(as_dp2)
    state.destroy()
    results.update(_distributed_optimizer_phases(root))

    tp4 = initialize(tp=4)
    block = TPBlock(tp4, OTHER_SEEDS)
    mcore_ckpt.load(Path(root) / "tp_model", {"model": block}, state=tp4)
    with torch.no_grad():
        results["tp4_model_output"] = block(TOKENS)
    tp4.destroy()
    return results


SAVED_SEEDS, OTHER_SEEDS = (1, 2, 3), (11, 12, 13)
TOKENS = torch.tensor([[0, 5, 9, 15], [3, 3, 12, 7]])


class TPBlock(nn.Module):
    """Embedding -> column-parallel -> row-parallel -> LayerNorm, split over the tp group."""

    def __init__(self, state, seeds: tuple[int, int, int]) -> None:
        super().__init__()
        self.embedding = VocabParallelEmbedding(16, 8, state=state, seed=seeds[0])
        self.fc1 = ColumnParallelLinear(8, 12, state=state, gather_output=False, seed=seeds[1])
        self.fc2 = RowParallelLinear(12, 8, state=state, input_is_parallel=True, seed=seeds[2])
        self.norm = nn.LayerNorm(8)
        with torch.no_grad():
            self.norm.weight.copy_(torch.linspace(0.5, 1.5, 8) * seeds[0])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(torch.tanh(self.fc1(self.embedding(tokens)))))


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 20), nn.Tanh(), nn.Linear(20, 7), nn.Linear(7, 3))


DDP_CONFIG = {
    "bucket_size": 60,
    "use_distributed_optimizer": True,
    "overlap_grad_reduce": True,
    "overlap_param_gather": True,
}
OPTIM = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _distributed_optimizer_phases(root: str) -> dict:
    results: dict = {}
    dp4 = initialize()
    model = DistributedDataParallel(make_mlp(), DDPConfig(**DDP_CONFIG), state=dp4)
    optimizer = DistributedOptimizer(model, OptimizerConfig(**OPTIM))
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        x, y = torch.randn(8, 5, generator=generator), torch.randn(8, 3, generator=generator)
        rows = slice(2 * dp4.rank, 2 * dp4.rank + 2)
        optimizer.zero_grad()
        (model(x[rows]) - y[rows]).pow(2).mean().backward()
        optimizer.step()
    # The all-gather of the updated parameters is still pending (overlapped with the next
    # forward): saving the DDP model alone must force it.
    results["stale_before_save"] = any(b.param_stale for b in model.buckets)
    mcore_ckpt.save(Path(root) / "weights", {"model": model}, state=dp4)
    mcore_ckpt.save(
        Path(root) / "dist_opt", {"model": model.module, "optimizer": optimizer}, state=dp4
    )
    dp4.destroy()

    dp2 = initialize(tp=2)  # dp=2 groups {0, 2} and {1, 3}
    model = DistributedDataParallel(make_mlp(), DDPConfig(**DDP_CONFIG), state=dp2)
    optimizer = DistributedOptimizer(model, OptimizerConfig(**OPTIM))
    mcore_ckpt.load(
        Path(root) / "dist_opt", {"model": model.module, "optimizer": optimizer}, state=dp2
    )
    model.finish_param_sync()
    loaded = optimizer.sharded_state_dict()
    results["dp2_step"] = loaded["step"]
    results["dp2_blocks"] = {
        f"{name}.{key}": (leaf.global_offset[0], leaf.local.clone())
        for name, leaves in loaded["param_state"].items()
        for key, leaf in leaves.items()
    }
    results["dp2_params"] = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    dp2.destroy()
    return results


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    root = tmp_path_factory.mktemp("resharding")
    return root, run_distributed(_distributed_phases, 4, str(root))


def _expected_block(name: str, tp_rank: int, tp: int) -> torch.Tensor:
    shape, _, dim = MODEL[name]
    full = reference_model()[name]
    if dim is None:
        return full
    size = shape[dim] // tp
    return full.narrow(dim, tp_rank * size, size)


def test_tp2_dp2_checkpoint_loads_as_tp4_blocks(distributed):
    _, results = distributed
    for rank, result in enumerate(results):
        for name in MODEL:
            got = result["tp4"][f"model.{name}"]
            assert torch.equal(got, _expected_block(name, rank, 4)), (rank, name)


def test_tp2_dp2_checkpoint_loads_as_tp1_full_tensors(distributed):
    _, results = distributed
    reference = reference_model()
    for result in results:
        for name in MODEL:
            assert torch.equal(result["tp1"][f"model.{name}"], reference[name]), name
        assert result["tp1"]["iteration"] == 7


def test_dp_replicas_and_tp_replicated_tensors_are_written_once(distributed):
    root, _ = distributed
    info = mcore_ckpt.read_checkpoint_info(resolve_checkpoint_dir(root / "tp"))
    for name, (_, _, dim) in MODEL.items():
        assert len(info.tensors[f"model.{name}"].chunks) == (1 if dim is None else 2), name
    assert info.layout == {"world_size": 4, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "dp": 2}


def test_multi_rank_checkpoint_loads_in_a_single_process(distributed):
    root, _ = distributed
    reference = reference_model()
    target = {"model": {name: torch.zeros_like(t) for name, t in reference.items()}}
    mcore_ckpt.load(root / "tp", target)
    for name in MODEL:
        assert torch.equal(target["model"][name], reference[name]), name


def test_key_missing_on_one_rank_fails_on_every_rank(distributed):
    _, results = distributed
    messages = [r["mismatch_error"] for r in results]
    assert all(m is not None for m in messages)
    assert "missing.weight" in messages[1]
    assert all("rank 1" in m for i, m in enumerate(messages) if i != 1)


def test_optimizer_state_saved_dp4_async_loads_as_dp2_with_values_at_save(distributed):
    _, results = distributed
    buffers = reference_optimizer_buffers()
    expected_dp2 = [_locals({"optimizer": dp_shard_optimizer(buffers, r, 2)}) for r in (0, 1)]
    for rank, result in enumerate(results):
        got = result["dp2"]
        expected = expected_dp2[rank % 2]
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[key], value), (rank, key)
            else:
                assert got[key] == value


@pytest.mark.parametrize("dp", [1, 3])
def test_optimizer_state_saved_dp4_loads_as_other_dp_in_one_process(distributed, dp):
    root, _ = distributed
    buffers = reference_optimizer_buffers()
    for dp_rank in range(dp):
        target = {
            "optimizer": dp_shard_optimizer(
                {k: torch.zeros_like(t) for k, t in buffers.items()}, dp_rank, dp
            )
        }
        mcore_ckpt.load(root / "opt", target)
        expected = _locals({"optimizer": dp_shard_optimizer(buffers, dp_rank, dp)})
        for key, value in _locals(target).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, expected[key]), (dp_rank, key)


def _saved_optimizer_in_one_process(root: Path) -> dict:
    names = [name for name, _ in make_mlp().named_parameters()]
    shapes = dict((n, p.shape) for n, p in make_mlp().named_parameters())
    target = {
        "model": {name: torch.zeros(shapes[name]) for name in names},
        "optimizer": {
            "step": None,
            "param_state": {
                name: {
                    key: torch.zeros(shapes[name].numel())
                    for key in ("main_param", "exp_avg", "exp_avg_sq")
                }
                for name in names
            },
        },
    }
    mcore_ckpt.load(root / "dist_opt", target)
    return target


def test_saving_a_ddp_model_forces_its_pending_param_all_gather(distributed):
    root, results = distributed
    assert all(r["stale_before_save"] for r in results)  # the case under test did arise
    saved = _saved_optimizer_in_one_process(root)
    weights = {name: torch.zeros_like(t) for name, t in saved["model"].items()}
    mcore_ckpt.load(root / "weights", {"model": weights})
    for name, tensor in weights.items():
        main = saved["optimizer"]["param_state"][name]["main_param"]
        assert torch.equal(tensor.reshape(-1), main), name
        assert torch.equal(saved["model"][name], tensor), name


def test_distributed_optimizer_state_saved_under_dp4_loads_under_dp2(distributed):
    root, results = distributed
    saved = _saved_optimizer_in_one_process(root)
    assert saved["optimizer"]["step"] == 2
    for result in results:
        assert result["dp2_step"] == 2
        for fqn, (offset, local) in result["dp2_blocks"].items():
            name, key = fqn.rsplit(".", 1)
            full = saved["optimizer"]["param_state"][name][key]
            assert torch.equal(local, full[offset : offset + local.numel()]), fqn
        for name, param in result["dp2_params"].items():
            assert torch.equal(param, saved["model"][name]), name


def test_tp2_model_of_real_tp_layers_loads_under_tp4_and_computes_the_same(distributed):
    _, results = distributed
    with torch.no_grad():
        expected = TPBlock(None, SAVED_SEEDS)(TOKENS)
        before_load = TPBlock(None, OTHER_SEEDS)(TOKENS)
    assert not torch.allclose(before_load, expected)  # the load is what makes them agree
    for rank, result in enumerate(results):
        torch.testing.assert_close(
            result["tp4_model_output"], expected, atol=1e-6, rtol=1e-5, msg=f"rank {rank}"
        )


def test_tp2_model_of_real_tp_layers_loads_into_a_single_process_model(distributed):
    root, _ = distributed
    block = TPBlock(None, OTHER_SEEDS)
    mcore_ckpt.load(root / "tp_model", {"model": block})
    with torch.no_grad():
        torch.testing.assert_close(
            block(TOKENS), TPBlock(None, SAVED_SEEDS)(TOKENS), atol=1e-6, rtol=1e-5
        )
