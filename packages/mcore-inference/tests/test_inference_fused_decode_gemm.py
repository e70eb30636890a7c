"""The fused decoder's q/k/v and o projections as ``decode_gemm`` (steps of 3 to
``QKV_GEMM_MAX_ROWS`` / ``O_GEMM_MAX_ROWS`` tokens: Triton GEMMs with RoPE + the cache write,
and the residual add, in their epilogues) against the model's forward; the dispatch on the row
count; and, on a GPU, a bfloat16 engine whose greedy tokens equal the eager engine's."""

from __future__ import annotations

import pytest
import torch
from test_inference_fused_decode_gemv import _forward, _generate, _model

from mcore_inference import SamplingParams, fused_decode
from mcore_inference.fused_decode import FusedDecoder
from mcore_models import GPTModel


@pytest.fixture(scope="module")
def model() -> GPTModel:
    # No QK-norm: the q/k/v projection also rotates and writes the cache.
    return _model(5, qk_norm=False)


class _Shapes(list):
    """The input shapes of the calls of a wrapped function (which still runs)."""

    def wrap(self, function):
        def wrapped(x, *args, **kwargs):
            self.append(tuple(x.shape))
            return function(x, *args, **kwargs)

        return wrapped


@pytest.fixture()
def gemm_calls(monkeypatch):
    shapes = _Shapes()
    monkeypatch.setattr(fused_decode, "decode_gemm", shapes.wrap(fused_decode.decode_gemm))
    return shapes


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "rope_in_projection"])
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
    assert [tokens for tokens, _ in actual] == [tokens for tokens, _ in expected]
    # bfloat16 activations: the projections' sums run in another order than cuBLAS's.
    for (_, logprobs), (_, reference) in zip(actual, expected, strict=True):
        torch.testing.assert_close(logprobs, reference, atol=0.05, rtol=0)
