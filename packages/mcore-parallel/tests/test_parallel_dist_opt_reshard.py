"""DistributedOptimizer's reshardable state dict: saved under TP=2 x DP=2, loaded under
TP=1 x DP=4 and TP=4 x DP=1; expert state saved under EP=2 loaded under EP=4 and EP=1.

One spawn of 4 gloo ranks trains a column-/row-parallel MLP for two steps, takes the
reshardable state dict, moves its blocks as a checkpoint would (every rank gets the full
global tensors and slices its blocks out of them) into optimizers of the other layouts, and
takes one more step everywhere.

References: the TP=2 run's state in the flat form (an independent code path), reassembled into
full tensors from the known tensor-parallel split of each parameter; and single-process
``torch.optim.AdamW`` on the unsharded model. Data movement is compared exactly; trained values
with ``atol=1e-6, rtol=1e-5`` (fp32; tp and dp change only the order of summations). A GPU test
repeats DP=2 -> TP=2 over NCCL on two GPUs.
"""

import pytest
import torch
from torch import nn

from mcore_parallel import initialize
from mcore_parallel.checkpointing import sharded_state_dict as module_sharded_state_dict
from mcore_parallel.distributed import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
)
from mcore_parallel.errors import OptimizerStateError, ParallelConfigError
from mcore_parallel.reshard_testing import TinyTPMLP, gather_global_tensors
from mcore_parallel.sharding import set_partition_dim
from mcore_parallel.testing import run_distributed

ATOL, RTOL = 1e-6, 1e-5
OPTIM = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STATE_KEYS = ("main_param", "exp_avg", "exp_avg_sq")
SAVED_SEEDS, OTHER_SEEDS = (1, 2), (11, 12)
BATCHES = 3
# Buckets of several parameters, so that parameters straddle data-parallel shard boundaries
# (shards are padded to 64 elements: smaller parameters would all fall into rank 0's shard).
DDP = {"bucket_size": 200, "use_distributed_optimizer": True, "overlap_grad_reduce": True}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [
        (torch.randn(8, 12, generator=generator), torch.randn(8, 10, generator=generator))
        for _ in range(BATCHES)
    ]


