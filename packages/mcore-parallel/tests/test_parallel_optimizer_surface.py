"""DistributedOptimizer as a torch optimizer: LR schedulers, parameter groups, the no-decay
rule, torch-format state dicts and the bf16 mixed-precision default.

Every run trains on two data-parallel ranks with a sharded optimizer (buckets small enough that
parameters straddle shards) and compares with single-process ``torch.optim.AdamW`` on the full
batch. Tolerance: fp32 ``atol=5e-6, rtol=1e-5`` (only the order of the gradient summation
differs).
"""

import copy

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from mcore_parallel.distributed import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
)
from mcore_parallel.distributed.param_groups import (
    no_weight_decay_names,
    weight_decay_param_groups,
)
from mcore_parallel.errors import OptimizerStateError, ParallelConfigError
from mcore_parallel.testing import run_distributed

ATOL, RTOL = 5e-6, 1e-5
OPTIM = {"lr": 0.05, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 12)
        self.out = nn.Linear(12, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.proj(self.norm(self.embedding(tokens)))))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(4)
    return [
        (
            torch.randint(0, 11, (4, 5), generator=generator),
            torch.randn(4, 5, 3, generator=generator),
        )
        for _ in range(steps)
    ]


def loss_fn(net, tokens, target):
    return (net(tokens) - target).pow(2).mean()


def ddp_net() -> DistributedDataParallel:
    return DistributedDataParallel(
        make_net(),
        DDPConfig(bucket_size=50, use_distributed_optimizer=True, overlap_grad_reduce=True),
    )


def run_steps(model, optimizer, data, scheduler=None, distributed=True) -> list[float]:
    rank, world = (
        (torch.distributed.get_rank(), torch.distributed.get_world_size())
        if distributed
        else (0, 1)
    )
    lrs = []
    for tokens, target in data:
        rows = slice(rank * len(tokens) // world, (rank + 1) * len(tokens) // world)
        optimizer.zero_grad()
        loss_fn(model, tokens[rows], target[rows]).backward()
        optimizer.step()
        lrs.append([group["lr"] for group in optimizer.param_groups])
        if scheduler is not None:
            scheduler.step()
    return lrs


def cosine_with_warmup(optimizer):
    return SequentialLR(
        optimizer,
        [
            LinearLR(optimizer, start_factor=0.1, total_iters=3),
            CosineAnnealingLR(optimizer, T_max=7, eta_min=1e-3),
        ],
        milestones=[3],
    )


def custom_groups(net):
    return [
        {"params": [net.proj.weight, net.out.weight], "weight_decay": 0.3, "lr": 0.02},
        {"params": [net.embedding.weight, net.proj.bias], "betas": (0.8, 0.9)},
        {"params": [net.norm.weight, net.norm.bias, net.out.bias], "weight_decay": 0.0},
    ]


def params(net) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.named_parameters()}


def distributed_runs() -> dict:
    out: dict = {}
    data = batches(10)

    model = ddp_net()
    optimizer = DistributedOptimizer(model, OptimizerConfig(**OPTIM))
    out["scheduled_lrs"] = run_steps(model, optimizer, data, cosine_with_warmup(optimizer))
    model.finish_param_sync()
    out["scheduled"] = params(model.module)

    model = ddp_net()
    optimizer = DistributedOptimizer(
        model, OptimizerConfig(**OPTIM), param_groups=custom_groups(model.module)
    )
    run_steps(model, optimizer, data[:4])
    model.finish_param_sync()
    out["grouped"] = params(model.module)

    model = ddp_net()
    optimizer = DistributedOptimizer(
        model, OptimizerConfig(**OPTIM, exclude_from_weight_decay=True)
    )
    out["rule_groups"] = [(len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups]
    run_steps(model, optimizer, data[:4])
    model.finish_param_sync()
    out["no_decay_rule"] = params(model.module)

    # torch-format state dict after 3 steps; then resume from a torch AdamW state dict.
    model = ddp_net()
    optimizer = DistributedOptimizer(model, OptimizerConfig(**OPTIM))
    run_steps(model, optimizer, data[:3])
    out["state_dict"] = optimizer.state_dict()
    reference_model, reference_sd = torch.load(out_path_for_reference(), weights_only=False)
    resumed = ddp_net()
    resumed.load_state_dict(reference_model)
    resumed_optimizer = DistributedOptimizer(resumed, OptimizerConfig(**OPTIM))
    resumed_optimizer.load_state_dict(reference_sd)
    out["loaded_step"] = resumed_optimizer.step_count
    run_steps(resumed, resumed_optimizer, data[3:5])
    resumed.finish_param_sync()
    out["resumed"] = params(resumed.module)
    try:
        resumed_optimizer.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]})
    except OptimizerStateError as error:
        out["bad_groups"] = str(error)
    return out


