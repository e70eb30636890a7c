"""The engine's fused forward (fused q/k/v and gate/up GEMMs, RoPE fused with the cache write,
fused SwiGLU) against the model's own forward, and its weight copies against weight changes."""

from __future__ import annotations

import functools

import pytest
import torch

from mcore_inference import (
    InferenceConfig,
    InferenceEngine,
    SamplingParams,
    fused_decode,
    model_weight_shards,
)
from mcore_inference.fused_decode import FusedDecoder, fused_decoder_unsupported_reason
from mcore_inference.kv_cache import PagedKVCache
from mcore_models import GPTConfig, GPTModel

PROMPTS = [[3, 9, 4, 7, 1], [12, 2], [5, 8, 13, 21, 34, 55, 6, 10, 11, 40, 41]]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, return_logprobs=True),
    SamplingParams(temperature=0.9, top_k=12, seed=7, max_tokens=5, return_logprobs=True),
    SamplingParams(temperature=0.0, max_tokens=7, return_logprobs=True),
]


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _model(seed: int, *, bias_and_qk_norm: bool) -> GPTModel:
    config = GPTConfig.from_name(
        "tiny",
        vocab_size=64,
        seed=seed,
        add_qkv_bias=bias_and_qk_norm,
        qk_layernorm=bias_and_qk_norm,
    )
    model = GPTModel(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Biases start at zero and norm weights at one: give them values a slip would show.
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "qkv_bias_qk_norm"])
def model(request) -> GPTModel:
    return _model(5, bias_and_qk_norm=request.param)


def _engine(model: GPTModel, *, fused: bool, **overrides) -> InferenceEngine:
    fields = dict(
        max_batch_size=4,
        max_sequence_length=32,
        block_size=4,
        prefill_chunk_size=4,
        attention_split_size=8,
        fused_decode=fused,
    )
    return InferenceEngine(model, InferenceConfig(**{**fields, **overrides}))


def _generate(model: GPTModel, *, fused: bool, **overrides) -> list[tuple[list[int], list[float]]]:
    with _engine(model, fused=fused, **overrides) as engine:
        assert (engine._decoder is not None) == fused
        return [(r.tokens, r.logprobs) for r in engine.generate(PROMPTS, PARAMS)]


def _assert_same_generations(actual, expected) -> None:
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(actual, expected):
        assert tokens == expected_tokens
        torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=0)


def test_fused_engine_generates_what_the_model_forward_generates(model):
    # Chunked prefill (chunks of 4), decode, greedy and seeded sampling, logprobs.
    _assert_same_generations(_generate(model, fused=True), _generate(model, fused=False))


@pytest.mark.parametrize("o_splits", [0, 2])
def test_down_projection_in_split_k_partials_generates_what_the_model_forward_generates(
    model, monkeypatch, o_splits
):
    # Decode steps of the three prompts (three tokens) run the cuBLAS layers; their down
    # projections (and o projections) as float32 partial products summed by the next add + norm.
    monkeypatch.setattr(fused_decode, "DOWN_PROJ_SPLITS", (4, 64))
    monkeypatch.setattr(fused_decode, "O_PROJ_SPLITS", (o_splits, 64))
    with _engine(model, fused=True) as engine:
        assert engine._decoder is not None and engine._decoder._down_splits(3) == 4
        assert engine._decoder._o_splits(3) == o_splits
        actual = [(r.tokens, r.logprobs) for r in engine.generate(PROMPTS, PARAMS)]
    _assert_same_generations(actual, _generate(model, fused=False))


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


def _two_request_step(model, forward):
    """One prefill step of two requests (6 and 3 tokens in rows 0 and 1 of the block table) on a
    fresh cache: ``forward(tokens, position_ids, kv_cache=cache)``'s output and the cache."""
    tables = torch.tensor([[1, 2, 0], [3, 4, 0]], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
    rows = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1])
    tokens = torch.tensor([[7, 3, 9, 1, 2, 60, 4, 4, 33]])
    cache = _cache(model)
    with torch.no_grad():
        cache.prepare_step(tables, positions, rows)
        return forward(tokens, positions[None], kv_cache=cache), cache