def train(model, optimizer, steps, dp_rank, dp) -> None:
    for x, y in steps:
        x, y = x.to(model.device), y.to(model.device)
        rows = slice(dp_rank * len(x) // dp, (dp_rank + 1) * len(x) // dp)
        optimizer.zero_grad()
        (model(x[rows]) - y[rows]).pow(2).mean().backward()
        optimizer.step()
    model.finish_param_sync()


def build(state, seeds, **optim):
    model = DistributedDataParallel(
        TinyTPMLP(state, seeds).to(state.device), DDPConfig(**DDP), state
    )
    return model, DistributedOptimizer(model, OptimizerConfig(**OPTIM, **optim))


def optimizer_blocks(sd) -> dict:
    return {
        f"{n}/{k}": leaf for n, leaves in sd["param_state"].items() for k, leaf in leaves.items()
    }


def replica_zero_counts(sd) -> dict[str, int]:
    """How many ranks of the world write each block (replica_id 0)."""
    mine = [
        (key, leaf.global_offset)
        for key, leaf in optimizer_blocks(sd).items()
        if leaf.replica_id == 0
    ]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    counts: dict[str, int] = {}
    for rank_blocks in gathered:
        for key, offset in rank_blocks:
            counts[f"{key}@{offset}"] = counts.get(f"{key}@{offset}", 0) + 1
    return counts


def straddling(flat_sd, model) -> list[str]:
    """Parameters of which this rank owns part, but not all, in the flat form."""
    sizes = {n: p.numel() for n, p in model.module.named_parameters()}
    return [
        name
        for name, leaves in flat_sd["param_state"].items()
        if 0 < leaves["main_param"].local.numel() < sizes[name]
    ]


def fill_blocks(sd, full: dict[str, torch.Tensor]) -> None:
    """Copies each block of ``sd`` out of the full tensors, as a checkpoint load does."""
    for key, leaf in optimizer_blocks(sd).items():
        index = tuple(slice(o, o + n) for o, n in zip(leaf.global_offset, leaf.local.shape))
        leaf.local.copy_(full[key][index])


def full_params(model, state) -> dict[str, torch.Tensor]:
    return gather_global_tensors(module_sharded_state_dict(model.module, state))


def reshard_checks() -> dict:
    out: dict = {}
    data = batches()
    tp2 = initialize(tp=2)
    model, optimizer = build(tp2, SAVED_SEEDS)
    train(model, optimizer, data[:2], tp2.dp_rank, tp2.dp_size)
    flat = optimizer.sharded_state_dict()
    out["flat"] = gather_global_tensors(optimizer_blocks(flat))
    out["straddling"] = straddling(flat, model)
    out["tp_rank_shapes"] = {n: tuple(p.shape) for n, p in model.module.named_parameters()}
    saved = optimizer.sharded_state_dict(reshardable=True)
    out["saved_step"] = saved["step"]
    out["saved"] = gather_global_tensors(optimizer_blocks(saved))
    out["replica_zero_counts"] = replica_zero_counts(saved)
    out["leaf_shapes_are_param_shapes"] = all(
        tuple(leaf.local.shape) == out["tp_rank_shapes"][name]
        for name, leaves in saved["param_state"].items()
        for leaf in leaves.values()
    )
    # Nothing of the gather may alias or disturb the live state: the flat form is unchanged.
    out["flat_unchanged"] = all(
        torch.equal(out["flat"][k], v)
        for k, v in gather_global_tensors(optimizer_blocks(flat)).items()
    )
    train(model, optimizer, data[2:], tp2.dp_rank, tp2.dp_size)
    out["continued"] = full_params(model, tp2)

    # A leaf of neither the local shard's nor this rank's range size fails and changes nothing.
    target = optimizer.sharded_state_dict(reshardable=True)
    before = gather_global_tensors(optimizer_blocks(optimizer.sharded_state_dict(reshardable=True)))
    first = next(iter(target["param_state"]))
    target["param_state"][first]["exp_avg"] = torch.zeros(1000)
    try:
        optimizer.load_sharded_state_dict(target)
        out["bad_leaf_error"] = None
    except OptimizerStateError as error:
        out["bad_leaf_error"] = str(error)
    after = gather_global_tensors(optimizer_blocks(optimizer.sharded_state_dict(reshardable=True)))
    out["unchanged_after_bad_load"] = all(torch.equal(before[k], after[k]) for k in before)
    tp2.destroy()

    for name, tp in (("tp1_dp4", 1), ("tp4_dp1", 4)):
        state = initialize(tp=tp)
        # The config switch makes the argument-free call (what a checkpoint library makes)
        # return the reshardable form.
        model, optimizer = build(state, OTHER_SEEDS, reshardable_state_dict=True)
        target = optimizer.sharded_state_dict()
        out[f"{name}_straddling"] = straddling(optimizer.sharded_state_dict(False), model)
        fill_blocks(target, out["saved"])
        target["step"] = saved["step"]
        optimizer.load_sharded_state_dict(target)
        out[f"{name}_loaded"] = gather_global_tensors(
            optimizer_blocks(optimizer.sharded_state_dict())
        )
        out[f"{name}_loaded_flat_shards"] = gather_global_tensors(
            optimizer_blocks(optimizer.sharded_state_dict(False))
        )
        out[f"{name}_weights"] = full_params(model, state)
        train(model, optimizer, data[2:], state.dp_rank, state.dp_size)
        out[f"{name}_continued"] = full_params(model, state)
        state.destroy()
    expert_checks(out)
    return out


EXPERTS, EXPERT_SHAPE = 4, (8, 16)


class ExpertLayer(nn.Module):
    """Stacked expert weights partitioned over ep along dim 0, and a dense router."""

    def __init__(self, state) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.router = nn.Linear(EXPERT_SHAPE[1], EXPERTS)
        local = EXPERTS // state.ep_size
        full = torch.randn(EXPERTS, *EXPERT_SHAPE, generator=torch.Generator().manual_seed(7))
        self.experts = nn.Parameter(full[state.ep_rank * local : (state.ep_rank + 1) * local])
        set_partition_dim(self.experts, 0, axis="ep")

    def loss(self, state) -> torch.Tensor:
        local = EXPERTS // state.ep_size
        weights = torch.randn(EXPERTS, *EXPERT_SHAPE, generator=torch.Generator().manual_seed(8))
        mine = weights[state.ep_rank * local : (state.ep_rank + 1) * local]
        return (self.experts * mine).pow(2).sum() + self.router.weight.tanh().sum()


def expert_checks(out: dict) -> None:
    """Expert state (reduced over expert-dp) moves from EP=2 to EP=4 and EP=1 unchanged."""
    config = DDPConfig(bucket_size=0, use_distributed_optimizer=True)
    for ep in (2, 4, 1):
        state = initialize(ep=ep)
        model = DistributedDataParallel(ExpertLayer(state), config, state)
        optimizer = DistributedOptimizer(model, OptimizerConfig(**OPTIM))
        if ep == 2:
            for _ in range(2):
                optimizer.zero_grad()
                model.module.loss(state).backward()
                optimizer.step()
            flat = optimizer.sharded_state_dict()
            out["ep_straddling"] = straddling(flat, model)
            # Dim-0 chunks flattened back to back are the flattened global tensor.
            out["ep_saved_flat"] = gather_global_tensors(optimizer_blocks(flat))
            saved = optimizer.sharded_state_dict(reshardable=True)
            out["ep_saved"] = gather_global_tensors(optimizer_blocks(saved))
            out["ep_replica_zero_counts"] = replica_zero_counts(saved)
        else:
            target = optimizer.sharded_state_dict(reshardable=True)
            fill_blocks(target, out["ep_saved"])
            target["step"] = 2
            optimizer.load_sharded_state_dict(target)
            loaded = optimizer.sharded_state_dict(reshardable=True)
            out[f"ep{ep}_loaded"] = gather_global_tensors(optimizer_blocks(loaded))
            out[f"ep{ep}_weights"] = full_params(model, state)
        state.destroy()


def reference():
    """Single-process AdamW: state after two steps, parameters after three."""
    model = TinyTPMLP(None, SAVED_SEEDS)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    params = dict(model.named_parameters())
    result = {}
    for step, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        optimizer.step()
        if step == 1:
            for name, param in params.items():
                state = optimizer.state[param]
                result[f"{name}/main_param"] = param.detach().clone()
                result[f"{name}/exp_avg"] = state["exp_avg"].clone()
                result[f"{name}/exp_avg_sq"] = state["exp_avg_sq"].clone()
    return result, {name: p.detach().clone() for name, p in params.items()}


def flat_to_full(flat: dict[str, torch.Tensor], local_shapes: dict, tp: int) -> dict:
    """The flat form's global tensor is the tp ranks' flattened shards back to back."""
    full = {}
    for key, tensor in flat.items():
        name = key.split("/")[0]
        dim = TinyTPMLP.TP_DIMS[name]
        if dim is None:
            full[key] = tensor.view(local_shapes[name])
            continue
        chunks = tensor.view(tp, -1).unbind(0)
        full[key] = torch.cat([c.view(local_shapes[name]) for c in chunks], dim=dim)
    return full


@pytest.fixture(scope="module")
def results():
    return run_distributed(reshard_checks, 4, timeout=300.0)


def test_parameters_straddle_data_parallel_shards(results):
    # Preconditions of the resharding tests: the ranges really are partial.
    assert any(r["straddling"] for r in results)
    assert any(r["tp1_dp4_straddling"] for r in results)


def test_reshardable_blocks_are_global_parameters_gathered_over_dp(results):
    for rank, result in enumerate(results):
        assert result["leaf_shapes_are_param_shapes"], rank
        expected = flat_to_full(result["flat"], result["tp_rank_shapes"], 2)
        assert result["saved"].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(result["saved"][key], value), (rank, key)


def test_reshardable_state_matches_torch_adamw(results):
    expected, _ = reference()
    for key, value in expected.items():
        torch.testing.assert_close(results[0]["saved"][key], value, atol=ATOL, rtol=RTOL, msg=key)


def test_each_reshardable_block_is_written_by_exactly_one_rank(results):
    counts = results[0]["replica_zero_counts"]
    # Split parameters: one block per tp rank; replicated ones: a single block.
    expected_blocks = sum((2 if dim is not None else 1) * 3 for dim in TinyTPMLP.TP_DIMS.values())
    assert len(counts) == expected_blocks
    assert set(counts.values()) == {1}


def test_gathering_leaves_the_live_state_unchanged(results):
    assert all(r["flat_unchanged"] for r in results)


@pytest.mark.parametrize("layout", ["tp1_dp4", "tp4_dp1"])
def test_state_saved_tp2_dp2_loads_under_other_layout_exactly(results, layout):
    for rank, result in enumerate(results):
        loaded = result[f"{layout}_loaded"]
        assert loaded.keys() == result["saved"].keys()
        for key, value in result["saved"].items():
            assert torch.equal(loaded[key], value), (rank, layout, key)
        # The flat shards (a different path through the same buffers) agree, and the model
        # weights were set from the loaded fp32 main parameters.
        local_shapes = {name: tuple(t.shape) for name, t in result[f"{layout}_weights"].items()}
        tp = 4 if layout == "tp4_dp1" else 1
        local_shapes = {
            name: tuple(s // tp if d == TinyTPMLP.TP_DIMS[name] else s for d, s in enumerate(shape))
            for name, shape in local_shapes.items()
        }
        flat = flat_to_full(result[f"{layout}_loaded_flat_shards"], local_shapes, tp)
        for key, value in result["saved"].items():
            assert torch.equal(flat[key], value), (rank, layout, key)
        for name, weight in result[f"{layout}_weights"].items():
            assert torch.equal(weight, result["saved"][f"{name}/main_param"]), (rank, name)


@pytest.mark.parametrize("layout", ["tp1_dp4", "tp4_dp1"])
def test_step_after_reshard_continues_the_original_run(results, layout):
    _, reference_params = reference()
    for rank, result in enumerate(results):
        for name, value in result["continued"].items():
            got = result[f"{layout}_continued"][name]
            torch.testing.assert_close(got, value, atol=ATOL, rtol=RTOL, msg=f"{rank} {name}")
            torch.testing.assert_close(
                got, reference_params[name], atol=ATOL, rtol=RTOL, msg=f"{rank} {name}"
            )


def test_leaf_of_wrong_size_raises_and_changes_nothing(results):
    for result in results:
        message = result["bad_leaf_error"]
        assert message is not None and "(1000,)" in message and "local shard" in message
        assert result["unchanged_after_bad_load"]


def test_reshardable_state_dict_config_must_be_bool():
    with pytest.raises(ParallelConfigError, match="reshardable_state_dict='yes'"):
        OptimizerConfig(reshardable_state_dict="yes")


def test_expert_state_blocks_are_global_expert_tensors_written_once(results):
    assert any(r["ep_straddling"] for r in results)  # expert-dp ranges really are partial
    for rank, result in enumerate(results):
        assert result["ep_saved"].keys() == result["ep_saved_flat"].keys()
        for key, flat in result["ep_saved_flat"].items():
            saved = result["ep_saved"][key]
            assert torch.equal(saved.reshape(-1), flat), (rank, key)
        experts = [k for k in result["ep_saved"] if k.startswith("experts/")]
        assert all(result["ep_saved"][k].shape == (EXPERTS, *EXPERT_SHAPE) for k in experts)
    counts = results[0]["ep_replica_zero_counts"]
    # Experts: one block per ep rank; router weight and bias: one block each.
    assert len(counts) == (2 + 2) * 3 and set(counts.values()) == {1}


@pytest.mark.parametrize("ep", [4, 1])
def test_expert_state_saved_ep2_loads_under_other_ep_exactly(results, ep):
    for rank, result in enumerate(results):
        loaded = result[f"ep{ep}_loaded"]
        assert loaded.keys() == result["ep_saved"].keys()
        for key, value in result["ep_saved"].items():
            assert torch.equal(loaded[key], value), (rank, ep, key)
        for name, weight in result[f"ep{ep}_weights"].items():
            assert torch.equal(weight, result["ep_saved"][f"{name}/main_param"]), (rank, name)


def gpu_reshard_checks() -> dict:
    """TP=1 x DP=2 -> TP=2 x DP=1 on two GPUs over NCCL."""
    out: dict = {}
    data = batches()
    dp2 = initialize()
    model, optimizer = build(dp2, SAVED_SEEDS)
    train(model, optimizer, data[:2], dp2.dp_rank, dp2.dp_size)
    out["saved"] = gather_global_tensors(
        optimizer_blocks(optimizer.sharded_state_dict(reshardable=True))
    )
    out["saved_flat"] = gather_global_tensors(optimizer_blocks(optimizer.sharded_state_dict()))
    train(model, optimizer, data[2:], dp2.dp_rank, dp2.dp_size)
    out["continued"] = full_params(model, dp2)
    dp2.destroy()
    tp2 = initialize(tp=2)
    model, optimizer = build(tp2, OTHER_SEEDS)
    target = optimizer.sharded_state_dict(reshardable=True)
    fill_blocks(target, out["saved"])
    target["step"] = 2
    optimizer.load_sharded_state_dict(target)
    out["loaded"] = gather_global_tensors(
        optimizer_blocks(optimizer.sharded_state_dict(reshardable=True))
    )
    train(model, optimizer, data[2:], tp2.dp_rank, tp2.dp_size)
    out["resharded_continued"] = full_params(model, tp2)
    tp2.destroy()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
def test_nccl_state_saved_dp2_loads_under_tp2_and_continues():
    results = run_distributed(gpu_reshard_checks, 2, backend="nccl", timeout=300.0)
    for rank, result in enumerate(results):
        # Under TP=1 the flat form's global tensors are the flattened parameters.
        for key, value in result["saved"].items():
            assert torch.equal(value.reshape(-1), result["saved_flat"][key]), (rank, key)
            assert torch.equal(result["loaded"][key], value), (rank, key)
        for name, value in result["continued"].items():
            # cuBLAS picks reduction orders per shape: ten times the CPU tolerance.
            torch.testing.assert_close(
                result["resharded_continued"][name], value, atol=1e-5, rtol=1e-4, msg=name
            )
