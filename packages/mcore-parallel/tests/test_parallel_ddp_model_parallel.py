"""DDP and DistributedOptimizer combined with expert and tensor (+ sequence) parallelism.

On 4 gloo ranks:

- ep=2 (dp=4, expert-dp=2): dense gradients are averaged over all 4 ranks, expert gradients
  (parameters marked ``set_partition_dim(..., axis="ep")``) summed over the expert-dp group
  and divided by the dense dp size; the gradient norm counts each expert once; the state dict
  of an expert parameter tiles a global tensor of ``ep x numel`` elements.
- tp=2 x dp=2 with sequence parallelism: two steps equal the plain single-process model trained
  on the full batch (``atol=2e-6, rtol=1e-5``, fp32), including the sequence-parallel bias
  whose partial gradients DDP sums over the tp group, and the norm counts tp replicas once.
"""

import math

import pytest
import torch
from _gather_tokens import GatherTokens
from torch import nn

from mcore_parallel import ColumnParallelLinear, RowParallelLinear, initialize
from mcore_parallel.distributed import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
)
from mcore_parallel.sharding import get_partition_dims, set_partition_dim
from mcore_parallel.testing import run_distributed

ATOL, RTOL = 2e-6, 1e-5
OPTIM = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


class MoENet(nn.Module):
    """A dense layer and one expert per ep rank that sees every token of its ep group."""

    def __init__(self, ep_rank: int, ep_group) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(4, 4)
        torch.manual_seed(10 + ep_rank)
        self.expert = nn.Linear(4, 4)
        for param in self.expert.parameters():
            set_partition_dim(param, 0, axis="ep")
        self.ep_group = ep_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(GatherTokens.apply(self.dense(x), self.ep_group))


def expert_checks() -> dict[str, object]:
    state = initialize(ep=2)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))

    plain = MoENet(state.ep_rank, state.ep_group)
    plain(x).pow(2).mean().backward()
    expected = {n: p.grad.clone() for n, p in plain.named_parameters()}
    for name, grad in expected.items():
        group = state.expert_dp_group if name.startswith("expert") else state.dp_cp_group
        torch.distributed.all_reduce(grad, group=group)
        grad.div_(world)
    squares = torch.tensor(
        [sum(float(g.pow(2).sum()) for n, g in expected.items() if n.startswith("expert"))]
    )
    gathered = [torch.zeros(1) for _ in range(world)]
    torch.distributed.all_gather(gathered, squares)
    dense_square = sum(float(g.pow(2).sum()) for n, g in expected.items() if n.startswith("dense"))
    # Ranks 0 and 1 hold the two distinct experts (ep ranks 0 and 1).
    expected_norm = math.sqrt(dense_square + float(gathered[0]) + float(gathered[1]))

    out: dict[str, object] = {}
    for distributed in (False, True):
        config = DDPConfig(
            bucket_size=10, use_distributed_optimizer=distributed, overlap_grad_reduce=True
        )
        model = DistributedDataParallel(MoENet(state.ep_rank, state.ep_group), config, state)
        optimizer = DistributedOptimizer(model, OptimizerConfig(**OPTIM))
        model(x).pow(2).mean().backward()
        model.finish_grad_sync()
        if not distributed:
            out["grad_errors"] = {
                n: float((p.main_grad - expected[n]).abs().max())
                for n, p in model.module.named_parameters()
            }
        out[f"norm_error_{distributed}"] = abs(optimizer.step() - expected_norm)
        sd = optimizer.sharded_state_dict()["param_state"]
        out[f"layout_{distributed}"] = {
            n: (
                leaf["exp_avg"].global_shape,
                leaf["exp_avg"].global_offset,
                leaf["exp_avg"].local.numel(),
                leaf["exp_avg"].replica_id,
            )
            for n, leaf in sd.items()
        }
    return out


def make_tp_layers(state):
    column = ColumnParallelLinear(
        6, 8, state=state, gather_output=False, sequence_parallel=state is not None, seed=1
    )
    row = RowParallelLinear(
        8, 6, state=state, input_is_parallel=True, sequence_parallel=state is not None, seed=2
    )
    return nn.Sequential(column, nn.Tanh(), row)


def tp_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    # [sequence 4, batch 4 (two per dp rank), hidden 6]
    return [torch.randn(4, 4, 6, generator=generator) for _ in range(2)]


def tp_checks() -> dict[str, object]:
    state = initialize(tp=2)
    dp_rank, tp_rank = state.dp_rank, state.tp_rank

    reference = make_tp_layers(None)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), **OPTIM)
    reference_norms = []
    for x in tp_batches():
        reference_optimizer.zero_grad()
        out = reference(x)
        # Mean over dp ranks of each dp rank's loss (sum of squares over its two samples).
        sum(out[:, 2 * d : 2 * d + 2].pow(2).sum() / out[:, :2].numel() for d in range(2)).div(
            2
        ).backward()
        reference_norms.append(
            float(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")))
        )
        reference_optimizer.step()

    model = DistributedDataParallel(
        make_tp_layers(state),
        DDPConfig(
            bucket_size=20,
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        ),
        state,
    )
    optimizer = DistributedOptimizer(model, OptimizerConfig(**OPTIM))
    norms = []
    for x in tp_batches():
        optimizer.zero_grad()
        local = x[:, 2 * dp_rank : 2 * dp_rank + 2].chunk(2, dim=0)[tp_rank]
        out = model(local)
        # This tp rank's sequence chunk; the chunk losses of the tp ranks add up.
        (out.pow(2).sum() / (out.numel() * 2)).backward()
        norms.append(optimizer.step())
    model.finish_param_sync()
    errors = {}
    for (name, param), full in zip(model.module.named_parameters(), reference.parameters()):
        dims = get_partition_dims(param)
        expected = (
            full.detach().chunk(2, dim=dims["tp"])[tp_rank] if "tp" in dims else full.detach()
        )
        errors[name] = (param.detach().clone(), expected.clone())
    return {"norms": norms, "reference_norms": reference_norms, "params": errors}


def all_checks() -> dict[str, object]:
    return {"expert": expert_checks(), "tp": tp_checks()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(all_checks, 4, timeout=300.0)


def test_expert_gradients_reduce_over_expert_dp_and_divide_by_dp(results):
    for result in results:
        for name, error in result["expert"]["grad_errors"].items():
            assert error < 1e-6, name


@pytest.mark.parametrize("distributed", [False, True])
def test_gradient_norm_counts_each_expert_once(results, distributed):
    for result in results:
        assert result["expert"][f"norm_error_{distributed}"] < 1e-5


@pytest.mark.parametrize("distributed", [False, True])
def test_expert_state_tiles_ep_times_numel(results, distributed):
    layouts = [r["expert"][f"layout_{distributed}"] for r in results]
    for name in layouts[0]:
        writers = sorted(
            (layout[name][1][0], layout[name][2])
            for layout in layouts
            if layout[name][3] == 0 and layout[name][2]
        )
        total = {"dense.weight": 16, "dense.bias": 4, "expert.weight": 32, "expert.bias": 8}[name]
        assert all(layout[name][0] == (total,) for layout in layouts)
        covered = 0
        for offset, numel in writers:
            assert offset == covered, (name, writers)
            covered += numel
        assert covered == total, (name, writers)


def test_tp_sequence_parallel_training_matches_plain_model(results):
    for result in results:
        for name, (actual, expected) in result["tp"]["params"].items():
            torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=name)


def test_gradient_norm_counts_tp_replicas_once(results):
    for result in results:
        assert result["tp"]["norms"] == pytest.approx(result["tp"]["reference_norms"], rel=1e-5)
