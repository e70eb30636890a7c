"""Sampling and stop criteria against plain torch definitions."""

import math

import pytest
import torch

from mcore_inference import FinishReason, SamplingParams
from mcore_inference.sampling import sample_tokens, sampling_uniform, truncate_logits
from mcore_inference.stopping import StopCriteria


def test_sampling_uniform_is_a_pure_function_in_the_open_unit_interval():
    values = [sampling_uniform(seed, index) for seed in range(20) for index in range(50)]
    assert values == [sampling_uniform(seed, index) for seed in range(20) for index in range(50)]
    assert all(0.0 < v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    mean = sum(values) / len(values)
    assert abs(mean - 0.5) < 0.03


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    tokens = sample_tokens(logits, [SamplingParams(temperature=0.0)] * 6, [0.5] * 6)
    assert torch.equal(tokens, logits.argmax(-1))


def test_sampled_frequencies_follow_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    params = SamplingParams(temperature=0.8)
    draws = 4000
    uniforms = [sampling_uniform(7, index) for index in range(draws)]
    tokens = sample_tokens(logits.expand(draws, 5), [params] * draws, uniforms)
    counts = torch.bincount(tokens, minlength=5).float()
    expected = torch.softmax(logits[0] / 0.8, -1)
    # 5 standard deviations of a binomial proportion.
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / draws)
    assert torch.all((counts / draws - expected).abs() < tolerance)


def test_truncate_logits_keeps_top_k_and_nucleus_like_a_sorted_reference():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=generator)
    top_k = torch.tensor([0, 3, 0, 5])
    top_p = torch.tensor([0.5, 1.0, 1.0, 0.3])
    kept = torch.isfinite(truncate_logits(logits, top_k, top_p))
    for row in range(4):
        order = logits[row].argsort(descending=True)
        probs = logits[row].softmax(-1)[order]
        keep = len(order) if top_k[row] == 0 else int(top_k[row])
        if top_p[row] < 1:
            nucleus = int((probs.cumsum(0) - probs < top_p[row]).sum())
            keep = min(keep, nucleus)
        assert set(order[:keep].tolist()) == set(kept[row].nonzero()[:, 0].tolist())


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=2.0, top_k=1)] * 8
    uniforms = [sampling_uniform(3, i) for i in range(8)]
    assert torch.equal(sample_tokens(logits, params, uniforms), logits.argmax(-1))


def test_a_row_is_sampled_the_same_whatever_the_other_rows():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 64, generator=generator)
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.0)] * 2
    params.append(SamplingParams(temperature=1.3, top_k=10))
    uniforms = [sampling_uniform(i, 0) for i in range(5)]
    together = sample_tokens(logits, params, uniforms)
    for row in range(5):
        alone = sample_tokens(logits[row : row + 1], [params[row]], [uniforms[row]])
        assert alone[0] == together[row]


def test_stop_token_and_multi_token_stop_word():
    criteria = StopCriteria(SamplingParams(stop_token_ids=(9,), stop_words=((4, 5, 6),)))
    assert criteria.check([1, 4, 5]) is None
    assert criteria.check([1, 4, 5, 6]) == FinishReason.STOP_WORD
    assert criteria.check([4, 1, 5, 6]) is None  # not consecutive
    assert criteria.check([2, 9]) == FinishReason.STOP_TOKEN


def test_stop_string_needs_the_whole_string_in_the_decoded_tail():
    vocabulary = {1: "he", 2: "llo", 3: " wor", 4: "ld"}
    criteria = StopCriteria(
        SamplingParams(stop_words=("world",)), lambda ids: "".join(vocabulary[i] for i in ids)
    )
    assert criteria.check([1, 2, 3]) is None
    assert criteria.check([1, 2, 3, 4]) == FinishReason.STOP_WORD


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("seed", -3),
        ("max_tokens", -1),
        ("stop_token_ids", (-2,)),
        ("stop_words", ((),)),
        ("stop_words", ("",)),
        ("stop_words", "</s>"),
        ("stop_words", (1, 2)),
        ("stop_token_ids", 7),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    from mcore_inference import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=field.rstrip("s")):
        SamplingParams(**{field: value})


def test_nan_free_for_extreme_temperatures():
    logits = torch.tensor([[1000.0, -1000.0, 0.0]])
    tokens = sample_tokens(logits, [SamplingParams(temperature=1e-4)], [0.999])
    assert tokens.tolist() == [0]
    assert not math.isnan(float(torch.softmax(logits / 1e-4, -1)[0, 0]))
