"""The decode loop never synchronises with the device, except for its bounded readback.

A steady decode step (every request only continues) reads nothing back from the device but the
previous step's (or multi-step run's) sampled tokens, whose copy it started one step earlier
(:mod:`mcore_inference.readback`): one asynchronous copy started and at most one waited for per
host round trip. On the CPU the kernels run in Triton's interpreter (a fresh process: Triton
decides at import whether it interprets) and a dispatch-mode probe records every aten op that
reads a device value on the host (a synchronisation on CUDA); on a GPU the steps run with CUDA
graphs under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_kernels.testing import HostReadProbe
from mcore_models import GPTConfig, GPTModel

STEADY_STEPS = 4


def _params() -> list[SamplingParams]:
    """Greedy, tempered, top-k and top-p rows, with and without log-probs."""
    return [
        SamplingParams(temperature=0.0, max_tokens=100, return_logprobs=True),
        SamplingParams(temperature=0.8, top_k=7, seed=1, max_tokens=100),
        SamplingParams(temperature=1.1, top_p=0.9, seed=2, max_tokens=100, return_logprobs=True),
    ]


def _start_steady_decode(engine: InferenceEngine, multi_step: int) -> None:
    for i, params in enumerate(_params()):
        engine.add_request([3 + i, 4, 5, 6 + i], params)
    # Prefill done and every request decoding, with tokens read back one step late: a round
    # trip that brings every request a full run of tokens (how many round trips that takes
    # depends on the device's step timing, not on what the test checks).
    for _ in range(40):
        counts = [len(u.new_tokens) for u in engine.step_updates()]
        if len(counts) == 3 and all(count == multi_step for count in counts):
            return
    raise AssertionError("the three requests never reached steady decode steps")


def _steady_decode_reads(multi_step: int) -> dict[str, Any]:
    """In an interpreting process: host reads and readbacks of a few steady decode steps."""
    from mcore_inference import readback

    torch.set_num_threads(1)
    counts = {"start": 0, "wait": 0}
    start, wait = readback.SampleReadback.start, readback.DeferredSamples.wait

    def counted_start(self, *args, **kwargs):
        counts["start"] += 1
        return start(self, *args, **kwargs)

    def counted_wait(self):
        counts["wait"] += 1
        return wait(self)

    readback.SampleReadback.start = counted_start  # type: ignore[method-assign]
    readback.DeferredSamples.wait = counted_wait  # type: ignore[method-assign]
    model = GPTModel(GPTConfig.from_name("tiny", vocab_size=64, seed=23)).eval()
    config = InferenceConfig(
        max_batch_size=4, max_sequence_length=128, block_size=4, multi_step_decode=multi_step
    )
    with InferenceEngine(model, config) as engine:
        _start_steady_decode(engine, multi_step)
        counts["start"] = counts["wait"] = 0
        tokens = 0
        with HostReadProbe() as probe:
            for _ in range(STEADY_STEPS):
                tokens += sum(len(u.new_tokens) for u in engine.step_updates())
    return {"reads": probe.seen, "tokens": tokens, **counts}


@pytest.mark.parametrize("multi_step", [1, 8])
def test_steady_decode_steps_read_only_the_deferred_samples(monkeypatch, multi_step):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        result = pool.submit(_steady_decode_reads, multi_step).result(timeout=600)
    assert result["reads"] == []
    # One asynchronous copy started and at most one waited for per host round trip ...
    assert result["start"] == STEADY_STEPS
    assert result["wait"] <= STEADY_STEPS
    # ... each bringing one token per request (one step), or a run's tokens.
    assert result["tokens"] == 3 * STEADY_STEPS * multi_step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("multi_step", [1, 8])
def test_steady_decode_steps_with_graphs_never_synchronise_on_gpu(multi_step):
    model = GPTModel(GPTConfig.from_name("tiny", vocab_size=64, seed=23), device="cuda").eval()
    config = InferenceConfig(
        max_batch_size=4, max_sequence_length=128, block_size=4, multi_step_decode=multi_step
    )
    with InferenceEngine(model, config) as engine:
        engine.capture_graphs()
        _start_steady_decode(engine, multi_step)
        torch.cuda.synchronize()
        tokens = 0
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(STEADY_STEPS):
                tokens += sum(len(u.new_tokens) for u in engine.step_updates())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert tokens == 3 * STEADY_STEPS * multi_step
