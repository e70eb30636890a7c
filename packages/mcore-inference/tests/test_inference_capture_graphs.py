"""``InferenceEngine.capture_graphs``: every decode graph captured up front (what the server does
at startup), results unchanged, no capture left for the steps; nothing to capture on the CPU.
With graphs for steps that prefill (``cuda_graph_mixed_steps``), their own graphs (the buckets
where decode steps take the rotary-in-attention path) are captured up front too."""

from types import SimpleNamespace

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams, fused_decode
from mcore_inference.cuda_graphs import DecodeGraphRunner
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel


def _model(device):
    config = GPTConfig.from_name("tiny", vocab_size=256, num_layers=2, seed=4)
    return GPTModel(config, device=device).eval()


def _config(**overrides):
    fields = dict(max_batch_size=8, max_sequence_length=96, block_size=16)
    fields.update(overrides)
    return InferenceConfig(**fields)


def _runner_keys(batch_sizes, mixed_steps, decoder=True):
    """The graph keys ``capture_all`` captures, with the capture itself recorded (no CUDA)."""
    runner = object.__new__(DecodeGraphRunner)
    runner.batch_sizes = batch_sizes
    runner._graphs = {}
    runner._narrow_width, runner._full_width = 2, 5
    one_token = fused_decode.FusedDecoder.one_token_per_sequence_matters
    runner._decoder = SimpleNamespace(one_token_per_sequence_matters=one_token) if decoder else None

    def capture(bucket, width, decode=False):
        runner._graphs[bucket, width, decode] = (None, None)

    runner._capture = capture
    count = runner.capture_all(mixed_steps=mixed_steps)
    assert count == len(runner._graphs)
    return runner, set(runner._graphs)


@pytest.mark.parametrize("min_rows", [65, 0])
def test_capture_all_holds_every_key_a_step_looks_up(monkeypatch, min_rows):
    monkeypatch.setattr(fused_decode, "ROTARY_IN_ATTENTION_MIN_ROWS", min_rows)
    sizes = (1, 8, 64, 80, 256)
    runner, keys = _runner_keys(sizes, mixed_steps=True)
    # What run() looks up for a decode step and for a step that prefills, at every bucket.
    wanted = {
        (bucket, width, runner._decode_key(bucket, decode))
        for bucket in sizes
        for width in (2, 5)
        for decode in (True, False)
    }
    assert keys == wanted
    split = [b for b in sizes if min_rows and b >= min_rows]
    assert len(keys) == 2 * (len(sizes) + len(split))
    assert {(b, w, True) for b in split for w in (2, 5)} <= keys


def test_capture_all_without_mixed_steps_captures_the_decode_graphs_only():
    sizes = (1, 64, 80, 256)
    _, keys = _runner_keys(sizes, mixed_steps=False)
    assert keys == {
        (b, w, b >= fused_decode.ROTARY_IN_ATTENTION_MIN_ROWS) for b in sizes for w in (2, 5)
    }
    _, keys = _runner_keys(sizes, mixed_steps=True, decoder=False)
    assert keys == {(b, w, False) for b in sizes for w in (2, 5)}


def test_nothing_to_capture_on_the_cpu():
    with InferenceEngine(_model("cpu"), _config()) as engine:
        assert engine.capture_graphs() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_bucket_is_captured_up_front_and_results_are_unchanged():
    model = _model("cuda")
    prompts = [[3, 4, 5], [7] * 20, [1, 2]]
    params = SamplingParams(temperature=0.0, max_tokens=60)
    with InferenceEngine(model, _config()) as engine:
        expected = engine.generate(prompts, params)
    # An attention split of 32 tokens: the contexts cross it, so both table widths are used.
    with InferenceEngine(model, _config(attention_split_size=32)) as engine:
        graphs = engine._runner.graphs
        count = engine.capture_graphs()
        assert graphs.captured == engine.config.graph_batch_sizes() == (1, 2, 4, 8)
        assert count == 2 * len(graphs.captured)  # narrow and full block table per bucket
        assert engine.capture_graphs() == 0  # nothing left
        results = engine.generate(prompts, params)
        assert len(graphs._graphs) == count  # the steps captured nothing more
    with InferenceEngine(model, _config(use_cuda_graphs=False)) as engine:
        assert engine.capture_graphs() == 0
    assert [r.tokens for r in results] == [e.tokens for e in expected]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_steps_that_prefill_past_64_tokens_capture_nothing_after_startup():
    # Buckets up to 80: a step of more than 64 tokens that prefills replays the bucket-80 graph
    # of steps that prefill, which differs from the bucket's decode graph (rotary in attention).
    model = _model("cuda").to(torch.bfloat16)
    prompts = [[(7 * i + j) % 256 for j in range(30)] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    config = _config(max_batch_size=80, max_sequence_length=64)
    with InferenceEngine(model, config) as engine:
        expected = engine.generate(prompts, params)  # graphs captured lazily
    with InferenceEngine(model, config) as engine:
        graphs = engine._runner.graphs
        assert engine._runner.graph_mixed_steps and engine._runner.decoder is not None
        count = engine.capture_graphs()
        assert any(not decode and bucket == 80 for bucket, _, decode in graphs._graphs)
        results = engine.generate(prompts, params)
        assert len(graphs._graphs) == count  # no step captured a graph
    assert [r.tokens for r in results] == [e.tokens for e in expected]
