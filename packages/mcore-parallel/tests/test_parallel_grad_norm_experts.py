"""Gradient norm over exactly the groups that shard the gradients, and expert training.

1. World 4, two independent 2-rank models (DDP over a ``ProcessGroup``): each pair's clipped
   steps equal single-process AdamW with ``clip_grad_norm_`` on its own data, although the
   pairs take different numbers of steps (a norm reduced over the world would hang or mix the
   models).
2. World 4 with ep=2 (dp=4, expert_dp=2): a hand-written MoE layer (replicated router, two
   experts per ep rank, tokens exchanged by all-gather / reduce-scatter over the ep group)
   trained under DDP + DistributedOptimizer equals single-process AdamW on the full batch, for
   the dense router and every expert.

Tolerance: fp32 ``atol=5e-6, rtol=1e-5`` (gradient summation order only).
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel import initialize
from mcore_parallel.distributed import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
)
from mcore_parallel.sharding import set_partition_dim
from mcore_parallel.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mcore_parallel.testing import run_distributed

ATOL, RTOL = 5e-6, 1e-5
OPTIM = {"lr": 0.02, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.05}


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def pair_data(pair: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(10 + pair)
    return [
        (torch.randn(6, 4, generator=generator), 3 * torch.randn(6, 2, generator=generator))
        for _ in range(steps)
    ]


STEPS = {0: 3, 1: 1}  # the two pairs take different numbers of steps
CLIP = 0.05


def subset_world() -> dict:
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair, index = rank // 2, rank % 2
    model = DistributedDataParallel(
        make_mlp(pair),
        DDPConfig(bucket_size=20, use_distributed_optimizer=True, overlap_grad_reduce=True),
        groups[pair],
    )
    optimizer = DistributedOptimizer(model, OptimizerConfig(**OPTIM, clip_grad=CLIP))
    norms = []
    for x, y in pair_data(pair, STEPS[pair]):
        rows = slice(index * 3, index * 3 + 3)
        optimizer.zero_grad()
        (model(x[rows]) - y[rows]).pow(2).mean().backward()
        norms.append(optimizer.step())
    model.finish_param_sync()
    dist.barrier()
    return {
        "pair": pair,
        "norms": norms,
        "params": {k: v.detach().clone() for k, v in model.module.named_parameters()},
    }


def reference_pair(pair: int) -> dict:
    net = make_mlp(pair)
    optimizer = torch.optim.AdamW(net.parameters(), **OPTIM)
    norms = []
    for x, y in pair_data(pair, STEPS[pair]):
        optimizer.zero_grad()
        (net(x) - y).pow(2).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        optimizer.step()
    return {"norms": norms, "params": {k: v.detach().clone() for k, v in net.named_parameters()}}


def test_grad_norm_and_clipping_reduce_over_the_models_ranks_only():
    references = {pair: reference_pair(pair) for pair in STEPS}
    assert all(n > CLIP for ref in references.values() for n in ref["norms"]), "must clip"
    for result in run_distributed(subset_world, 4):
        want = references[result["pair"]]
        assert result["norms"] == pytest.approx(want["norms"], rel=1e-5)
        for name, value in want["params"].items():
            torch.testing.assert_close(result["params"][name], value, atol=ATOL, rtol=RTOL)


NUM_EXPERTS, HIDDEN, FFN = 4, 4, 6


class MoE(nn.Module):
    """Soft-routed experts; this rank holds experts ``[ep_rank * n, (ep_rank + 1) * n)``."""

    def __init__(self, ep_size: int, ep_rank: int, ep_group) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(HIDDEN, NUM_EXPERTS)
        up = torch.randn(NUM_EXPERTS, HIDDEN, FFN) * 0.5
        down = torch.randn(NUM_EXPERTS, FFN, HIDDEN) * 0.5
        local = slice(ep_rank * NUM_EXPERTS // ep_size, (ep_rank + 1) * NUM_EXPERTS // ep_size)
        self.up = nn.Parameter(up[local].clone())
        self.down = nn.Parameter(down[local].clone())
        for param in (self.up, self.down):
            set_partition_dim(param, 0, axis="ep")
        self.local, self.ep_group = local, ep_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)
        if self.ep_group is not None:
            x = gather_from_sequence_parallel_region(x, self.ep_group)
            probs = gather_from_sequence_parallel_region(probs, self.ep_group)
        hidden = torch.tanh(torch.einsum("th,ehf->etf", x, self.up))
        expert_out = torch.einsum("etf,efh->eth", hidden, self.down)
        out = torch.einsum("te,eth->th", probs[:, self.local], expert_out)
        if self.ep_group is not None:
            out = reduce_scatter_to_sequence_parallel_region(out, self.ep_group)
        return out


def moe_data(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(21)
    return [
        (torch.randn(8, HIDDEN, generator=generator), torch.randn(8, HIDDEN, generator=generator))
        for _ in range(steps)
    ]


def expert_training() -> dict:
    state = initialize(ep=2)
    rank, world = state.rank, state.world_size
    out: dict = {"ranks": {n: state.ranks(n) for n in ("ep", "expert_dp", "dp")}}
    for sharded in (False, True):
        model = DistributedDataParallel(
            MoE(state.size("ep"), state.rank_in("ep"), state.group("ep")),
            DDPConfig(bucket_size=30, use_distributed_optimizer=sharded, overlap_grad_reduce=True),
            state,
        )
        optimizer = DistributedOptimizer(model, OptimizerConfig(**OPTIM))
        norms = []
        for x, y in moe_data():
            rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
            optimizer.zero_grad()
            (model(x[rows]) - y[rows]).pow(2).mean().backward()
            norms.append(optimizer.step())
        model.finish_param_sync()
        out[f"norms_{sharded}"] = norms
        out[f"params_{sharded}"] = {
            k: v.detach().clone() for k, v in model.module.named_parameters()
        }
        out["local"] = (model.module.local.start, model.module.local.stop)
    return out


def test_expert_parallel_training_equals_single_process_adamw():
    net = MoE(1, 0, None)
    optimizer = torch.optim.AdamW(net.parameters(), **OPTIM)
    norms = []
    for x, y in moe_data():
        optimizer.zero_grad()
        (net(x) - y).pow(2).mean().backward()
        norms.append(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in net.parameters())))
        optimizer.step()
    for result in run_distributed(expert_training, 4):
        # dp=4, ep=2: experts split over ranks {0,1} / {2,3}; replicas over expert_dp {0,2}/{1,3}.
        assert len(result["ranks"]["ep"]) == 2 and len(result["ranks"]["expert_dp"]) == 2
        start, stop = result["local"]
        for sharded in (False, True):
            got = result[f"params_{sharded}"]
            torch.testing.assert_close(
                got["router.weight"], net.router.weight.detach(), atol=ATOL, rtol=RTOL
            )
            torch.testing.assert_close(
                got["router.bias"], net.router.bias.detach(), atol=ATOL, rtol=RTOL
            )
            torch.testing.assert_close(got["up"], net.up.detach()[start:stop], atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(
                got["down"], net.down.detach()[start:stop], atol=ATOL, rtol=RTOL
            )
            assert result[f"norms_{sharded}"] == pytest.approx(norms, rel=1e-5)
