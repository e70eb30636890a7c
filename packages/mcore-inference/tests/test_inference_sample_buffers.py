"""Reused sample buffers: the same samples as fresh tensors, whatever widths and log-prob
requests follow each other, and the in-order deferred-token fast path of ``Microbatch.inputs``."""

from __future__ import annotations

import math

import torch

from mcore_inference.batch import Microbatch
from mcore_inference.config import SamplingParams
from mcore_inference.request import Request
from mcore_inference.stage import SampleBuffers, sample_microbatch


def _microbatch(width: int, logprobs: list[bool]) -> Microbatch:
    requests = [
        Request(
            request_id=i,
            prompt=[1, 2, 3],
            params=SamplingParams(temperature=0.0, max_tokens=4, return_logprobs=logprobs[i]),
            seed=i,
            max_new_tokens=4,
        )
        for i in range(width)
    ]
    return Microbatch(entries=[(r, 1) for r in requests], sampling=requests)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(
        (math.isnan(x) and math.isnan(y)) or x == y
        for x, y in zip(a.flatten().tolist(), b.flatten().tolist(), strict=True)
    )


def test_reused_buffers_give_the_samples_of_fresh_tensors():
    buffers = SampleBuffers(torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    # Widths and log-prob requests change from step to step; some buffers come back with
    # log-probs or another width in their second row.
    steps = [
        (3, [True, True, True]),
        (3, [False, False, False]),
        (2, [True, False]),
        (3, [False, False, False]),
        (3, [False, False, False]),
        (1, [False]),
        (3, [False, True, False]),
        (3, [False, False, False]),
        (3, [False, False, False]),
        (3, [False, False, False]),
    ]
    for width, logprobs in steps:
        logits = torch.randn((width, 11), generator=generator)
        microbatch = _microbatch(width, logprobs)
        fresh = sample_microbatch(logits, microbatch)
        reused = sample_microbatch(logits, microbatch, buffers=buffers)
        assert reused.is_contiguous()
        assert _same(reused, fresh), (width, logprobs, reused, fresh)


def test_in_order_deferred_tokens_take_the_previous_samples():
    source = torch.tensor([[7.0, 9.0, 4.0], [float("nan")] * 3], dtype=torch.float64)
    for rows, columns in (([0, 1, 2], [0, 1, 2]), ([0, 2], [2, 0])):
        microbatch = Microbatch(entries=[])
        microbatch.tokens = [0, 0, 0]
        microbatch.positions = [5, 6, 7]
        microbatch.table_rows = [0, 1, 2]
        microbatch.deferred_rows = rows
        microbatch.deferred_columns = columns
        microbatch.token_source = source
        inputs = microbatch.inputs(torch.device("cpu"))
        expected = [0, 0, 0]
        for row, column in zip(rows, columns, strict=True):
            expected[row] = int(source[0, column])
        assert inputs[0].tolist() == expected
        assert inputs[1].tolist() == [5, 6, 7] and inputs[2].tolist() == [0, 1, 2]
