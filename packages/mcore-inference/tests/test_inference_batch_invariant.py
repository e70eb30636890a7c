"""Batch-invariant mode: engine tokens/log-probs independent of the batch and equal to training."""

import pytest
import torch
from _engine_configs import engine_config

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.sample_step import _row_logprobs
from mcore_kernels import token_logprobs
from mcore_models import MoEConfig, PackedSeqParams, parallelize
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel
from mcore_parallel import initialize
from mcore_parallel.testing import run_distributed

VOCAB = 256


def _model(kind, device="cpu", dtype=torch.float32, invariant=True):
    moe = MoEConfig(num_experts=4, top_k=2) if kind == "moe" else None
    config = GPTConfig.from_name(
        "tiny", vocab_size=VOCAB, seed=1234, moe=moe, batch_invariant=invariant, dtype=dtype
    )
    return GPTModel(config, device=device).eval()


def _flat(lists):
    return [item for items in lists for item in items]


def _prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


PROMPTS = _prompts((5, 11, 3, 17, 9, 1))


def _generate(model, prompts, params=None, **overrides):
    params = params or SamplingParams(temperature=0.0, max_tokens=6, return_logprobs=True)
    with InferenceEngine(model, engine_config(**overrides)) as engine:
        return engine.generate(prompts, params)


@torch.no_grad()
def _training_logprobs(model, prompts, results):
    """Log-probs of the generated tokens from one packed training forward (``labels=``)."""
    sequences = [p + r.tokens for p, r in zip(prompts, results, strict=True)]
    lengths = torch.tensor([len(s) for s in sequences])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    device = next(model.parameters()).device
    ids = torch.tensor([_flat(sequences)], device=device)
    labels = torch.tensor([_flat([*s[1:], 0] for s in sequences)], device=device)
    packed = PackedSeqParams(cu_seqlens=cu.to(device), max_seqlen=int(lengths.max()))
    logprobs = model(ids, packed_seq_params=packed, labels=labels)[0].cpu()
    out = []
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        first = int(cu[i]) + len(prompt) - 1
        out.append(logprobs[first : first + len(result.tokens)].tolist())
    return out


@pytest.fixture(scope="module", params=["dense", "moe"])
def invariant_model(request):
    return _model(request.param)


@pytest.fixture(scope="module")
def reference_results(invariant_model):
    return _generate(invariant_model, PROMPTS)


def test_tokens_and_logprobs_bitwise_equal_across_batches_and_chunk_sizes(
    invariant_model, reference_results
):
    variants = [
        (PROMPTS[::-1], dict(prefill_chunk_size=3, max_batch_size=2)),
        (PROMPTS[2:] + PROMPTS[:2], dict(prefill_chunk_size=5, max_tokens_per_step=9)),
    ]
    expected = {tuple(p): r for p, r in zip(PROMPTS, reference_results, strict=True)}
    for prompts, overrides in variants:
        for prompt, result in zip(prompts, _generate(invariant_model, prompts, **overrides)):
            want = expected[tuple(prompt)]
            assert result.tokens == want.tokens
            assert result.logprobs == want.logprobs
    alone = _generate(invariant_model, [PROMPTS[1]])[0]
    assert alone.logprobs == reference_results[1].logprobs


def test_packed_training_forward_equals_engine_logprobs_bitwise(invariant_model, reference_results):
    training = _training_logprobs(invariant_model, PROMPTS, reference_results)
    for result, logprobs in zip(reference_results, training, strict=True):
        assert logprobs == result.logprobs


def test_sampled_tokens_independent_of_batch_with_seeds(invariant_model):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=5, return_logprobs=True)
    together = _generate(invariant_model, PROMPTS[:4], params)
    alone = [_generate(invariant_model, [p], params)[0] for p in PROMPTS[:2]]
    for one, many in zip(alone, together, strict=False):
        assert one.tokens == many.tokens and one.logprobs == many.logprobs
    # Log-probs at temperature 0.8 equal the training forward's token_logprobs(temperature=0.8).
    sequence = PROMPTS[0] + together[0].tokens
    with torch.no_grad():
        logits = invariant_model(torch.tensor([sequence]))[0]
    start = len(PROMPTS[0]) - 1
    targets = torch.tensor(sequence[start + 1 :])
    expected = token_logprobs(logits[start:-1], targets, temperature=0.8)
    assert expected.tolist() == together[0].logprobs


def test_engine_flag_turns_the_mode_on_for_a_plain_model():
    model = _model("dense", invariant=False)
    with_flag = _generate(model, PROMPTS[:3], batch_invariant=True)
    invariant = _generate(_model("dense"), PROMPTS[:3])
    assert [r.logprobs for r in with_flag] == [r.logprobs for r in invariant]


def test_without_the_mode_training_and_engine_logprobs_differ():
    # The property above is not free: without the mode the packed forward (SDPA, one GEMM for
    # all rows) and the engine (paged kernel, per-step GEMMs) round differently.
    model = _model("dense", invariant=False)
    results = _generate(model, PROMPTS)
    training = _training_logprobs(model, PROMPTS, results)
    assert any(t != r.logprobs for t, r in zip(training, results, strict=True))