_REFERENCE_FILE: list[str] = []


def out_path_for_reference() -> str:
    return _REFERENCE_FILE[0]


def run_with_reference(path: str) -> dict:
    _REFERENCE_FILE.append(path)
    return distributed_runs()


def reference_runs() -> dict:
    out: dict = {}
    data = batches(10)
    net = make_net()
    optimizer = torch.optim.AdamW(net.parameters(), **OPTIM)
    out["scheduled_lrs"] = run_steps(
        net, optimizer, data, cosine_with_warmup(optimizer), distributed=False
    )
    out["scheduled"] = params(net)

    net = make_net()
    groups = custom_groups(net)
    optimizer = torch.optim.AdamW(groups, **OPTIM)
    run_steps(net, optimizer, data[:4], distributed=False)
    out["grouped"] = params(net)

    net = make_net()
    optimizer = torch.optim.AdamW(weight_decay_param_groups(net, OPTIM["weight_decay"]), **OPTIM)
    run_steps(net, optimizer, data[:4], distributed=False)
    out["no_decay_rule"] = params(net)

    net = make_net()
    optimizer = torch.optim.AdamW(net.parameters(), **OPTIM)
    run_steps(net, optimizer, data[:3], distributed=False)
    # torch's state_dict aliases the live state: copy it before training on.
    out["state_dict"] = copy.deepcopy(optimizer.state_dict())
    out["checkpoint"] = (params(net), out["state_dict"])
    run_steps(net, optimizer, data[3:5], distributed=False)
    out["resumed"] = params(net)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    reference = reference_runs()
    path = tmp_path_factory.mktemp("adamw") / "checkpoint.pt"
    weights, state = reference["checkpoint"]
    # Resume the distributed run from torch AdamW's own state dict (deep copies on disk).
    torch.save((weights, state), path)
    reference = {k: v for k, v in reference.items() if k != "checkpoint"}
    return run_distributed(run_with_reference, 2, str(path)), reference


def assert_close(got: dict, want: dict) -> None:
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=RTOL, msg=name)


def test_cosine_warmup_scheduler_drives_it_like_torch_adamw(results):
    ranks, reference = results
    for result in ranks:
        got = [lr[0] for lr in result["scheduled_lrs"]]
        assert got == pytest.approx([lr[0] for lr in reference["scheduled_lrs"]], rel=1e-12)
        assert_close(result["scheduled"], reference["scheduled"])
    # The schedule really warmed up and decayed.
    lrs = [lr[0] for lr in reference["scheduled_lrs"]]
    assert lrs[0] == pytest.approx(0.005) and max(lrs) == pytest.approx(0.05) and lrs[-1] < 0.01


def test_per_group_lr_betas_and_weight_decay_match_torch_adamw(results):
    ranks, reference = results
    for result in ranks:
        assert_close(result["grouped"], reference["grouped"])


def test_no_decay_rule_exempts_norms_biases_and_embeddings(results):
    assert no_weight_decay_names(make_net()) == {
        "embedding.weight",
        "norm.weight",
        "norm.bias",
        "proj.bias",
        "out.bias",
    }
    ranks, reference = results
    for result in ranks:
        assert result["rule_groups"] == [(2, 0.1), (5, 0.0)]
        assert_close(result["no_decay_rule"], reference["no_decay_rule"])


