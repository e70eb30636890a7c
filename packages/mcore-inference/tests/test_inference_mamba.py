"""Hybrid (Mamba-2) models in the engine: state slots, chunked prefill, continuous batching.

Oracles: the model's own full forward (chunked prefill and batching must not change a request's
logits) and transformers' ``generate`` with its recurrent cache on tiny ``mamba2`` and
``nemotron_h`` checkpoints.
"""

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.errors import BlockAllocatorError, KVCacheExhaustedError
from mcore_inference.mamba_graphs import HybridGraphRunner
from mcore_inference.mamba_state import StateSlotAllocator
from mcore_models.mamba import HybridModel, hybrid_preset
from mcore_models.testing import TINY_MAMBA2, TINY_NEMOTRON_H

transformers = pytest.importorskip("transformers")

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [2, 71, 82], [8, 1, 8, 2, 8, 1, 8]]


@pytest.fixture(scope="module")
def model():
    return HybridModel(hybrid_preset("tiny-hybrid", seed=7)).eval()


def _greedy_reference(model, prompt, count):
    ids = list(prompt)
    logprobs = []
    for _ in range(count):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, -1].double()
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids[len(prompt) :], logprobs


def _engine(model, chunk, **overrides):
    config = dict(
        max_batch_size=4,
        max_sequence_length=64,
        prefill_chunk_size=chunk,
        max_tokens_per_step=max(chunk, 4),
    )
    config.update(overrides)
    return InferenceEngine(model, InferenceConfig(**config))


@pytest.mark.parametrize("chunk", [1, 4, 5, 64])
def test_chunked_prefill_equals_one_shot_prefill(model, chunk):
    params = SamplingParams(temperature=0, max_tokens=5, return_logprobs=True)
    with _engine(model, chunk) as engine:
        results = engine.generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, results, strict=True):
        tokens, logprobs = _greedy_reference(model, prompt, 5)
        assert result.tokens == tokens
        torch.testing.assert_close(result.logprobs, logprobs, atol=1e-4, rtol=0)


def test_graph_padding_of_decode_and_non_decode_steps_equals_eager(model):
    """The graphs' padded static buffers (scratch slot, padding sequences), run uncaptured.

    With asynchronous token readback (the default), decode rows take their token from the
    previous step's samples on the device: the static buffers must be filled from there too.
    """
    params = SamplingParams(temperature=0, max_tokens=6, return_logprobs=True)
    with _engine(model, 5, max_tokens_per_step=12) as engine:
        eager = engine.generate(PROMPTS, params)
    with _engine(model, 5, max_tokens_per_step=12) as engine:
        runner = engine._runner
        assert runner is not None and engine.mamba_states is not None
        graphs = HybridGraphRunner(
            model,
            engine.kv_cache,
            engine.mamba_states,
            engine.scheduler.block_tables,
            engine.scheduler.padding_row,
            (1, 2, 4),
            (8, 16),
        )
        steps = []
        deferred = []

        def padded(microbatch):
            steps.append(graphs.bucket_of(microbatch))
            deferred.append(bool(microbatch.deferred_rows))
            return graphs.run_padded_eagerly(microbatch)

        graphs.run = padded
        runner.hybrid_graphs = graphs
        padded_results = engine.generate(PROMPTS, params)
    assert {decode for decode, _ in steps} == {True, False}
    assert any(bucket == 16 for decode, bucket in steps if not decode)
    # Asynchronous readback: decode tokens still on the device fill the static inputs too.
    assert any(deferred)
    for a, b in zip(eager, padded_results, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_state_slots_are_all_free_after_a_soak(model):
    generator = torch.Generator().manual_seed(0)
    with _engine(model, 3, max_batch_size=3) as engine:
        states = engine.mamba_states
        assert states is not None
        # KV storage for the one attention layer of "M*M-" only; state slots per Mamba layer.
        assert engine.kv_cache.keys.shape[0] == 1
        assert sorted(states.ssm_states) == [0, 2]
        ids = []
        for i in range(14):
            length = int(torch.randint(1, 12, (1,), generator=generator))
            prompt = torch.randint(0, 128, (length,), generator=generator).tolist()
            ids.append(
                engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1 + i % 4))
            )
            if i % 5 == 4:
                engine.abort(ids[-2])
            engine.step()
            assert states.allocator.num_free + engine.num_active == 3
        while engine.has_unfinished():
            engine.step()
        assert states.allocator.num_free == 3
        assert engine.allocator.num_free == engine.allocator.capacity
        # A reused slot starts from zeros: a late request equals the reference.
        result = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4))
        assert result[0].tokens == _greedy_reference(model, PROMPTS[1], 4)[0]
    assert engine.mamba_states is None


def test_state_slot_allocator_refuses_double_allocation_and_overflow():
    allocator = StateSlotAllocator(2)
    allocator.allocate(10)
    with pytest.raises(BlockAllocatorError, match="request_id=10 already holds"):
        allocator.allocate(10)
    allocator.allocate(11)
    with pytest.raises(KVCacheExhaustedError, match="all 2 Mamba state slots"):
        allocator.allocate(12)
    assert allocator.free(10) is not None and allocator.free(10) is None
    assert allocator.num_free == 1


def _hf_models():
    mamba = transformers.Mamba2ForCausalLM(
        transformers.Mamba2Config(**TINY_MAMBA2, num_hidden_layers=2, eos_token_id=None)
    )
    nemotron = transformers.NemotronHForCausalLM(
        transformers.NemotronHConfig(
            **{**TINY_NEMOTRON_H, "hybrid_override_pattern": "M*M-"}, eos_token_id=None
        )
    )
    return {"mamba2": mamba, "nemotron_h": nemotron}


@pytest.mark.parametrize("kind", ["mamba2", "nemotron_h"])
def test_greedy_generation_equals_transformers_generate(kind, tmp_path):
    torch.manual_seed(5)
    hf = _hf_models()[kind].eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("in_proj.weight", "out_proj.weight", "embeddings.weight")):
                param.mul_(8.0)  # sharper logits: greedy paths differ if the state is wrong
    hf.save_pretrained(tmp_path)
    model = HybridModel.from_hf(tmp_path)
    prompts = [[5, 9, 33, 1, 60, 7, 7, 2, 40], [11, 3]]
    with _engine(model, 4) as engine:
        results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    for prompt, result in zip(prompts, results, strict=True):
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert result.tokens == expected
    assert len({t for r in results for t in r.tokens}) > 3  # not a degenerate repetition
