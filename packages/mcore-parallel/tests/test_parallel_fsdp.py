"""FSDP2 through fully_shard_model: default 1-D mesh, HSDP 2-D mesh and expert submeshes.

Training equivalence: three AdamW steps on 4 gloo ranks (each with a quarter of the batch)
equal single-process AdamW on the full batch; fp32, ``atol=2e-6, rtol=1e-5``.
"""

import pytest
import torch
from _gather_tokens import GatherTokens
from torch import nn

from mcore_parallel.distributed import (
    build_fsdp_mesh,
    fully_shard_model,
    fully_shard_optimizer,
    is_fsdp_param,
)
from mcore_parallel.errors import ParallelConfigError, ParallelTypeError
from mcore_parallel.testing import run_distributed

WORLD = 4
ATOL, RTOL = 2e-6, 1e-5
OPTIM = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(4)
    return [
        (torch.randn(8, 5, generator=generator), torch.randn(8, 3, generator=generator))
        for _ in range(3)
    ]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def train_sharded(**kwargs) -> dict[str, object]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = fully_shard_model(make_model(), **kwargs)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), **OPTIM), model)
    for x, y in make_batches():
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        optimizer.zero_grad()
        loss_fn(model, x[rows], y[rows]).backward()
        optimizer.step()
    mesh = model.embed.weight.device_mesh
    return {
        "params": {k: v.full_tensor() for k, v in model.state_dict().items()},
        "mesh_shape": tuple(mesh.mesh.shape),
        "mesh_names": tuple(mesh.mesh_dim_names),
        "all_sharded": all(is_fsdp_param(p) for p in model.parameters()),
        "layer_is_unit": hasattr(model.layers[0], "unshard"),
    }


def train_bf16() -> dict[str, object]:
    """A bf16 model under the default mixed precision: fp32 shards, bf16 compute, fp32 grads."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = fully_shard_model(make_model().to(torch.bfloat16))
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), **OPTIM), model)
    out: dict[str, object] = {"param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}
    for x, y in make_batches():
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        optimizer.zero_grad()
        prediction = model(x[rows].bfloat16())
        out["compute_dtype"] = str(prediction.dtype)
        (prediction.float() - y[rows]).pow(2).mean().backward()
        out["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
        optimizer.step()
    out["params"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return out


class MoENet(nn.Module):
    """A dense layer plus a per-expert-rank "expert" that sees every token of its ep group."""

    def __init__(self, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(4, 4)
        torch.manual_seed(10 + ep_rank)
        self.expert = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, group) -> torch.Tensor:
        # All-gathering the ep group's tokens stands in for the token dispatch of a real MoE:
        # the expert's gradient then sums contributions of every rank of the ep group.
        return self.expert(GatherTokens.apply(self.dense(x), group))


def expert_grads(ep: int) -> dict[str, object]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ep_rank = rank % ep
    ep_groups = [torch.distributed.new_group(list(range(s, s + ep))) for s in range(0, world, ep)]
    ep_group = ep_groups[rank // ep]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))

    # Plain torch: local gradients of each rank's loss, reduced by hand.
    plain = MoENet(ep_rank)
    plain(x, ep_group).pow(2).mean().backward()
    expert_grad = plain.expert.weight.grad.clone()
    dense_grad = plain.dense.weight.grad.clone()
    expert_dp = [torch.distributed.new_group(list(range(e, world, ep))) for e in range(ep)]
    torch.distributed.all_reduce(expert_grad, group=expert_dp[ep_rank])
    torch.distributed.all_reduce(dense_grad)

    model = fully_shard_model(
        MoENet(ep_rank),
        expert_modules=lambda m: [m.expert],
        expert_parallel_size=ep,
        shard_units=lambda m: [],
    )
    model(x, ep_group).pow(2).mean().backward()
    mesh = model.expert.weight.device_mesh
    return {
        "expert_mesh_ranks": mesh.mesh.flatten().tolist(),
        "expert_mesh_names": tuple(mesh.mesh_dim_names),
        "dense_mesh_ranks": model.dense.weight.device_mesh.mesh.flatten().tolist(),
        "expert_grad_error": float(
            (model.expert.weight.grad.full_tensor() - expert_grad / world).abs().max()
        ),
        "dense_grad_error": float(
            (model.dense.weight.grad.full_tensor() - dense_grad / world).abs().max()
        ),
    }


def optimizer_checks() -> dict[str, str]:
    out = {}
    early = make_model()
    optimizer = torch.optim.AdamW(early.parameters())
    fully_shard_model(early)
    try:
        fully_shard_optimizer(optimizer, early)
    except ParallelConfigError as error:
        out["built_before"] = str(error)
    model = fully_shard_model(make_model())
    partial = torch.optim.AdamW(model.head.parameters())
    try:
        fully_shard_optimizer(partial, model)
    except ParallelConfigError as error:
        out["partial"] = str(error)
    try:
        fully_shard_model(make_model(), expert_modules=lambda m: [m.head])
    except ParallelConfigError as error:
        out["experts_without_ep"] = str(error)
    try:
        fully_shard_model(make_model(), replicate_size=3)
    except ParallelConfigError as error:
        out["bad_replicate"] = str(error)
    try:
        fully_shard_model(make_model(), expert_parallel_size=2)
    except ParallelConfigError as error:
        out["ep_without_experts"] = str(error)
    try:
        fully_shard_model(make_model(), build_fsdp_mesh(), replicate_size=2)
    except ParallelConfigError as error:
        out["replicate_with_mesh"] = str(error)
    return out


def all_checks() -> dict[str, object]:
    return {
        "fsdp": train_sharded(),
        "hsdp": train_sharded(replicate_size=2),
        "unit_per_layer_off": train_sharded(shard_units=lambda m: [], reshard_after_forward=False),
        "experts": expert_grads(ep=2),
        "errors": optimizer_checks(),
        "bf16": train_bf16(),
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(all_checks, WORLD, timeout=300.0)


def reference_params() -> dict[str, torch.Tensor]:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    for x, y in make_batches():
        optimizer.zero_grad()
        loss_fn(model, x, y).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def reference_bf16_params() -> dict[str, torch.Tensor]:
    """fp32 master weights and AdamW; forward/backward of a bf16 copy of them per rank's rows."""
    masters = make_model().to(torch.bfloat16).float()
    optimizer = torch.optim.AdamW(masters.parameters(), **OPTIM)
    for x, y in make_batches():
        optimizer.zero_grad()
        for x_rows, y_rows in zip(x.chunk(WORLD), y.chunk(WORLD)):
            low = make_model().to(torch.bfloat16)
            low.load_state_dict({k: v.bfloat16() for k, v in masters.state_dict().items()})
            ((low(x_rows.bfloat16()).float() - y_rows).pow(2).mean() / WORLD).backward()
            for master, param in zip(masters.parameters(), low.parameters()):
                grad = param.grad.float()
                master.grad = grad if master.grad is None else master.grad + grad
        optimizer.step()
    return {k: v.detach() for k, v in masters.state_dict().items()}


