"""Expert tensor parallelism and sequence parallelism of MoE layers on 4 gloo ranks.

A whole layer is built from a seed; every rank parallelizes a copy with ``parallelize_moe``
and the outputs, input gradients and (gathered, summed) parameter gradients must equal the
single-process layer run on the same tokens. Layouts: tp=2 ep=2 etp=2 without sequence
parallelism (ETP ranks hold the same tokens: partial outputs all-reduced), the same with
sequence parallelism (chunks gathered over ETP and reduce-scattered back), and tp=1 ep=2
etp=2 (ETP ranks are data-parallel ranks with different tokens). Both dispatchers, dropless
(with auxiliary losses) and drop-and-pad with drops: each source rank gets its own capacity,
so the reference runs every source rank's tokens separately, and both dispatchers must drop
the same assignments. Meta-device parallelization gives the same local shapes and partition
dims, and a GPT model with sequence parallelism under tp=2 matches one rank.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from mcore_models import GPTConfig, GPTModel, ModelConfigError, parallelize
from mcore_models.moe import MoEConfig, MoELayer, parallelize_moe
from mcore_parallel import initialize
from mcore_parallel.sharding import get_partition_dims
from mcore_parallel.testing import run_distributed

BATCH, SEQ = 2, 4

MOE = dict(
    num_experts=4,
    top_k=2,
    expert_ffn_hidden_size=16,
    shared_expert_ffn_hidden_size=16,
    shared_expert_gate=True,
)


def _config(dispatcher: str, capacity: float | None, sequence_parallel: bool) -> GPTConfig:
    aux = dict(aux_loss_coeff=0.01, z_loss_coeff=0.001) if capacity is None else {}
    moe = MoEConfig(**MOE, **aux, dispatcher=dispatcher, capacity_factor=capacity)
    return GPTConfig.from_name(
        "tiny", hidden_size=32, seed=3, moe=moe, sequence_parallel=sequence_parallel
    )


def _whole_layer(config: GPTConfig) -> MoELayer:
    layer = MoELayer(config, 0)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return layer


def _data(num_sources: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(num_sources, BATCH, SEQ, hidden, generator=generator)
    grad = torch.randn(num_sources, BATCH, SEQ, hidden, generator=generator)
    return x, grad


def _ranks(state, axis: str) -> tuple[int, int]:
    return {
        "tp": (state.tp_size, state.tp_rank),
        "ep": (state.ep_size, state.ep_rank),
        "etp": (state.etp_size, state.etp_rank),
    }[axis]


def _block(whole: torch.Tensor, param: torch.Tensor, state) -> torch.Tensor:
    """This rank's block of a whole tensor, from the parameter's partition dims."""
    for axis, dim in get_partition_dims(param).items():
        size, rank = _ranks(state, axis)
        local = whole.shape[dim] // size
        whole = whole.narrow(dim, rank * local, local)
    return whole


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _check_layer(state, sp: bool, dispatcher: str, capacity: float | None) -> dict[str, float]:
    config = _config(dispatcher, capacity, sp)
    reference = _whole_layer(config)
    sharded = copy.deepcopy(reference)
    parallelize_moe(sharded, state, sequence_parallel=sp)
    data_rank, data_size = state.dp_rank, state.dp_size
    x, grad = _data(data_size, config.hidden_size)
    tp = state.tp_size if sp else 1
    # The source ranks of the expert dispatch: with drop-and-pad each has its own capacity,
    # so the reference runs each one's tokens alone (dropless: each data-parallel rank's,
    # whose auxiliary losses are normalised over the whole sequence).
    chunks = tp if capacity is not None else 1
    reference_outputs = []
    x_ref = x.clone().requires_grad_(True)
    for d in range(data_size):
        parts = [reference(piece) for piece in x_ref[d].chunk(chunks, dim=1)]
        reference_outputs.append(torch.cat(parts, dim=1))
    outputs = torch.stack(reference_outputs)
    (outputs * grad).sum().backward()
    mine = x[data_rank]
    expected_out, expected_dx = outputs[data_rank].detach(), x_ref.grad[data_rank]
    out_grad = grad[data_rank]
    if sp:
        mine = mine.chunk(state.tp_size, dim=1)[state.tp_rank]
        expected_out = expected_out.chunk(state.tp_size, dim=1)[state.tp_rank]
        expected_dx = expected_dx.chunk(state.tp_size, dim=1)[state.tp_rank]
        out_grad = out_grad.chunk(state.tp_size, dim=1)[state.tp_rank]
    x_local = mine.clone().requires_grad_(True)
    output = sharded(x_local)
    (output * out_grad).sum().backward()
    errors = {
        "output": _max_error(output, expected_out),
        "dx": _max_error(x_local.grad, expected_dx),
    }
    reference_params = dict(reference.named_parameters())
    for name, param in sharded.named_parameters():
        g = param.grad.clone()
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(g, group=state.tp_group)
        dims = get_partition_dims(param)
        expert = "ep" in dims or "etp" in dims or name.startswith("experts.")
        dist.all_reduce(g, group=state.expert_dp_group if expert else state.dp_group)
        want = _block(reference_params[name].grad, param, state)
        errors[f"grad/{name}"] = _max_error(g, want)
    errors["output_tensor"] = output.detach()  # type: ignore[assignment]
    return errors


def _layouts_checks() -> dict[str, float]:
    results: dict[str, float] = {}
    for label, sizes, sp in (
        ("tp2_ep2_etp2", dict(tp=2, ep=2, etp=2), False),
        ("tp2_ep2_etp2_sp", dict(tp=2, ep=2, etp=2), True),
        ("tp1_ep2_etp2", dict(tp=1, ep=2, etp=2), False),
    ):
        state = initialize(**sizes)
        for capacity in (None, 0.5):
            outputs = {}
            for dispatcher in ("alltoall", "allgather"):
                errors = _check_layer(state, sp, dispatcher, capacity)
                outputs[dispatcher] = errors.pop("output_tensor")
                key = f"{label}/{dispatcher}/{'dropless' if capacity is None else 'drop'}"
                results.update({f"{key}/{name}": value for name, value in errors.items()})
            results[f"{label}/{capacity}/allgather_vs_alltoall"] = _max_error(
                outputs["allgather"], outputs["alltoall"]
            )
        state.destroy()
    return results


def _meta_and_gpt_checks() -> dict[str, float]:
    results: dict[str, float] = {}
    state = initialize(tp=2, ep=2, etp=2)
    config = _config("alltoall", None, True)
    materialised = _whole_layer(config)
    parallelize_moe(materialised, state, sequence_parallel=True)
    meta = MoELayer(config, 0, device="meta")
    parallelize_moe(meta, state, sequence_parallel=True)
    real = dict(materialised.named_parameters())
    for name, param in meta.named_parameters():
        same = (
            param.is_meta
            and param.shape == real[name].shape
            and get_partition_dims(param) == get_partition_dims(real[name])
        )
        results[f"meta/{name}"] = float(not same)
    try:
        parallelize_moe(materialised, state, sequence_parallel=True)
        results["second_parallelize_raises"] = 1.0
    except ModelConfigError as error:
        results["second_parallelize_raises"] = float("already parallelized" not in str(error))
    odd = _config("alltoall", None, True)
    odd = odd.replace(moe=MoEConfig(**{**MOE, "expert_ffn_hidden_size": 15}))
    try:
        parallelize_moe(MoELayer(odd, 0, device="meta"), state, sequence_parallel=True)
        results["odd_ffn_raises"] = 1.0
    except ModelConfigError as error:
        results["odd_ffn_raises"] = float(
            "=15 must be divisible by the expert tensor" not in str(error)
        )
    state.destroy()
    # A whole GPT model with sequence parallelism and MoE layers under tp=2.
    state = initialize(tp=2)
    config = _config("alltoall", None, True).replace(seed=9)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(state.dp_rank))
    with torch.no_grad():
        sharded = parallelize(GPTModel(config), state)(ids)
        whole = GPTModel(config.replace(sequence_parallel=False))(ids)
    results["gpt_sp_tp2/logits"] = _max_error(sharded, whole)
    state.destroy()
    return results


def _all_checks() -> dict[str, float]:
    # One process group for everything: spawning 4 ranks costs more than the checks.
    return {**_layouts_checks(), **_meta_and_gpt_checks()}


def test_expert_tensor_and_sequence_parallel_moe_equals_single_process():
    for rank_errors in run_distributed(_all_checks, 4, timeout=300.0):
        for name, error in rank_errors.items():
            assert error < 5e-5, f"{name}: max error {error}"
