"""The fused decoder's few-token path (every projection one ``decode_gemv`` with the norms,
SwiGLU and residual adds fused in) against the model's forward and the GEMM path; the dispatch
on the row count; the LM head; and, on a GPU, a bfloat16 engine against the eager forward."""

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


def _model(seed: int, *, dtype: torch.dtype = torch.float32, qk_norm: bool = True) -> GPTModel:
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


@pytest.fixture(scope="module", params=[True, False], ids=["qk_norm", "rope_in_projection"])
def model(request) -> GPTModel:
    # Without QK-norm the q/k/v projection also rotates and writes the cache (rope=...).
    return _model(5, qk_norm=request.param)


def _cache(model: GPTModel) -> PagedKVCache:
    config = model.config
    return PagedKVCache(
        num_layers=config.num_layers,
        num_blocks=6,
        block_size=4,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.kv_channels,
        dtype=torch.float32,
        device=torch.device("cpu"),
        split_size=8,
    )


# Two requests of 6 and 3 tokens in rows 0 and 1 of the block table.
TABLES = torch.tensor([[1, 2, 0], [3, 4, 0]], dtype=torch.int32)
POSITIONS = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
ROWS = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1])
TOKENS = torch.tensor([[7, 3, 9, 1, 2, 60, 4, 4, 33]])


def _forward(model, decoder=None, tables=TABLES):
    cache = _cache(model)
    cache.prepare_step(tables, POSITIONS, ROWS)
    with torch.no_grad():
        if decoder is None:
            hidden = model(TOKENS, POSITIONS[None], kv_cache=cache, return_hidden=True)
        else:
            hidden = decoder(TOKENS, POSITIONS[None], kv_cache=cache)
    return hidden, cache


@pytest.fixture()
def gemv_calls(monkeypatch):
    """Count the decoder's ``decode_gemv`` launches (the real kernel still runs)."""
    calls: list[tuple[int, ...]] = []
    real = fused_decode.decode_gemv

    def counting(x, weight, *args, **kwargs):
        calls.append(tuple(x.shape))
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(fused_decode, "decode_gemv", counting)
    return calls


def test_gemv_path_matches_model_forward_and_gemm_path(model, gemv_calls):
    expected, expected_cache = _forward(model)
    gemm, _ = _forward(model, FusedDecoder(model, gemv_max_rows=0))
    assert not gemv_calls
    actual, cache = _forward(
        model, FusedDecoder(model, gemv_max_rows=16, attention_in_o_proj=False)
    )
    # Four projections per layer, each over the step's 9 tokens: q/k/v and gate/up read the
    # (normalised in the prologue) residual stream, o the attention, down the activation.
    config = model.config
    per_layer = [
        (9, config.hidden_size),
        (9, config.num_attention_heads * config.kv_channels),
        (9, config.hidden_size),
        (9, config.ffn_hidden_size),
    ]
    assert gemv_calls == per_layer * len(model.layers)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual, gemm, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.keys, expected_cache.keys, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache.values, expected_cache.values, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("width", [2, 3], ids=["one_split", "two_splits"])
def test_attention_merged_in_o_proj(model, gemv_calls, monkeypatch, width):
    # Without QK-norm the attention's splits are merged inside the o projection (three
    # decode_gemv launches per layer, not four), whatever the table width.
    narrow = TABLES[:, :width]
    expected, expected_cache = _forward(model, tables=narrow)
    calls = []
    real = fused_decode.attention_o_proj
    monkeypatch.setattr(
        fused_decode, "attention_o_proj", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    actual, cache = _forward(
        model, FusedDecoder(model, gemv_max_rows=16, attention_in_o_proj=True), tables=narrow
    )
    fused = model.layers[0].self_attention.q_norm is None
    assert len(calls) == (len(model.layers) if fused else 0)
    assert len(gemv_calls) == (3 if fused else 4) * len(model.layers)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.keys, expected_cache.keys, atol=1e-6, rtol=1e-6)
    gemv_calls.clear()
    unfused, _ = _forward(
        model, FusedDecoder(model, gemv_max_rows=16, attention_in_o_proj=False), tables=narrow
    )
    assert len(gemv_calls) == 4 * len(model.layers)
    torch.testing.assert_close(actual, unfused, atol=1e-5, rtol=1e-5)


def test_dispatch_on_the_row_count(model, gemv_calls):
    _forward(model, FusedDecoder(model, gemv_max_rows=8))
    assert not gemv_calls, "9 tokens > gemv_max_rows=8 must take the GEMM path"
    _forward(model, FusedDecoder(model, gemv_max_rows=9, attention_in_o_proj=False))
    assert len(gemv_calls) == 4 * len(model.layers)


