"""Reference weights swapped in from the host or the device: bit-exact round trips, hooks, exceptions."""

import pytest
import torch

from mcore_models import GPTConfig, GPTModel
from mcore_parallel.distributed.config import DDPConfig, OptimizerConfig
from mcore_parallel.distributed.ddp import DistributedDataParallel
from mcore_parallel.distributed.optimizer import DistributedOptimizer
from mcore_parallel.state import initialize
from mcore_parallel.testing import run_distributed
from mcore_rl.errors import RLInputError, RLStateError
from mcore_rl.logprobs import row_logprobs
from mcore_rl.packing import PackingContext, pack_sequences
from mcore_rl.reference import ReferenceWeights

CONFIG = dict(vocab_size=32, hidden_size=32, num_layers=1, num_attention_heads=2, seed=5)


def _snapshot(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _bit_equal(a, b):
    return all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


def _context():
    sequences = [[1, 4, 5, 6, 7], [1, 8, 9, 10]]
    info = pack_sequences([5, 4], 12)
    return PackingContext.build(sequences, [2, 2], [1.0, -1.0], info)


def _swap_round_trip_on_two_ranks(state, on_device: bool):
    model = GPTModel(GPTConfig.from_name("tiny", **CONFIG))
    ddp = DistributedDataParallel(
        model, DDPConfig(use_distributed_optimizer=True, overlap_param_gather=True), state
    )
    optimizer = DistributedOptimizer(ddp, OptimizerConfig(lr=0.05))
    reference = ReferenceWeights(ddp, optimizer=optimizer, on_device=on_device)
    hooked_before = set(map(id, ddp.param_sync_hooks.hooked_modules()))
    context = _context()
    # Step 0: the reference is the policy, so reference log-probs equal policy log-probs.
    with torch.no_grad():
        policy_lp = row_logprobs(ddp, context, 0)[0]
        with reference.use_reference_weights():
            reference_lp = row_logprobs(ddp, context, 0)[0]
    step0_equal = torch.equal(policy_lp, reference_lp)
    initial = reference.state_dict()

    # One optimizer step: parameter shards are now stale until the all-gather finishes.
    ddp.zero_grad_buffer()
    row_logprobs(ddp, context, 0)[0].sum().backward()
    optimizer.step()
    pending_before_swap = ddp.param_sync_pending
    with reference.use_reference_weights():
        inside_is_reference = _bit_equal(_snapshot(model), initial)
        hooks_off_inside = not ddp.param_sync_hooks.enabled
    optimizer.start_param_sync(force_sync=True)
    policy = _snapshot(model)
    changed = not _bit_equal(policy, initial)

    with pytest.raises(ValueError, match="injected"), reference.use_reference_weights():
        model.embedding.weight.data.add_(1.0)  # corrupt mid-way, then fail
        raise ValueError("injected")
    restored_after_error = _bit_equal(_snapshot(model), policy)
    hooks_back = ddp.param_sync_hooks.enabled
    hooked_after = set(map(id, ddp.param_sync_hooks.hooked_modules()))

    with (
        reference.use_reference_weights(),
        pytest.raises(RLStateError, match="does not nest"),
        reference.use_reference_weights(),
    ):
        pass
    return {
        "step0_equal": step0_equal,
        "pending_before_swap": pending_before_swap,
        "inside_is_reference": inside_is_reference,
        "hooks_off_inside": hooks_off_inside,
        "changed": changed,
        "restored_after_error": restored_after_error,
        "hooks_back": hooks_back,
        "same_hooked_set": hooked_after == hooked_before and len(hooked_before) > 0,
        "final_is_policy": _bit_equal(_snapshot(model), policy),
    }


def _both_placements_on_two_ranks():
    state = initialize()
    return [_swap_round_trip_on_two_ranks(state, on_device) for on_device in (False, True)]


def test_reference_swap_is_bit_exact_with_hooks_and_exceptions_on_two_ranks():
    # Reference in host memory and next to the parameters (on_device), same checks.
    for results in run_distributed(_both_placements_on_two_ranks, 2):
        for result in results:
            assert result == {key: True for key in result}, result


def test_reference_state_is_validated():
    model = GPTModel(GPTConfig.from_name("tiny", **CONFIG))
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state["embedding.weight"] = torch.zeros(3, 3)
    with pytest.raises(RLInputError, match=r"reference_state\['embedding.weight'\] has shape"):
        ReferenceWeights(model, state)
    del state["embedding.weight"]
    with pytest.raises(RLInputError, match="misses parameters"):
        ReferenceWeights(model, state)
