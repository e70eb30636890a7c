"""Model weights and distributed-optimizer state saved under TP=2 x DP=2 with mcore_ckpt.save,
loaded under TP=1 x DP=4, TP=4 x DP=1 and into plain tensors in one process.

One spawn of 4 gloo ranks: a column-/row-parallel MLP is trained for two steps with
DistributedDataParallel (overlapped gradient reduce and parameter all-gather) and a
DistributedOptimizer whose config asks for the reshardable state dict; the model and optimizer
objects are saved, loaded into freshly initialised models of the other layouts, and every
layout takes one more step.

References: the TP=2 run's state gathered to full tensors through the optimizer's flat form
(the flattened local shards back to back, reassembled here from each parameter's known
tensor-parallel split), compared exactly after the load; and the original run continued for
one step, compared with ``atol=1e-6, rtol=1e-5`` (fp32; the layouts differ only in the order
of summations).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mcore_ckpt
from mcore_ckpt.errors import CheckpointMismatchError
from mcore_parallel.checkpointing import sharded_state_dict as module_sharded_state_dict
from mcore_parallel.distributed import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
)
from mcore_parallel.reshard_testing import TinyTPMLP, gather_global_tensors
from mcore_parallel.state import initialize
from mcore_parallel.testing import run_distributed

ATOL, RTOL = 1e-6, 1e-5
OPTIM = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STATE_KEYS = ("main_param", "exp_avg", "exp_avg_sq")
SAVED_SEEDS, OTHER_SEEDS = (1, 2), (11, 12)
DDP = {
    "bucket_size": 200,
    "use_distributed_optimizer": True,
    "overlap_grad_reduce": True,
    "overlap_param_gather": True,
}
LAYOUTS = {"tp1_dp4": 1, "tp4_dp1": 4}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [
        (torch.randn(8, 12, generator=generator), torch.randn(8, 10, generator=generator))
        for _ in range(3)
    ]


def train(model, optimizer, steps, state) -> None:
    for x, y in steps:
        rows = slice(
            state.dp_rank * len(x) // state.dp_size, (state.dp_rank + 1) * len(x) // state.dp_size
        )
        optimizer.zero_grad()
        (model(x[rows]) - y[rows]).pow(2).mean().backward()
        optimizer.step()


def build(state, seeds, *, reshardable: bool = True):
    model = DistributedDataParallel(TinyTPMLP(state, seeds), DDPConfig(**DDP), state)
    config = OptimizerConfig(**OPTIM, reshardable_state_dict=reshardable)
    return model, DistributedOptimizer(model, config)


def full_params(model, state) -> dict[str, torch.Tensor]:
    model.finish_param_sync()
    return gather_global_tensors(module_sharded_state_dict(model.module, state))


def flat_state_as_full_tensors(optimizer, tp: int) -> dict[str, torch.Tensor]:
    """The optimizer's flat form (flattened local shards back to back) as full tensors."""
    blocks = {
        f"{name}/{key}": leaf
        for name, leaves in optimizer.sharded_state_dict(reshardable=False)["param_state"].items()
        for key, leaf in leaves.items()
    }
    full = {}
    for key, flat in gather_global_tensors(blocks).items():
        name = key.split("/")[0]
        dim, shape = TinyTPMLP.TP_DIMS[name], list(TinyTPMLP.GLOBAL_SHAPES[name])
        if dim is None:
            full[key] = flat.view(shape)
            continue
        shape[dim] //= tp
        full[key] = torch.cat([c.view(shape) for c in flat.view(tp, -1).unbind(0)], dim=dim)
    return full


def _phases(root: str) -> dict:
    out: dict = {}
    data = batches()
    tp2 = initialize(tp=2)
    model, optimizer = build(tp2, SAVED_SEEDS)
    train(model, optimizer, data[:2], tp2)
    mcore_ckpt.save(
        Path(root) / "reshardable", {"model": model.module, "optimizer": optimizer}, state=tp2
    )
    out["saved_state"] = flat_state_as_full_tensors(optimizer, 2)
    out["saved_weights"] = full_params(model, tp2)
    _, flat_optimizer = build(tp2, SAVED_SEEDS, reshardable=False)
    mcore_ckpt.save(Path(root) / "flat", {"optimizer": flat_optimizer}, state=tp2)
    train(model, optimizer, data[2:], tp2)
    out["continued"] = full_params(model, tp2)
    tp2.destroy()

    for name, tp in LAYOUTS.items():
        state = initialize(tp=tp)
        model, optimizer = build(state, OTHER_SEEDS)
        out[f"{name}_before_load"] = full_params(model, state)
        mcore_ckpt.load(
            Path(root) / "reshardable", {"model": model.module, "optimizer": optimizer}, state=state
        )
        out[f"{name}_step"] = optimizer.step_count
        out[f"{name}_state"] = flat_state_as_full_tensors(optimizer, tp)
        out[f"{name}_weights"] = full_params(model, state)
        train(model, optimizer, data[2:], state)
        out[f"{name}_continued"] = full_params(model, state)
        if tp == 4:
            try:
                mcore_ckpt.load(Path(root) / "flat", {"optimizer": optimizer})
                out["flat_into_tp4_error"] = None
            except CheckpointMismatchError as error:
                out["flat_into_tp4_error"] = str(error)
        state.destroy()
    return out


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimizer_tp_reshard")
    return root, run_distributed(_phases, 4, str(root))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_optimizer_state_saved_tp2_dp2_loads_exactly_under_other_tp(distributed, layout):
    _, results = distributed
    for rank, result in enumerate(results):
        assert result[f"{layout}_step"] == 2
        saved, loaded = result["saved_state"], result[f"{layout}_state"]
        assert loaded.keys() == saved.keys() and len(saved) == 3 * len(TinyTPMLP.TP_DIMS)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), (rank, layout, key)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_model_weights_saved_tp2_dp2_load_under_other_tp(distributed, layout):
    _, results = distributed
    for result in results:
        for name, value in result["saved_weights"].items():
            # The load is what makes them agree.
            assert not torch.equal(result[f"{layout}_before_load"][name], value), name
            assert torch.equal(result[f"{layout}_weights"][name], value), (layout, name)
            assert torch.equal(value, result["saved_state"][f"{name}/main_param"]), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_step_after_loading_under_other_tp_continues_the_original_run(distributed, layout):
    _, results = distributed
    for rank, result in enumerate(results):
        for name, value in result["continued"].items():
            torch.testing.assert_close(
                result[f"{layout}_continued"][name],
                value,
                atol=ATOL,
                rtol=RTOL,
                msg=f"rank {rank} {layout} {name}",
            )


def test_reshardable_checkpoint_holds_global_tensors_readable_in_one_process(distributed):
    root, results = distributed
    target = {
        "optimizer": {
            "step": None,
            "param_state": {
                name: {key: torch.zeros(shape) for key in STATE_KEYS}
                for name, shape in TinyTPMLP.GLOBAL_SHAPES.items()
            },
        }
    }
    mcore_ckpt.load(root / "reshardable", target)
    assert target["optimizer"]["step"] == 2
    for name, leaves in target["optimizer"]["param_state"].items():
        for key, tensor in leaves.items():
            assert torch.equal(tensor, results[0]["saved_state"][f"{name}/{key}"]), (name, key)


def test_flat_checkpoint_does_not_load_silently_under_other_tp(distributed):
    _, results = distributed
    messages = [r["flat_into_tp4_error"] for r in results]
    assert all(m is not None and "global shape" in m for m in messages)