def test_bf16_model_trains_with_fp32_shards_and_fp32_gradients(results):
    expected = reference_bf16_params()
    for result in results:
        bf16 = result["bf16"]
        assert bf16["param_dtypes"] == ["torch.float32"]
        assert bf16["compute_dtype"] == "torch.bfloat16"
        assert bf16["grad_dtypes"] == ["torch.float32"]
        for name, value in expected.items():
            # bf16 rounding of each rank's gradient is the only difference.
            torch.testing.assert_close(bf16["params"][name], value, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("variant", ["fsdp", "hsdp", "unit_per_layer_off"])
def test_fully_sharded_training_matches_single_process(results, variant):
    expected = reference_params()
    for rank, result in enumerate(results):
        for key, value in expected.items():
            torch.testing.assert_close(
                result[variant]["params"][key], value, atol=ATOL, rtol=RTOL, msg=f"{rank} {key}"
            )
        assert result[variant]["all_sharded"]


def test_default_mesh_is_one_dimensional_over_the_world(results):
    for result in results:
        assert result["fsdp"]["mesh_shape"] == (WORLD,)
        assert result["fsdp"]["mesh_names"] == ("fsdp",)
        assert result["fsdp"]["layer_is_unit"]


def test_hsdp_mesh_is_replicate_by_fsdp(results):
    for result in results:
        assert result["hsdp"]["mesh_shape"] == (2, WORLD // 2)
        assert result["hsdp"]["mesh_names"] == ("replicate", "fsdp")


def test_experts_shard_over_expert_data_parallel_submesh(results):
    for rank, result in enumerate(results):
        experts = result["experts"]
        assert experts["expert_mesh_ranks"] == list(range(rank % 2, WORLD, 2))
        assert experts["expert_mesh_names"] == ("expert_fsdp",)
        assert experts["dense_mesh_ranks"] == list(range(WORLD))


def test_expert_gradients_are_averaged_over_full_data_parallel_size(results):
    for result in results:
        assert result["experts"]["expert_grad_error"] < 1e-6
        assert result["experts"]["dense_grad_error"] < 1e-6


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("built_before", "not FSDP-sharded"),
        ("partial", "misses trainable parameters"),
        ("experts_without_ep", "expert_parallel_size=1"),
        ("bad_replicate", "replicate_size=3"),
        ("ep_without_experts", "expert_parallel_size=2 needs expert_modules"),
        ("replicate_with_mesh", "replicate_size=2 only applies when device_mesh is None"),
    ],
)
def test_misuse_raises_config_error(results, key, match):
    for result in results:
        assert match in result["errors"][key]


def test_fully_shard_optimizer_rejects_non_optimizer():
    with pytest.raises(ParallelTypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        fully_shard_optimizer(object())  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fully_sharded_training_matches_single_process_on_nccl():
    expected = reference_params()
    for params in run_distributed(_nccl_equivalence_cuda, 2, backend="nccl"):
        for key, value in expected.items():
            # TF32 is off by default for fp32 matmuls in torch; cuBLAS reorders sums.
            torch.testing.assert_close(params[key], value, atol=1e-5, rtol=1e-4)


def _nccl_equivalence_cuda() -> dict[str, torch.Tensor]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = fully_shard_model(make_model().cuda())
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), **OPTIM), model)
    for x, y in make_batches():
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        optimizer.zero_grad()
        loss_fn(model, x[rows].cuda(), y[rows].cuda()).backward()
        optimizer.step()
    return {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