def _model_step(model):
    """:func:`_two_request_step` of the model's own forward (the reference)."""
    return _two_request_step(model, functools.partial(model, return_hidden=True))


def test_fused_forward_matches_model_hidden_states_and_cache_contents(model):
    expected, reference = _model_step(model)
    decoder = FusedDecoder(model)
    actual, fused = _two_request_step(model, decoder)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.keys, reference.keys, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused.values, reference.values, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("down_splits", [(0, 64), (4, 64)])
@pytest.mark.parametrize("fold", [False, True])
def test_norms_folded_into_weights_match_the_model(model, monkeypatch, down_splits, fold):
    # MLP_NORM_IN_WEIGHTS / QKV_NORM_IN_WEIGHTS: the norms live in weight copies and row
    # scales (the q/k/v one only where the down projection is cuBLAS's own GEMM and the model
    # has no QK-norm); the hidden states, the cache and the generations stay the model's.
    monkeypatch.setattr(fused_decode, "MLP_NORM_IN_WEIGHTS", fold)
    monkeypatch.setattr(fused_decode, "QKV_NORM_IN_WEIGHTS", fold)
    monkeypatch.setattr(fused_decode, "DOWN_PROJ_SPLITS", down_splits)
    decoder = FusedDecoder(model)
    qk_norm = model.layers[0].self_attention.q_norm is not None
    assert all((f.gate_up_folded is not None) == fold for f in decoder._layers)
    assert all((f.qkv_folded is not None) == (fold and not qk_norm) for f in decoder._layers)
    expected, reference = _model_step(model)
    actual, fused = _two_request_step(model, decoder)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.keys, reference.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.values, reference.values, atol=1e-5, rtol=1e-5)
    _assert_same_generations(_generate(model, fused=True), _generate(model, fused=False))


@pytest.mark.parametrize("down_splits", [(0, 64), (4, 64)])
def test_residual_add_in_place_computes_the_same_bits(model, monkeypatch, down_splits):
    # RESIDUAL_ADD_IN_PLACE: the o and down GEMMs add into the residual stream itself instead
    # of a copy of it; the hidden states and the cache are bitwise those of the copies.
    monkeypatch.setattr(fused_decode, "MLP_NORM_IN_WEIGHTS", True)
    monkeypatch.setattr(fused_decode, "QKV_NORM_IN_WEIGHTS", True)
    monkeypatch.setattr(fused_decode, "DOWN_PROJ_SPLITS", down_splits)
    decoder = FusedDecoder(model)
    results = []
    for in_place in (False, True):
        monkeypatch.setattr(fused_decode, "RESIDUAL_ADD_IN_PLACE", in_place)
        results.append(_two_request_step(model, decoder))
    (copied, copied_cache), (in_place_hidden, in_place_cache) = results
    assert torch.equal(in_place_hidden, copied)
    assert torch.equal(in_place_cache.keys, copied_cache.keys)
    assert torch.equal(in_place_cache.values, copied_cache.values)


def test_folded_weights_follow_norm_weight_changes():
    model = _model(6, bias_and_qk_norm=False)
    decoder = FusedDecoder(model)
    layer, fused = model.layers[0], decoder._layers[0]
    assert fused.qkv_folded is not None and fused.gate_up_folded is not None
    with torch.no_grad():
        layer.input_norm.weight.mul_(2.0)
        layer.post_attention_norm.weight.add_(0.5)
    assert decoder.refresh()
    torch.testing.assert_close(fused.qkv_folded, fused.qkv_weight * layer.input_norm.weight)
    torch.testing.assert_close(
        fused.gate_up_folded, fused.gate_up_weight * layer.post_attention_norm.weight
    )


