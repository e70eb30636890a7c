"""Packed rows with shared prefixes (``PackedSeqParams.prefix_of``) equal one copy per sequence."""

from __future__ import annotations

import pytest
import torch

from mcore_models import GPTConfig, GPTModel, ModelConfigError, PackedSeqError, PackedSeqParams
from mcore_models.gpt.attention_backends import build_attention_mask


@pytest.fixture(scope="module")
def model() -> GPTModel:
    # Grouped-query attention (4 query heads, 2 key/value heads).
    return GPTModel(GPTConfig.from_name("tiny", num_query_groups=2, seed=3))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _shared_row(prompts, completions_of):
    """[prefix, child, child, ..., prefix, child, ...] with each child = last prompt token +
    its completion, positions continuing the prefix's; and the unshared sequences."""
    tokens, positions, lengths, parents, spans, unshared = [], [], [], [], [], []
    for prompt, completions in zip(prompts, completions_of):
        parent = len(lengths)
        tokens += prompt[:-1]
        positions += list(range(len(prompt) - 1))
        lengths.append(len(prompt) - 1)
        parents.append(-1)
        for completion in completions:
            child = [prompt[-1], *completion]
            spans.append((len(tokens), len(child)))
            tokens += child
            positions += list(range(len(prompt) - 1, len(prompt) - 1 + len(child)))
            lengths.append(len(child))
            parents.append(parent)
            unshared.append(prompt + completion)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(
        cu_seqlens=cu, max_seqlen=max(lengths), prefix_of=torch.tensor(parents)
    )
    return torch.tensor([tokens]), torch.tensor([positions]), packed, spans, unshared


@pytest.mark.parametrize("backend", ["sdpa", "flex", "eager"])
def test_shared_prefix_logits_and_gradients_equal_one_copy_per_sequence(model, backend):
    prompts = [_ids(7, 0), _ids(4, 1)]
    completions = [[_ids(3, 2), _ids(5, 3), _ids(1, 4)], [_ids(6, 5)]]
    ids, positions, packed, spans, unshared = _shared_row(prompts, completions)
    model.config.attention_backend = backend
    try:
        model.zero_grad()
        logits = model(ids, positions, packed_seq_params=packed)
        # The loss reads every child's logits (the completions' predictions).
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9))
        chosen = torch.cat([logits[0, s : s + n] for s, n in spans])
        chosen_w = torch.cat([weights[0, s : s + n] for s, n in spans])
        (chosen * chosen_w).sum().backward()
        shared_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model.config.attention_backend = "eager"
        total = 0.0
        for (s, n), sequence, w in zip(spans, unshared, (weights[0, s : s + n] for s, n in spans)):
            out = model(torch.tensor([sequence]))[0, len(sequence) - n :]
            torch.testing.assert_close(
                logits[0, s : s + n].detach(), out.detach(), atol=1e-5, rtol=1e-5
            )
            total = total + (out * w).sum()
        total.backward()
    finally:
        model.config.attention_backend = "sdpa"
    for got, want in zip(shared_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_dense_mask_lets_children_see_their_prefix_only():
    cu = torch.tensor([0, 2, 4, 5, 7], dtype=torch.int32)
    packed = PackedSeqParams(cu_seqlens=cu, max_seqlen=2, prefix_of=torch.tensor([-1, 0, 0, -1]))
    dense = build_attention_mask("eager", 7, torch.device("cpu"), packed).dense(torch.device("cpu"))
    # Sequence 2 (token 4) sees the prefix (0, 1) and itself, never its sibling (2, 3).
    assert dense[4].tolist() == [True, True, False, False, True, False, False]
    assert dense[6].tolist() == [False] * 5 + [True, True]


def test_prefix_of_rejects_malformed_values():
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(PackedSeqError, match="prefix_of"):
        PackedSeqParams(cu_seqlens=cu, max_seqlen=2, prefix_of=torch.tensor([-1, 1]))
    with pytest.raises(PackedSeqError, match="prefix_of"):
        PackedSeqParams(cu_seqlens=cu, max_seqlen=2, prefix_of=torch.tensor([-1]))
    with pytest.raises(PackedSeqError, match="prefix_of"):
        PackedSeqParams(cu_seqlens=cu, max_seqlen=2, prefix_of=[-1, 0])  # type: ignore[arg-type]


def test_batch_invariant_attention_refuses_shared_prefixes():
    from mcore_models.gpt.batch_invariant import invariant_attention

    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    packed = PackedSeqParams(cu_seqlens=cu, max_seqlen=2, prefix_of=torch.tensor([-1, 0]))
    mask = build_attention_mask("sdpa", 4, torch.device("cpu"), packed)
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ModelConfigError, match="prefix"):
        invariant_attention(q, q, q, mask, 1.0)
