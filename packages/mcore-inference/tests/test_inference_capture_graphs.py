"""``InferenceEngine.capture_graphs``: every decode graph captured up front (what the server does
at startup), results unchanged, no capture left for the steps; nothing to capture on the CPU."""

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel


def _model(device):
    config = GPTConfig.from_name("tiny", vocab_size=256, num_layers=2, seed=4)
    return GPTModel(config, device=device).eval()


def _config(**overrides):
    fields = dict(max_batch_size=8, max_sequence_length=96, block_size=16)
    fields.update(overrides)
    return InferenceConfig(**fields)


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