def test_rope_table_lookup_equals_the_per_step_rotary(model):
    # The engine's decoder looks the cosines and sines up in a table of every position; the
    # values, and so the hidden states and the cache, are those computed per step, bit for bit.
    outputs = []
    for max_positions in (None, 12):
        decoder = FusedDecoder(model, max_positions=max_positions)
        hidden, cache = _two_request_step(model, decoder)
        outputs.append((hidden, cache.keys))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])


def test_update_weights_refreshes_the_fused_copies():
    target = _model(99, bias_and_qk_norm=True)
    expected = _generate(target, fused=False)
    model = _model(11, bias_and_qk_norm=True)
    with _engine(model, fused=True) as engine:
        before = [(r.tokens, r.logprobs) for r in engine.generate(PROMPTS, PARAMS)]
        assert [t for t, _ in before] != [t for t, _ in expected]
        engine.update_weights(model_weight_shards(target))
        after = [(r.tokens, r.logprobs) for r in engine.generate(PROMPTS, PARAMS)]
    _assert_same_generations(after, expected)


def test_in_place_weight_change_is_picked_up_at_the_next_call():
    model = _model(3, bias_and_qk_norm=False)
    with _engine(model, fused=True) as engine:
        engine.generate(PROMPTS, PARAMS)
        # What an optimizer step on a shared model does: in-place ops on the parameters.
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1.25)
        after = [(r.tokens, r.logprobs) for r in engine.generate(PROMPTS, PARAMS)]
    _assert_same_generations(after, _generate(model, fused=False))


def test_write_through_data_is_picked_up_at_the_next_generate_call():
    model = _model(4, bias_and_qk_norm=False)
    with _engine(model, fused=True) as engine:
        engine.generate(PROMPTS, PARAMS)
        # Writes through .data (and in-place broadcasts) leave the version counters alone.
        for layer in model.layers:
            layer.mlp.up_proj.weight.data.mul_(-1.0)
            layer.self_attention.k_proj.weight.data.mul_(0.5)
        after = [(r.tokens, r.logprobs) for r in engine.generate(PROMPTS, PARAMS)]
    _assert_same_generations(after, _generate(model, fused=False))


