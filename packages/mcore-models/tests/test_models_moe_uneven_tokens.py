"""Dropless expert parallelism with a different number of tokens on each EP rank, zero
included (as under inference, where each rank serves its own requests): outputs and input
gradients of an EP=2 MoE layer equal one unsharded layer, for both token dispatchers. One
``run_distributed`` call checks every case."""

from __future__ import annotations

import torch

from mcore_models import GPTConfig
from mcore_models.moe import MoEConfig, parallelize_moe
from mcore_models.moe.layer import MoELayer
from mcore_parallel import initialize
from mcore_parallel.testing import run_distributed

TOKENS_PER_RANK = ((0, 3), (2, 5), (4, 4))
"""Tokens of rank 0 and rank 1 in each case."""


def _errors_with_uneven_tokens() -> dict[tuple[str, tuple[int, int]], tuple[float, float]]:
    state = initialize(ep=2)
    errors = {}
    for dispatcher in ("alltoall", "allgather"):
        moe = MoEConfig(num_experts=4, top_k=2, dispatcher=dispatcher)
        config = GPTConfig.from_name("tiny", vocab_size=32, moe=moe, seed=7)
        torch.manual_seed(0)
        reference = MoELayer(config, 0)
        for parameter in reference.parameters():
            parameter.data.normal_(0.0, 0.05)
        sharded = MoELayer(config, 0)
        sharded.load_state_dict(reference.state_dict())
        parallelize_moe(sharded, state, sequence_parallel=False)
        for counts in TOKENS_PER_RANK:
            generator = torch.Generator().manual_seed(10 * counts[0] + counts[1])
            x = torch.randn(counts[state.ep_rank], config.hidden_size, generator=generator)
            x = x.to(config.dtype)
            x_sharded = x.clone().requires_grad_(True)
            x_reference = x.clone().requires_grad_(True)
            output = sharded(x_sharded)
            output.square().sum().backward()
            expected = reference(x_reference)
            expected.square().sum().backward()
            assert output.shape == expected.shape
            output_error = (output - expected).abs().max().item() if x.numel() else 0.0
            grad_error = (
                (x_sharded.grad - x_reference.grad).abs().max().item() if x.numel() else 0.0
            )
            errors[(dispatcher, counts)] = (output_error, grad_error)
    return errors


def test_dropless_dispatch_with_uneven_and_zero_tokens_per_ep_rank_matches_one_rank():
    for rank_errors in run_distributed(_errors_with_uneven_tokens, 2):
        assert set(rank_errors) == {
            (d, c) for d in ("alltoall", "allgather") for c in TOKENS_PER_RANK
        }
        for case, (output_error, grad_error) in rank_errors.items():
            assert output_error < 1e-5, case
            assert grad_error < 1e-5, case
