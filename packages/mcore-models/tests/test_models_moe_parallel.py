"""Expert parallelism on 2 gloo ranks: EP=2 equals EP=1 (logits and gradients) for both token
dispatchers, dropless, decode-padded and with drops; all-gather equals all-to-all; MoE under
TP=2 equals one rank; a Hugging Face checkpoint loads under EP=2. One ``run_distributed`` call
checks everything (one process group)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_models import GPTConfig, GPTModel, parallelize
from mcore_models.moe import MoEConfig, set_decode_expert_padding
from mcore_parallel import initialize
from mcore_parallel.sharding import get_partition_dims
from mcore_parallel.testing import run_distributed

IDS = torch.randint(0, 256, (2, 2, 6), generator=torch.Generator().manual_seed(3))
"""Per-rank input ids: rank r reads ``IDS[r]``."""

MOE = MoEConfig(
    num_experts=4,
    top_k=2,
    shared_expert_ffn_hidden_size=32,
    shared_expert_gate=True,
    aux_loss_coeff=0.01,
    z_loss_coeff=0.001,
)


def _config(**moe_changes) -> GPTConfig:
    fields = {name: getattr(MOE, name) for name in MOE.__slots__}
    fields.update(moe_changes)
    return GPTConfig.from_name("tiny", seed=5, moe=MoEConfig(**fields))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _compare(config: GPTConfig, state, padded: bool) -> tuple[float, float, torch.Tensor]:
    """Errors of an expert-parallel model against one rank that sees every rank's tokens."""
    rank, ep = state.ep_rank, state.ep_size
    reference, sharded = GPTModel(config), parallelize(GPTModel(config), state)
    with set_decode_expert_padding(reference, padded), set_decode_expert_padding(sharded, padded):
        # The reference runs each rank's tokens separately: aux losses and capacities are
        # per rank under expert parallelism as well.
        for r in range(ep):
            logits = reference(IDS[r])
            _loss(logits, IDS[r]).backward()
            if r == rank:
                expected = logits.detach()
        logits = sharded(IDS[rank])
        _loss(logits, IDS[rank]).backward()
    logit_error = _max_error(logits, expected)
    reference_grads = dict(reference.named_parameters())
    grad_error = 0.0
    for name, param in sharded.named_parameters():
        grad = param.grad.clone()
        want = reference_grads[name].grad
        if "ep" in get_partition_dims(param):
            want = want.chunk(ep)[rank]
        else:
            # Replicated weights saw only this rank's tokens: sum over the ranks.
            dist.all_reduce(grad, group=state.ep_group)
        grad_error = max(grad_error, _max_error(grad, want))
    return logit_error, grad_error, logits.detach()


def _all_checks(checkpoint_dir: str) -> dict[str, float]:
    state = initialize(ep=2)
    errors: dict[str, float] = {}
    outputs: dict[str, torch.Tensor] = {}
    for dispatcher in ("alltoall", "allgather"):
        for padded in (False, True):
            key = f"{dispatcher}/{'padded' if padded else 'dropless'}"
            config = _config(dispatcher=dispatcher)
            errors[f"logits/{key}"], errors[f"grads/{key}"], outputs[key] = _compare(
                config, state, padded
            )
    for mode in ("dropless", "padded"):
        errors[f"allgather_vs_alltoall/{mode}"] = _max_error(
            outputs[f"allgather/{mode}"], outputs[f"alltoall/{mode}"]
        )
    # Capacity 0.5 drops assignments; each source rank drops its own overflow, as one rank does.
    # Both dispatchers give every expert its capacity per source rank: same drops, same outputs.
    dropped = {}
    for dispatcher in ("alltoall", "allgather"):
        dropping = _config(capacity_factor=0.5, dispatcher=dispatcher)
        errors[f"logits/{dispatcher}/drop"], errors[f"grads/{dispatcher}/drop"], out = _compare(
            dropping, state, False
        )
        dropped[dispatcher] = out
    errors["allgather_vs_alltoall/drop"] = _max_error(dropped["allgather"], dropped["alltoall"])
    sharded = parallelize(GPTModel(_config()), state)
    experts = sharded.layers[0].mlp.experts
    errors["local_experts"] = float(experts.gate_up_proj.shape[0] != 2 or experts.num_experts != 2)
    # A Hugging Face (Qwen2-MoE) checkpoint loads whole, then keeps this rank's experts.
    with torch.no_grad():
        loaded = GPTModel.from_hf(checkpoint_dir, state=state)(IDS[state.ep_rank])
        whole = GPTModel.from_hf(checkpoint_dir)(IDS[state.ep_rank])
    errors["logits/from_hf_ep2"] = _max_error(loaded, whole)
    state.destroy()
    tp_state = initialize(tp=2)
    with torch.no_grad():
        errors["logits/tp2"] = _max_error(
            parallelize(GPTModel(_config()), tp_state)(IDS[0]), GPTModel(_config())(IDS[0])
        )
    tp_state.destroy()
    return errors


def test_expert_parallel_equals_single_rank_for_both_dispatchers_and_padding_modes(tmp_path):
    GPTModel(_config()).to_hf(tmp_path)
    for rank_errors in run_distributed(_all_checks, 2, str(tmp_path)):
        for name, error in rank_errors.items():
            assert error < 2e-5, f"{name}: max error {error}"