@pytest.mark.parametrize("one_launch", [True, False])
def test_step_inputs_gather_embeddings_and_rope_rows(model, monkeypatch, one_launch):
    # (On the CPU the one launch is gather_row_pairs' torch path; its kernel is tested in
    # mcore-kernels.)
    monkeypatch.setattr(fused_decode, "STEP_INPUTS_IN_ONE_LAUNCH", one_launch)
    decoder = FusedDecoder(model, max_positions=12)
    tokens, positions = torch.tensor([60, 4]), torch.tensor([11, 0])
    hidden, cos, sin = decoder._step_inputs(tokens, positions)
    expected_cos, expected_sin = model.rotary(positions)
    assert torch.equal(hidden, model.embedding(tokens))
    assert torch.equal(cos, expected_cos)
    assert torch.equal(sin, expected_sin)


@pytest.mark.parametrize("fold", [True, False])
def test_logits_fold_the_final_norm_into_the_lm_head(model, gemv_calls, monkeypatch, fold):
    # FusedDecoder.logits of the 9-token step: the forward, the final norm and the LM head.
    monkeypatch.setattr(fused_decode, "FINAL_NORM_IN_LM_HEAD", fold)
    decoder = FusedDecoder(model, gemv_max_rows=16, lm_head_gemv_max_rows=16)
    hidden, _ = _forward(model, decoder)
    expected = model.compute_logits(hidden[0])
    cache = _cache(model)
    cache.prepare_step(TABLES, POSITIONS, ROWS)
    rows = torch.tensor([8, 5])
    calls = len(gemv_calls)
    with torch.no_grad():
        every = decoder.logits(TOKENS, POSITIONS[None], kv_cache=cache)
        picked = decoder.logits(TOKENS, POSITIONS[None], kv_cache=cache, rows=rows)
    torch.testing.assert_close(every.float(), expected, atol=1e-5, rtol=1e-5)
    # (The CPU reference matmuls may round differently at another row count.)
    torch.testing.assert_close(picked, every[rows], atol=1e-6, rtol=1e-6)
    # The LM head is the last decode_gemv of the step, with the norm in its prologue or not.
    per_step = (len(gemv_calls) - calls) // 2
    assert gemv_calls[calls + per_step - 1] == (9, model.config.hidden_size)


def test_lm_head_matches_compute_logits(model, gemv_calls):
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = model.compute_logits(hidden)
    actual = FusedDecoder(model, lm_head_gemv_max_rows=5).compute_logits(hidden)
    assert gemv_calls == [(5, model.config.hidden_size)]
    # The model's dtype, never upcast (float32 for this model).
    assert actual.dtype == model.output_weight().dtype
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    wide = FusedDecoder(model, lm_head_gemv_max_rows=4).compute_logits(hidden)
    assert len(gemv_calls) == 1
    torch.testing.assert_close(wide, expected)


def test_bfloat16_logits_stay_in_the_model_dtype():
    model = _model(5, dtype=torch.bfloat16)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(torch.bfloat16)
    for rows in (4, 5):
        actual = FusedDecoder(model, lm_head_gemv_max_rows=rows).compute_logits(hidden)
        assert actual.dtype == torch.bfloat16
        # Upcasting is exact: the float32 logits of the model are these values.
        torch.testing.assert_close(actual.float(), model.compute_logits(hidden), atol=0, rtol=0)


PROMPTS = [[3, 9, 4, 7, 1], [12, 2], [5, 8, 13, 21, 34, 55, 6, 10, 11, 40, 41]]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, return_logprobs=True),
    SamplingParams(temperature=0.9, top_k=12, seed=7, max_tokens=5, return_logprobs=True),
    SamplingParams(temperature=0.0, max_tokens=7, return_logprobs=True),
]


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


@pytest.mark.parametrize("in_o_proj", [False, True], ids=["attention", "attention_in_o_proj"])
@pytest.mark.parametrize("max_rows", [1, 16])
def test_engine_with_gemv_steps_generates_what_the_model_forward_generates(
    model, monkeypatch, max_rows, in_o_proj
):
    # 16: every prefill chunk and decode step runs the GEMV path; 1: only single-row steps.
    monkeypatch.setattr(fused_decode, "GEMV_MAX_ROWS", max_rows)
    monkeypatch.setattr(fused_decode, "ATTENTION_IN_O_PROJ", in_o_proj)
    monkeypatch.setattr(fused_decode, "LM_HEAD_GEMV_MAX_ROWS", max_rows)
    actual = _generate(model, PARAMS, fused_decode=True)
    expected = _generate(model, PARAMS, fused_decode=False)
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(
        actual, expected, strict=True
    ):
        assert tokens == expected_tokens
        torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("in_o_proj", [False, True], ids=["attention", "attention_in_o_proj"])
@pytest.mark.parametrize("max_rows", [2, 16])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "rope_in_projection"])
def test_bfloat16_graph_engine_greedy_tokens_match_the_eager_forward_on_gpu(
    monkeypatch, max_rows, qk_norm, in_o_proj
):
    monkeypatch.setattr(fused_decode, "GEMV_MAX_ROWS", max_rows)
    monkeypatch.setattr(fused_decode, "ATTENTION_IN_O_PROJ", in_o_proj)
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