def test_state_dict_has_torch_adamw_format_and_values(results):
    ranks, reference = results
    want = reference["state_dict"]
    for result in ranks:
        got = result["state_dict"]
        assert [g["params"] for g in got["param_groups"]] == [
            g["params"] for g in want["param_groups"]
        ]
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert got["param_groups"][0][key] == want["param_groups"][0][key]
        assert set(got["state"]) == set(want["state"])
        for index, entry in want["state"].items():
            assert float(got["state"][index]["step"]) == float(entry["step"]) == 3.0
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(
                    got["state"][index][key], entry[key], atol=ATOL, rtol=RTOL
                )
            assert got["state"][index]["main_param"].dtype == torch.float32


def test_loading_a_torch_adamw_state_dict_resumes_exactly(results):
    ranks, reference = results
    for result in ranks:
        assert result["loaded_step"] == 3
        assert_close(result["resumed"], reference["resumed"])
        assert "sizes [1]" in result["bad_groups"]


def bf16_default() -> dict:
    rank = torch.distributed.get_rank()
    out: dict = {}
    net = make_net().to(torch.bfloat16)
    model = DistributedDataParallel(net, DDPConfig(bucket_size=50))
    out["grad_dtypes"] = sorted({str(b.grad_dtype) for b in model.param_grad_buffers})
    kept = DistributedDataParallel(
        make_net().to(torch.bfloat16), DDPConfig(grad_reduce_in_fp32=False)
    )
    out["kept_dtypes"] = sorted({str(b.grad_dtype) for b in kept.param_grad_buffers})
    optimizer = DistributedOptimizer(model, OptimizerConfig(**OPTIM))
    masters = [p.detach().float().clone().requires_grad_() for p in net.parameters()]
    reference = torch.optim.AdamW(masters, **OPTIM)
    for tokens, target in batches(3):
        rows = slice(rank * 2, rank * 2 + 2)
        optimizer.zero_grad()
        loss_fn(model, tokens[rows], target[rows].bfloat16()).float().backward()
        model.finish_grad_sync()
        for master, param in zip(masters, net.parameters()):
            master.grad = param.main_grad.clone()
        optimizer.step()
        reference.step()
    out["main_dtypes"] = sorted({str(s.main_param.dtype) for s in optimizer.shards})
    state = optimizer.state_dict()["state"]
    out["main_error"] = max(
        float((state[i]["main_param"] - m.detach()).abs().max()) for i, m in enumerate(masters)
    )
    out["model_is_rounded_main"] = all(
        torch.equal(p.detach(), state[i]["main_param"].bfloat16())
        for i, p in enumerate(net.parameters())
    )
    return out


def test_bf16_model_defaults_to_fp32_grads_and_fp32_main_params():
    for result in run_distributed(bf16_default, 2):
        assert result["grad_dtypes"] == ["torch.float32"]
        assert result["kept_dtypes"] == ["torch.bfloat16"]
        assert result["main_dtypes"] == ["torch.float32"]
        assert result["main_error"] < 1e-6
        assert result["model_is_rounded_main"]


def test_bad_param_groups_raise():
    with pytest.raises(ParallelConfigError, match="grad_reduce_in_fp32"):
        DDPConfig(grad_reduce_in_fp32="yes")  # type: ignore[arg-type]
    with pytest.raises(ParallelConfigError, match="exclude_from_weight_decay"):
        OptimizerConfig(exclude_from_weight_decay=1)  # type: ignore[arg-type]


def bad_groups() -> dict:
    model = ddp_net()
    net = model.module
    out = {}
    for name, groups in {
        "missing": [{"params": [net.proj.weight]}],
        "twice": [{"params": list(net.parameters())}, {"params": [net.proj.weight]}],
        "foreign": [{"params": [*net.parameters(), nn.Parameter(torch.zeros(2))]}],
        "option": [{"params": list(net.parameters()), "momentum": 0.9}],
    }.items():
        try:
            DistributedOptimizer(model, param_groups=groups)
        except ParallelConfigError as error:
            out[name] = str(error)
    return out


def test_param_groups_must_cover_each_trainable_parameter_once():
    (out,) = run_distributed(bad_groups, 1)
    assert "miss trainable parameters" in out["missing"] and "embedding.weight" in out["missing"]
    assert "'proj.weight' appears in more than one" in out["twice"]
    assert "not a trainable parameter" in out["foreign"]
    assert "['momentum']" in out["option"]
