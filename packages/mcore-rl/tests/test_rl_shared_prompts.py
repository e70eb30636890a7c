"""Packing with shared prompts: same log-probs and gradients as one copy per sequence."""

from __future__ import annotations

import pytest
import torch

from mcore_models import GPTConfig, GPTModel
from mcore_rl.config import GRPOConfig
from mcore_rl.errors import PackingError, RLConfigError
from mcore_rl.logprobs import row_logprobs
from mcore_rl.packing import PackingContext, pack_sequences
from mcore_rl.shared_prompts import pack_shared_prompts


def _groups(seed: int = 0):
    # Three groups (prompts of 5, 1 and 8 tokens) plus a lone sequence; completions vary.
    g = torch.Generator().manual_seed(seed)
    sequences, prompts = [], []
    for prompt_len, completions in ((5, [3, 6, 1, 4]), (1, [2, 5]), (8, [7, 2, 3]), (4, [5])):
        prompt = torch.randint(3, 40, (prompt_len,), generator=g).tolist()
        for n in completions:
            sequences.append(prompt + torch.randint(3, 40, (n,), generator=g).tolist())
            prompts.append(prompt_len)
    return sequences, prompts


@pytest.fixture(scope="module")
def model() -> GPTModel:
    return GPTModel(
        GPTConfig.from_name(
            "tiny",
            vocab_size=40,
            hidden_size=32,
            num_layers=2,
            num_attention_heads=4,
            num_query_groups=2,
            seed=3,
        )
    )


def test_pack_shared_prompts_holds_every_completion_once_with_its_prompt():
    sequences, prompts = _groups()
    shared = pack_shared_prompts(sequences, prompts, token_budget=24, pad_multiple=4)
    info = shared.info
    assert info.bin_size % 4 == 0 and info.bin_size <= 24
    assert all(sum(info.lengths[s] for s in b) <= info.bin_size for b in info.bins)
    assert sorted(shared.child_of()) == list(range(len(sequences)))
    for segment, owner in enumerate(shared.owner):
        if owner < 0:
            continue
        parent = shared.prefix_of[segment]
        row = next(b for b in info.bins if segment in b)
        prefix = shared.segments[parent] if parent >= 0 else []
        assert parent < 0 or parent in row[: row.index(segment)]
        # Prefix + child rebuild the sequence, positions continue the prefix.
        assert prefix + shared.segments[segment] == sequences[owner]
        assert shared.position_offsets[segment] == len(prefix)
    # Fewer tokens than one copy per sequence (prompts of 5 and 8 tokens are shared).
    assert sum(info.lengths) < sum(len(s) for s in sequences)


def test_pack_shared_prompts_rejects_bad_input():
    with pytest.raises(PackingError, match="prompt length"):
        pack_shared_prompts([[1, 2]], [3], token_budget=8)
    with pytest.raises(PackingError, match="token_budget"):
        pack_shared_prompts([[1, 2]], [1], token_budget=0)
    with pytest.raises(PackingError, match="one prompt length per sequence"):
        pack_shared_prompts([[1, 2]], [1, 1], token_budget=8)


def _logprobs_and_grads(model, context, rows, weights_of):
    model.zero_grad()
    out = torch.stack(
        [
            row_logprobs(model, context, row, temperature=0.7, loss_positions_only=True)
            for row in range(rows)
        ]
    )
    logprobs, entropies = context.gather(out[:, 0]), context.gather(out[:, 1])
    total = sum(
        (logprobs[i] * weights_of(i)[0]).sum() + (entropies[i] * weights_of(i)[1]).sum()
        for i in logprobs
    )
    total.backward()
    return {i: v.detach() for i, v in logprobs.items()}, [
        p.grad.clone() for p in model.parameters()
    ]