def test_describe_says_whether_and_why_not_fused(model):
    with _engine(model, fused=True) as engine:
        assert engine.describe()["fused_decode"].startswith("on (")
    with _engine(model, fused=False) as engine:
        assert engine.describe()["fused_decode"] == "off (InferenceConfig.fused_decode=False)"
    stage = GPTModel(model.config, layers=range(1), post_process=False)
    assert "not a whole model" in fused_decoder_unsupported_reason(stage)
    assert fused_decoder_unsupported_reason(model) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_cuda_graph_decode_matches_eager_model_forward_on_gpu():
    model = _model(5, bias_and_qk_norm=True).cuda()
    # Decode steps of the two short prompts reach contexts 5..10, across the first attention
    # split (8 positions): the narrow- and full-table graphs both run. With the 11-token prompt
    # every decode step's context exceeds 8, so that call replays full-table graphs only.
    calls = [(PROMPTS[:2], PARAMS[:2]), (PROMPTS, PARAMS)]
    with _engine(model, fused=True) as engine:
        actual = [[(r.tokens, r.logprobs) for r in engine.generate(*call)] for call in calls]
        graphs = engine._graphs
        assert graphs is not None and graphs.captured
        assert len({width for _, width, _ in graphs._graphs}) == 2
    config = InferenceConfig(
        max_batch_size=4,
        max_sequence_length=32,
        block_size=4,
        prefill_chunk_size=4,
        attention_split_size=8,
        fused_decode=False,
        use_cuda_graphs=False,
        async_token_readback=False,
    )
    with InferenceEngine(model, config) as eager:
        expected = [[(r.tokens, r.logprobs) for r in eager.generate(*call)] for call in calls]
    for actual_call, expected_call in zip(actual, expected, strict=True):
        for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(
            actual_call, expected_call, strict=True
        ):
            assert tokens == expected_tokens
            torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_pdl_gives_the_same_tokens_and_logprobs_on_gpu():
    # On Hopper or newer the graphs' decode kernels run with programmatic dependent launch
    # (elsewhere the flag is ignored): nothing may change, bit for bit.
    model = _model(5, bias_and_qk_norm=True).cuda().to(torch.bfloat16)
    results = []
    for pdl in (False, True):
        config = InferenceConfig(
            max_batch_size=4,
            max_sequence_length=32,
            block_size=4,
            prefill_chunk_size=4,
            attention_split_size=8,
            decode_pdl=pdl,
        )
        with InferenceEngine(model, config) as engine:
            results.append([(r.tokens, r.logprobs) for r in engine.generate(PROMPTS, PARAMS)])
    assert results[0] == results[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_norm_swiglu_pdl_and_split_k_launches_change_nothing_on_gpu(monkeypatch):
    # Three prompts: the decode steps of three tokens run the cuBLAS layers, with the norm,
    # SwiGLU and split-K sum kernels (and normed_swiglu: NORMED_SWIGLU_PDL) launched with or
    # without PDL: the same bits either way.
    model = _model(5, bias_and_qk_norm=False).cuda().to(torch.bfloat16)
    for splits in (0, 4):
        results = []
        for norm_pdl, normed_pdl in ((False, False), (True, False), (True, True)):
            monkeypatch.setattr(fused_decode, "NORM_SWIGLU_PDL", norm_pdl)
            monkeypatch.setattr(fused_decode, "NORMED_SWIGLU_PDL", normed_pdl)
            monkeypatch.setattr(fused_decode, "DOWN_PROJ_SPLITS", (splits, 64))
            monkeypatch.setattr(fused_decode, "O_PROJ_SPLITS", (splits // 2, 64))
            with _engine(model, fused=True) as engine:
                outputs = [(r.tokens, r.logprobs) for r in engine.generate(PROMPTS, PARAMS)]
                results.append(outputs)
        assert results[0] == results[1] == results[2]


def _graph_and_eager_generations(model, check=None):
    """Tokens and log-probs of PROMPTS from the fused engine with CUDA graphs of every row count
    the prompts reach (1-3, no mixed-step graphs) and without graphs; ``check(engine)`` runs on
    each engine before it generates."""
    results = []
    for graphs in (True, False):
        config = InferenceConfig(
            max_batch_size=4,
            max_sequence_length=32,
            block_size=4,
            prefill_chunk_size=4,
            attention_split_size=8,
            use_cuda_graphs=graphs,
            cuda_graph_batch_sizes=(1, 2, 3),
            cuda_graph_mixed_steps=False,
        )
        with InferenceEngine(model, config) as engine:
            if check is not None:
                check(engine)
            results.append([(r.tokens, r.logprobs) for r in engine.generate(PROMPTS, PARAMS)])
    return results


def _assert_same_tokens_close_logprobs(graph, eager):
    """The same tokens; log-probs within 3e-2 (two bfloat16 ulps at |log-prob| < 4)."""
    assert [tokens for tokens, _ in graph] == [tokens for tokens, _ in eager]
    for (_, graph_logprobs), (_, eager_logprobs) in zip(graph, eager, strict=True):
        torch.testing.assert_close(
            torch.tensor(graph_logprobs), torch.tensor(eager_logprobs), atol=3e-2, rtol=0
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_norm_kernels_in_graphs_match_eager_on_gpu(monkeypatch, dtype):
    # The Triton kernels of the folded norms (normed_swiglu, normed_rotary_kv_write) in the
    # captured decode steps against the fused eager engine: in float32 tokens and log-probs bit
    # for bit and the model forward's tokens; in bfloat16 the same tokens and log-probs within
    # 3e-2, two bfloat16 ulps at |log-prob| < 4. Graphs of every row count the prompts reach
    # (1-3) and no mixed-step graphs: a captured step padded to a larger bucket lets cuBLAS
    # pick another kernel than the eager step at the exact row count (measured on an H200:
    # graph and eager log-probs 2e-4 to 2e-3 apart in bfloat16, enough to flip a near-tie of
    # this random model's greedy tokens once the skinny_gemm projections changed the values).
    monkeypatch.setattr(fused_decode, "DOWN_PROJ_SPLITS", (0, 64))
    model = _model(5, bias_and_qk_norm=False).cuda().to(dtype)

    def folded(engine):
        decoder = engine._decoder
        assert decoder is not None and decoder._layers[0].qkv_folded is not None

    results = _graph_and_eager_generations(model, folded)
    if dtype == torch.float32:
        assert results[0] == results[1]
        _assert_same_generations(results[0], _generate(model, fused=False))
    else:
        _assert_same_tokens_close_logprobs(*results)


@pytest.mark.parametrize(("qkv", "mlp"), [("qkv", "gate_up"), ("qkv_rope", "gate_up_swiglu")])
def test_skinny_gemm_projections_generate_what_the_model_forward_generates(monkeypatch, qkv, mlp):
    # SKINNY_GEMM: the decode steps of the three prompts (three rows) run q/k/v (with RoPE and
    # the cache write in its epilogue for "qkv_rope"), o, gate/up (with the SwiGLU and the
    # norm's row scale in its epilogue for "gate_up_swiglu"), the down partials and the LM
    # head as skinny_gemm (its torch reference on the CPU; the kernel has tests of its own).
    from mcore_kernels.skinny_gemm import SkinnyGemmConfig

    config = GPTConfig.from_name("tiny", vocab_size=64, seed=8, head_dim=32)
    model = GPTModel(config).eval()
    setting = (SkinnyGemmConfig(block_k=32), 3)
    skinny = dict.fromkeys(("qkv", "qkv_rope", "gate_up", "gate_up_swiglu"))
    skinny.update({qkv: setting, mlp: setting, "o": setting, "down": setting})
    skinny["lm_head"] = setting
    monkeypatch.setattr(fused_decode, "SKINNY_GEMM", skinny)
    monkeypatch.setattr(fused_decode, "DOWN_PROJ_SPLITS", (4, 64))
    monkeypatch.setattr(fused_decode, "LM_HEAD_GEMV_MAX_ROWS", 2)
    calls = []
    real = fused_decode.skinny_gemm

    def spy(x, weight, **kwargs):
        calls.append((weight.shape, kwargs))
        return real(x, weight, **kwargs)

    monkeypatch.setattr(fused_decode, "skinny_gemm", spy)
    actual = _generate(model, fused=True)
    assert any(k.get("rope") is not None for _, k in calls) == (qkv == "qkv_rope")
    assert any(k.get("swiglu_norm_eps") is not None for _, k in calls) == (mlp == "gate_up_swiglu")
    assert any(k.get("splits", 1) == 3 for _, k in calls), "the down partials"
    assert any(shape[0] == config.vocab_size for shape, _ in calls), "the LM head"
    _assert_same_generations(actual, _generate(model, fused=False))


@pytest.mark.parametrize("folded", [False, True])
def test_rotary_in_attention_generates_what_the_model_forward_generates(monkeypatch, folded):
    # ROTARY_IN_ATTENTION_MIN_ROWS: the three-row decode steps rotate, store and attend in one
    # rotary_paged_attention call (its torch reference on the CPU), after the norm-folded
    # q/k/v projection (DOWN_PROJ_SPLITS off) or the plain one (with its bias).
    config = GPTConfig.from_name("tiny", vocab_size=64, seed=8, head_dim=32)
    model = GPTModel(config).eval()
    monkeypatch.setattr(fused_decode, "ROTARY_IN_ATTENTION_MIN_ROWS", 3)
    monkeypatch.setattr(fused_decode, "SKINNY_GEMM_MAX_ROWS", 2)  # cuBLAS's q/k/v, as past 64
    monkeypatch.setattr(fused_decode, "DOWN_PROJ_SPLITS", (0, 64) if folded else (4, 64))
    calls = []
    real = fused_decode.rotary_paged_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("norm_input") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_decode, "rotary_paged_attention", spy)
    # One attention split holds every context; the prefill steps keep the two kernels (their
    # tokens read keys that other tokens of the step write).
    actual = _generate(model, fused=True, attention_split_size=32)
    assert calls and all(normed == folded for normed in calls)
    _assert_same_generations(actual, _generate(model, fused=False))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a Hopper (or newer) GPU",
)
def test_skinny_gemm_projections_in_graphs_match_eager_on_gpu(monkeypatch):
    # The default SKINNY_GEMM (q/k/v with RoPE + cache write, o with the residual, gate/up) in
    # bfloat16 captured decode steps against the fused eager engine: the same tokens, log-probs
    # within two bfloat16 ulps (graphs of the exact row counts: see the folded-norm test above).
    config = GPTConfig.from_name("tiny", vocab_size=64, seed=9, head_dim=64)
    model = GPTModel(config).eval().cuda().to(torch.bfloat16)
    ropes = []
    real = fused_decode.skinny_gemm

    def spy(x, weight, **kwargs):
        ropes.append(kwargs.get("rope") is not None)
        return real(x, weight, **kwargs)

    monkeypatch.setattr(fused_decode, "skinny_gemm", spy)
    results = _graph_and_eager_generations(model)
    assert any(ropes)
    _assert_same_tokens_close_logprobs(*results)


def test_packed_gemv_setting_dispatch(monkeypatch):
    # PACKED_GEMV: a named projection of bfloat16 rows, at most the setting's rows, runs
    # packed_gemv with its configuration; more rows, float32 rows, the batch-invariant mode or
    # no setting run decode_gemv. (The kernel's values: mcore-kernels' packed_gemv tests.)
    from mcore_kernels.batch_invariant import batch_invariant_mode
    from mcore_kernels.decode_gemv import decode_gemv
    from mcore_kernels.packed_gemv import PackedGemvConfig
    from mcore_kernels.reference import packed_gemv_reference

    calls = []

    def packed(x, weight, *, config, **kwargs):
        calls.append(config)
        return packed_gemv_reference(x, weight, **kwargs)

    monkeypatch.setattr(fused_decode, "packed_gemv", packed)
    config = PackedGemvConfig(block_n=8)
    monkeypatch.setitem(fused_decode.PACKED_GEMV, "gate_up", (config, 2))
    monkeypatch.setitem(fused_decode.PACKED_GEMV, "down", None)
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(24, 32, generator=generator) * 0.2).to(torch.bfloat16)
    norm_weight = (1 + 0.1 * torch.randn(32, generator=generator)).to(torch.bfloat16)
    kwargs = dict(norm_weight=norm_weight, norm_eps=1e-6, swiglu=True)
    x = torch.randn(2, 32, generator=generator).to(torch.bfloat16)
    expected = decode_gemv(x, weight, **kwargs)
    assert torch.equal(fused_decode._gemv("gate_up", x, weight, **kwargs), expected)
    assert calls == [config]
    assert torch.equal(fused_decode._gemv("down", x, weight, **kwargs), expected)
    three = x.repeat(2, 1)[:3]  # past the setting's two rows (packed_gemv would take it)
    assert torch.equal(
        fused_decode._gemv("gate_up", three, weight, **kwargs), expected.repeat(2, 1)[:3]
    )
    assert torch.equal(
        fused_decode._gemv("gate_up", x.float(), weight.float(), swiglu=True),
        decode_gemv(x.float(), weight.float(), swiglu=True),
    )
    with batch_invariant_mode():
        fused_decode._gemv("gate_up", x, weight, **kwargs)
    assert calls == [config]
