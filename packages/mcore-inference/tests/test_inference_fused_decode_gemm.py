"""The fused decoder's q/k/v and o projections as ``decode_gemm`` (steps of 3 to
``QKV_GEMM_MAX_ROWS`` / ``O_GEMM_MAX_ROWS`` tokens: Triton GEMMs with RoPE + the cache write,
and the residual add, in their epilogues) against the model's forward; the dispatch on the row
count; and, on a GPU, a bfloat16 engine whose greedy tokens equal the eager engine's."""

from __future__ import annotations

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams, fused_decode
from mcore_inference.fused_decode import FusedDecoder
from mcore_inference.kv_cache import PagedKVCache
from mcore_models import GPTConfig, GPTModel


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _model(seed: int, *, dtype: torch.dtype = torch.float32, qk_norm: bool = False) -> GPTModel:
    config = GPTConfig.from_name(
        "tiny", vocab_size=64, seed=seed, add_qkv_bias=True, qk_layernorm=qk_norm
    )
    model = GPTModel(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Biases start at zero and norm weights at one: give them values a slip would show.
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return model.to(dtype)


@pytest.fixture(scope="module")
def model() -> GPTModel:
    return _model(5)


TABLES = torch.tensor([[1, 2, 0], [3, 4, 0]], dtype=torch.int32)
POSITIONS = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
ROWS = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1])
TOKENS = torch.tensor([[7, 3, 9, 1, 2, 60, 4, 4, 33]])


def _forward(model, decoder=None):
    config = model.config
    cache = PagedKVCache(
        num_layers=config.num_layers,
        num_blocks=6,
        block_size=4,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.kv_channels,
        dtype=torch.float32,
        device=torch.device("cpu"),
        split_size=8,
    )
    cache.prepare_step(TABLES, POSITIONS, ROWS)
    with torch.no_grad():
        if decoder is None:
            return model(TOKENS, POSITIONS[None], kv_cache=cache, return_hidden=True), cache
        return decoder(TOKENS, POSITIONS[None], kv_cache=cache), cache


@pytest.fixture()
def gemm_calls(monkeypatch):
    """Count the decoder's ``decode_gemm`` launches (the real function still runs)."""
    calls: list[tuple[int, ...]] = []
    real = fused_decode.decode_gemm

    def counting(x, weight, *args, **kwargs):
        calls.append(tuple(x.shape))
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(fused_decode, "decode_gemm", counting)
    return calls


def test_gemm_projections_match_model_forward(model, gemm_calls):
    expected, expected_cache = _forward(model)
    decoder = FusedDecoder(model, gemv_max_rows=0, o_gemm_max_rows=9, qkv_gemm_max_rows=9)
    actual, cache = _forward(model, decoder)
    config = model.config
    # Two launches per layer: q/k/v (with RoPE and the cache write) and o, over 9 tokens.
    per_layer = [(9, config.hidden_size), (9, config.num_attention_heads * config.kv_channels)]
    assert gemm_calls == per_layer * len(model.layers)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.keys, expected_cache.keys, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache.values, expected_cache.values, atol=1e-6, rtol=1e-6)


def test_dispatch_on_the_row_count(model, gemm_calls):
    _forward(model, FusedDecoder(model, gemv_max_rows=0, o_gemm_max_rows=8, qkv_gemm_max_rows=8))
    assert not gemm_calls, "9 tokens > o/qkv_gemm_max_rows=8 must take the cuBLAS path"
    _forward(model, FusedDecoder(model, gemv_max_rows=0, o_gemm_max_rows=9, qkv_gemm_max_rows=8))
    assert len(gemm_calls) == len(model.layers), "only the o projections"
    gemm_calls.clear()
    _forward(model, FusedDecoder(model, gemv_max_rows=9, o_gemm_max_rows=16, qkv_gemm_max_rows=16))
    assert not gemm_calls, "9 tokens <= gemv_max_rows=9 must take the decode_gemv path"


PROMPTS = [[3, 9, 4, 7, 1], [12, 2], [5, 8, 13, 21, 34, 55, 6, 10, 11, 40, 41]]


def _generate(model, params, **options):
    config = InferenceConfig(
        max_batch_size=4,
        max_sequence_length=32,
        block_size=4,
        prefill_chunk_size=4,
        attention_split_size=8,
        **options,
    )
    with InferenceEngine(model, config) as engine:
        return [(r.tokens, r.logprobs) for r in engine.generate(PROMPTS, params)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "plain"])
def test_bfloat16_graph_engine_greedy_tokens_match_the_eager_engine_on_gpu(monkeypatch, qk_norm):
    # Every step of more than one token (prefill chunks included) runs the o projection (and,
    # without QK-norm, the q/k/v projection) as decode_gemm.
    monkeypatch.setattr(fused_decode, "GEMV_MAX_ROWS", 1)
    monkeypatch.setattr(fused_decode, "O_GEMM_MAX_ROWS", 512)
    monkeypatch.setattr(fused_decode, "QKV_GEMM_MAX_ROWS", 512)
    model = _model(5, dtype=torch.bfloat16, qk_norm=qk_norm).cuda()
    params = SamplingParams(temperature=0.0, max_tokens=12, return_logprobs=True)
    actual = _generate(model, params, fused_decode=True)
    expected = _generate(
        model, params, fused_decode=False, use_cuda_graphs=False, async_token_readback=False
    )
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(
        actual, expected, strict=True
    ):
        assert tokens == expected_tokens
        # bfloat16 activations: the projections' sums run in another order than cuBLAS's.
        torch.testing.assert_close(logprobs, expected_logprobs, atol=0.05, rtol=0)