def _tensor_parallel_run():
    torch.set_num_threads(1)
    state = initialize(tp=2)
    model = parallelize(_model("dense"), state).eval()
    fields = dict(max_batch_size=8, max_sequence_length=64, block_size=4, prefill_chunk_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=5, return_logprobs=True)
    with InferenceEngine(model, InferenceConfig(**fields)) as engine:
        together = engine.generate(PROMPTS, params)
        alone = engine.generate(PROMPTS[1:2], params)
    # The RL trainer's path: full-vocabulary logits of a packed row, then token_logprobs.
    sequences = [p + r.tokens for p, r in zip(PROMPTS, together, strict=True)]
    lengths = torch.tensor([len(s) for s in sequences])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    packed = PackedSeqParams(cu_seqlens=cu, max_seqlen=int(lengths.max()))
    with torch.no_grad():
        logits = model(torch.tensor([_flat(sequences)]), packed_seq_params=packed)[0]
    targets = torch.tensor(_flat([*s[1:], 0] for s in sequences))
    training = token_logprobs(logits, targets)
    pairs = []
    for i, (prompt, result) in enumerate(zip(PROMPTS, together, strict=True)):
        first = int(cu[i]) + len(prompt) - 1
        pairs.append((training[first : first + len(result.tokens)].tolist(), result.logprobs))
    return pairs, alone[0].logprobs, together[1].logprobs


def test_tensor_parallel_engine_equals_training_forward_bitwise():
    for pairs, alone, in_batch in run_distributed(_tensor_parallel_run, 2):
        assert alone == in_batch
        for training, engine in pairs:
            assert training == engine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_gpu_bf16_cuda_graphs_engine_equals_training_bitwise(kind):
    model = _model(kind, device="cuda", dtype=torch.bfloat16)
    prompts = _prompts((5, 37, 3, 120, 9, 1, 64, 17), seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, return_logprobs=True)
    fields = dict(max_batch_size=16, max_sequence_length=256, block_size=16, use_cuda_graphs=True)
    graphs = _generate(model, prompts, params, **fields)
    eager = _generate(model, prompts[::-1], params, **{**fields, "use_cuda_graphs": False})[::-1]
    chunked = _generate(model, prompts, params, **{**fields, "prefill_chunk_size": 7})
    alone = [_generate(model, [p], params, **fields)[0] for p in prompts[:2]]
    for a, b, c in zip(graphs, eager, chunked, strict=True):
        assert a.tokens == b.tokens == c.tokens
        assert a.logprobs == b.logprobs == c.logprobs
    for a, b in zip(alone, graphs, strict=False):
        assert a.logprobs == b.logprobs
    training = _training_logprobs(model, prompts, graphs)
    for result, logprobs in zip(graphs, training, strict=True):
        assert logprobs == result.logprobs


def test_engine_logprobs_come_from_the_logits_in_the_model_dtype():
    # The engine's float32 logits are bf16 values upcast; the log-probs are computed from them
    # in bf16, per temperature, exactly as the trainer's token_logprobs(bf16 logits, t).
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 300, generator=generator).bfloat16()
    tokens = torch.randint(0, 300, (5,), generator=generator)
    temperatures = [1.0, 0.5, 1.0, 2.0, 0.5]
    values = _row_logprobs(logits.float(), tokens, temperatures, torch.bfloat16)
    for i, temperature in enumerate(temperatures):
        expected = token_logprobs(logits[i : i + 1], tokens[i : i + 1], temperature=temperature)
        assert torch.equal(values[i : i + 1], expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_large_vocabulary_engine_equals_training_bitwise():
    # A Llama-3 sized vocabulary: the log-prob kernel reads several 4096-wide chunks per row;
    # fed float32 instead of bf16 logits, it sums them in another order (one ulp apart).
    config = GPTConfig.from_name(
        "tiny", vocab_size=128256, seed=1234, batch_invariant=True, dtype=torch.bfloat16
    )
    model = GPTModel(config, device="cuda").eval()
    prompts = _prompts((5, 37, 3, 120, 9, 1, 64, 17), seed=4)
    fields = dict(max_batch_size=16, max_sequence_length=256, block_size=16, use_cuda_graphs=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, return_logprobs=True)
    results = _generate(model, prompts, greedy, **fields)
    training = _training_logprobs(model, prompts, results)
    for result, logprobs in zip(results, training, strict=True):
        assert logprobs == result.logprobs
    sampled = SamplingParams(temperature=0.7, seed=3, max_tokens=8, return_logprobs=True)
    result = _generate(model, prompts[1:2], sampled, **fields)[0]
    sequence = prompts[1] + result.tokens
    with torch.no_grad():
        hidden = model(torch.tensor([sequence], device="cuda"), return_hidden=True)[0]
        logits = model.compute_logits(hidden, upcast=False)
    start = len(prompts[1]) - 1
    targets = torch.tensor(sequence[start + 1 :], device="cuda")
    expected = token_logprobs(logits[start:-1], targets, temperature=0.7)
    assert expected.tolist() == result.logprobs
