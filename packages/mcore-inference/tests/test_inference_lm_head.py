"""The LM head in vocabulary slices (``mcore_inference.lm_head``) against one ``F.linear`` and
``torch.argmax``, and the engine with it against the model's own forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams, fused_decode, lm_head
from mcore_inference.lm_head import SlicedLMHead, slice_bounds
from mcore_models import GPTConfig, GPTModel


def test_slice_bounds_cover_the_columns_in_aligned_slices():
    assert slice_bounds(1000, 4, 128) == (0, 256, 512, 768, 1000)
    assert slice_bounds(100, 4, 128) == (0, 100)  # narrower than one aligned slice
    assert slice_bounds(151936, 16) == (*range(0, 151936, 9728), 151936)
    with pytest.raises(ValueError, match="slices=0"):
        slice_bounds(10, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slices", [1, 3, 5])
def test_logits_and_argmax_equal_one_linear_and_torch_argmax_with_ties(dtype, slices):
    generator = torch.Generator().manual_seed(slices)
    weight = torch.randn(1100, 16, generator=generator).to(dtype)
    hidden = torch.randn(6, 16, generator=generator).to(dtype)
    # Equal logits in different slices: the first column wins (torch.argmax's rule).
    weight[1000] = weight[40] = weight[700] = hidden[0] * 4
    weight[900] = 0.0  # every row's logit 0.0 at 900 ...
    hidden[1] = 0.0  # ... and row 1 all zeros: column 0
    head = SlicedLMHead(slices)
    head_align = lm_head.SLICE_ALIGN
    try:
        lm_head.SLICE_ALIGN = 128
        logits, tokens = head(hidden, weight, argmax=True)
        plain, none = head(hidden, weight)
    finally:
        lm_head.SLICE_ALIGN = head_align
    expected = F.linear(hidden, weight)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(plain, logits)
    assert none is None
    assert tokens is not None and tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.float().argmax(dim=-1))
    assert tokens[0].item() == 40 and tokens[1].item() == 0


def test_engine_with_a_sliced_lm_head_generates_what_the_model_forward_generates(monkeypatch):
    # Every step's logits in three vocabulary slices (min rows 1): the same greedy tokens,
    # seeded samples and log-probs as the model's own forward.
    model = GPTModel(GPTConfig.from_name("tiny", vocab_size=600, seed=3)).eval()
    prompts = [[3, 9, 4, 7, 1], [12, 2], [5, 8, 13, 21, 34, 55, 6, 10]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, return_logprobs=True),
        SamplingParams(temperature=0.9, top_k=12, seed=7, max_tokens=5, return_logprobs=True),
        SamplingParams(temperature=0.0, max_tokens=7, return_logprobs=True),
    ]

    def generate(fused: bool) -> list:
        config = InferenceConfig(
            max_batch_size=4, max_sequence_length=32, block_size=4, fused_decode=fused
        )
        with InferenceEngine(model, config) as engine:
            outputs = [(r.tokens, r.logprobs) for r in engine.generate(prompts, params)]
            decoder = engine._decoder
            assert (decoder is not None and decoder._sliced_head is not None) == fused
            return outputs

    expected = generate(False)
    monkeypatch.setattr(lm_head, "LM_HEAD_SLICES", (3, 1))
    monkeypatch.setattr(lm_head, "SLICE_ALIGN", 64)
    monkeypatch.setattr(fused_decode, "LM_HEAD_GEMV_MAX_ROWS", 0)
    actual = generate(True)
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(actual, expected):
        assert tokens == expected_tokens
        torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=0)
