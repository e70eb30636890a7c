"""The fused decoder's persistent layer kernels (``layer_kernel="tail"``: the attention kernel
plus one ``decode_layer_tail`` launch per layer; ``"layer"``: one ``decode_layer`` launch)
against the model's forward and the ``decode_gemv`` path, on a decode step of two requests
after their prefill; on a GPU, greedy engine tokens against the eager engine and the
``decode_gemv`` path."""

from __future__ import annotations

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams, fused_decode_tail
from mcore_inference.fused_decode import FusedDecoder
from mcore_inference.kv_cache import PagedKVCache
from mcore_models import GPTConfig, GPTModel


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _model(seed: int, *, qk_norm: bool = False) -> GPTModel:
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
    return model


@pytest.fixture(scope="module")
def model() -> GPTModel:
    return _model(11)


TABLES = torch.tensor([[1, 2, 0], [3, 4, 0]], dtype=torch.int32)
PREFILL_POSITIONS = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
PREFILL_ROWS = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1])
PREFILL_TOKENS = torch.tensor([[7, 3, 9, 1, 2, 60, 4, 4, 33]])
# The decode step: one token per request, at positions 6 and 3.
STEP_POSITIONS = torch.tensor([6, 3])
STEP_ROWS = torch.tensor([0, 1])
STEP_TOKENS = torch.tensor([[12, 40]])


def _decode_step(
    model: GPTModel, decoder: FusedDecoder | None
) -> tuple[torch.Tensor, PagedKVCache]:
    """Hidden states of the decode step after a prefill by the model's own forward."""
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
    with torch.no_grad():
        cache.prepare_step(TABLES, PREFILL_POSITIONS, PREFILL_ROWS)
        model(PREFILL_TOKENS, PREFILL_POSITIONS[None], kv_cache=cache, return_hidden=True)
        cache.prepare_step(TABLES, STEP_POSITIONS, STEP_ROWS)
        if decoder is None:
            hidden = model(STEP_TOKENS, STEP_POSITIONS[None], kv_cache=cache, return_hidden=True)
        else:
            hidden = decoder(STEP_TOKENS, STEP_POSITIONS[None], kv_cache=cache)
    return hidden, cache


@pytest.fixture()
def tail_calls(monkeypatch):
    """Count the decoder's persistent launches (the real functions still run)."""
    calls: list[bool] = []
    for name in ("decode_layer_tail", "decode_layer", "decode_model"):
        real = getattr(fused_decode_tail, name)

        def counting(*args, real=real, **kwargs):
            calls.append(kwargs.get("next_qkv") is not None)
            return real(*args, **kwargs)

        monkeypatch.setattr(fused_decode_tail, name, counting)
    return calls


@pytest.mark.parametrize("mode", ["tail", "layer", "model"])
def test_tail_path_matches_model_forward_and_gemv_path(model, tail_calls, mode):
    # CPU tensors take the kernels' torch references (the Triton kernel is tested interpreted
    # in mcore-kernels and here on a GPU).
    expected, expected_cache = _decode_step(model, None)
    gemv, _ = _decode_step(model, FusedDecoder(model, layer_kernel="off"))
    assert not tail_calls
    actual, cache = _decode_step(model, FusedDecoder(model, layer_kernel=mode))
    # One launch per layer (every one but the last also projects the next layer's q/k/v), or
    # one for the whole model.
    layers = len(model.layers)
    assert tail_calls == ([False] if mode == "model" else [True] * (layers - 1) + [False])
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual, gemv, atol=1e-5, rtol=1e-5)
    for got, want in ((cache.keys, expected_cache.keys), (cache.values, expected_cache.values)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tail_path_is_skipped_with_qk_norm_and_past_four_tokens(tail_calls):
    qk_norm = _model(12, qk_norm=True)
    expected, _ = _decode_step(qk_norm, None)
    actual, _ = _decode_step(qk_norm, FusedDecoder(qk_norm, layer_kernel="layer"))
    assert not tail_calls, "QK-norm models keep the decode_gemv path"
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert fused_decode_tail.tail_layers_apply(_model(13), 4)
    assert not fused_decode_tail.tail_layers_apply(_model(13), 5)


def test_engine_option_reaches_the_decoder(model):
    config = InferenceConfig(max_batch_size=2, max_sequence_length=32, decode_layer_kernel="layer")
    with InferenceEngine(model, config) as engine:
        assert engine._decoder is not None and engine._decoder.layer_kernel == "layer"


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper or newer GPU",
)
def test_gpu_greedy_tokens_equal_eager_engine():
    config = GPTConfig.from_name("qwen2.5-0.5b", num_layers=4)
    model = GPTModel(config, device=torch.device("cuda")).eval()
    prompts = [[(7 * i + 3) % config.vocab_size for i in range(24)]]
    params = SamplingParams(temperature=0.0, max_tokens=48)

    def generate(**options) -> list[int]:
        engine_config = InferenceConfig(
            max_batch_size=1, max_sequence_length=96, block_size=16, **options
        )
        with InferenceEngine(model, engine_config) as engine:
            return engine.generate(prompts, params)[0].tokens

    for mode in ("tail", "layer", "model"):
        graphs = generate(decode_layer_kernel=mode)
        assert graphs == generate(decode_layer_kernel=mode, use_cuda_graphs=False)