def test_shared_prompt_rows_give_the_logprobs_and_gradients_of_unshared_rows(model):
    sequences, prompts = _groups(1)
    g = torch.Generator().manual_seed(7)
    weights = {
        i: torch.randn(2, len(s) - p, generator=g)
        for i, (s, p) in enumerate(zip(sequences, prompts))
    }
    info = pack_sequences([len(s) for s in sequences], 32, algorithm="ffd")
    plain = PackingContext.build(sequences, prompts, [0.0] * len(sequences), info)
    expected, expected_grads = _logprobs_and_grads(model, plain, info.num_bins, weights.__getitem__)

    shared = pack_shared_prompts(sequences, prompts, token_budget=32, pad_multiple=4)
    context = PackingContext.build(
        shared.segments,
        shared.prompt_lengths,
        [0.0] * len(shared.segments),
        shared.info,
        position_offsets=shared.position_offsets,
        prefix_of=shared.prefix_of,
    )
    owner = shared.owner
    values, grads = _logprobs_and_grads(
        model,
        context,
        shared.info.num_bins,
        lambda s: weights[owner[s]] if owner[s] >= 0 else torch.zeros(2, 0),
    )
    assert sorted(owner[s] for s in values if owner[s] >= 0) == list(range(len(sequences)))
    for segment, value in values.items():
        if owner[segment] >= 0:
            torch.testing.assert_close(value, expected[owner[segment]], atol=1e-5, rtol=1e-5)
        else:
            assert value.numel() == 0
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_share_prompts_config_refuses_context_parallelism():
    with pytest.raises(RLConfigError, match="share_prompts"):
        GRPOConfig.from_dict(
            {"packing": {"share_prompts": True}, "train_parallel": {"cp": 2, "dp": 1}}
        )


def _steps(share: bool) -> list[dict[str, float]]:
    import torch.distributed as dist

    from mcore_rl.distributed import init_worker_state
    from mcore_rl.worker import GRPOWorker

    config = GRPOConfig.from_dict(
        {
            "model": {"hidden_size": 32, "num_layers": 2},
            "rollout": {
                "num_prompts": 3,
                "group_size": 4,
                "max_new_tokens": 4,
                "reward_requires_stop": False,
                "share_prompt_prefixes": share,
            },
            "packing": {"share_prompts": share, "max_tokens_per_microbatch": 48},
            "loss": {"kl_beta": 0.1, "entropy_coef": 0.1},
            "run": {"progress": False, "device": "cpu"},
        }
    )
    worker = GRPOWorker(config, init_worker_state(config))
    try:
        return [worker.step(step) for step in range(2)]
    finally:
        worker.close()
        dist.destroy_process_group()


def test_grpo_steps_with_shared_prompts_equal_steps_without():
    plain, shared = _steps(False), _steps(True)
    for a, b in zip(plain, shared):
        # Same samples (the weights after step 0 agree to rounding), same losses.
        assert a["reward/mean"] == b["reward/mean"]
        assert a["response/length"] == b["response/length"]
        for name in ("loss", "kl", "entropy", "grad_norm"):
            assert abs(a[name] - b[name]) <= 1e-5 * max(1.0, abs(a[name])), name
    # Fewer tokens per row than one copy per sequence.
    assert shared[0]["packing/efficiency"] > 1.0


def test_shared_prompt_rows_over_data_parallel_ranks_hold_every_completion_once():
    from mcore_rl.shared_prompts import build_shared_prompt_rows

    sequences, prompts = _groups(2)
    logprobs = [[float(i)] * (len(s) - p) for i, (s, p) in enumerate(zip(sequences, prompts))]
    seen: list[float] = []
    for rank in range(2):
        context, packed, efficiency = build_shared_prompt_rows(
            sequences,
            prompts,
            [0.5] * len(sequences),
            logprobs,
            token_budget=16,
            pad_multiple=4,
            max_sequences_per_bin=4,
            dp_size=2,
            dp_rank=rank,
            bin_multiple=2,
        )
        assert context.input_ids.shape[0] % 2 == 0 and context.prefix_of is not None
        assert all(len(context.info.bins[b]) <= 4 for b in context.bin_indices if b >= 0)
        seen += packed[context.loss_mask.bool()].tolist()
        assert torch.all(context.advantages[context.loss_mask.bool()] == 0.5)
    # Every completion token's inference log-prob (its sequence index) lands exactly once.
    expected = [v for values in logprobs for v in values]
    assert sorted(seen) == sorted(expected)
    assert efficiency > 0
