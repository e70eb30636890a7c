"""The fused decoder's paired launches (``fused_decode.PAIRED_LAUNCHES``: two or three dependent
projections per launch at one or two tokens): the interpreted Triton kernels give the bits of
the five-launch layers and the same cache writes; the dispatch; and, on a GPU, a bfloat16
engine with CUDA graphs against the eager engine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mcore_inference import fused_decode
from mcore_inference.fused_decode import FusedDecoder
from mcore_inference.fused_decode_pairs import PAIR_MODES, paired_layers_supported
from mcore_models import GPTConfig, GPTModel

_SCRIPT = textwrap.dedent(
    """
    import torch
    from mcore_inference import fused_decode
    from mcore_inference.fused_decode import FusedDecoder
    from mcore_inference.kv_cache import PagedKVCache
    from mcore_models import GPTConfig, GPTModel

    torch.set_num_threads(1)
    config = GPTConfig.from_name(
        "tiny", vocab_size=64, seed=5, add_qkv_bias=True, qk_layernorm=False, num_layers=3
    )
    model = GPTModel(config).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    tables = torch.tensor([[1, 2, 0], [3, 4, 0]], dtype=torch.int32)

    def run(mode, rows):
        fused_decode.PAIRED_LAUNCHES = mode
        cache = PagedKVCache(
            num_layers=config.num_layers, num_blocks=6, block_size=4,
            num_kv_heads=config.num_kv_heads, head_dim=config.kv_channels,
            dtype=torch.float32, device=torch.device("cpu"), split_size=8,
        )
        fill = torch.Generator().manual_seed(1)
        cache.keys.copy_(torch.randn(cache.keys.shape, generator=fill))
        cache.values.copy_(torch.randn(cache.values.shape, generator=fill))
        decoder = FusedDecoder(model, gemv_max_rows=2, max_positions=32)
        positions = torch.tensor([5, 2][:rows])
        cache.prepare_step(tables, positions, torch.tensor([0, 1][:rows]))
        with torch.no_grad():
            hidden = decoder(torch.tensor([[7, 33][:rows]]), positions[None], kv_cache=cache)
        return hidden, cache.keys, cache.values

    for rows in (1, 2):
        expected = run("none", rows)
        for mode in ("mlp", "down_qkv", "mlp_qkv"):
            actual = run(mode, rows)
            assert all(torch.equal(a, b) for a, b in zip(actual, expected)), (mode, rows)
    print("paired-ok")
    """
)


def test_paired_launches_give_the_five_launch_bits_interpreted():
    # Triton decides at import whether it interprets: the run needs a fresh process.
    env = {"TRITON_INTERPRET": "1", "MCORE_KERNELS_BACKEND": "triton", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "paired-ok" in result.stdout


def _model(num_layers: int, *, qk_norm: bool = False) -> GPTModel:
    config = GPTConfig.from_name(
        "tiny", vocab_size=64, seed=5, qk_layernorm=qk_norm, num_layers=num_layers
    )
    return GPTModel(config).eval()


@pytest.mark.parametrize("mode", PAIR_MODES)
def test_dispatch(mode):
    decoder = FusedDecoder(_model(3))
    assert paired_layers_supported(decoder, mode, 1) == (mode != "none")
    assert not paired_layers_supported(decoder, mode, 3)
    # Two layers: one counter slot per call needs two calls a cycle.
    assert paired_layers_supported(FusedDecoder(_model(2)), mode, 2) == (mode in ("mlp", "mlp_qkv"))
    assert not paired_layers_supported(FusedDecoder(_model(3, qk_norm=True)), mode, 1)
    assert not paired_layers_supported(FusedDecoder(_model(3), attention_in_o_proj=False), mode, 1)


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="PAIRED_LAUNCHES"):
        paired_layers_supported(FusedDecoder(_model(2)), "all", 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["mlp", "down_qkv", "mlp_qkv"])
def test_bfloat16_graph_engine_greedy_tokens_match_the_eager_engine_on_gpu(monkeypatch, mode):
    from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams

    monkeypatch.setattr(fused_decode, "PAIRED_LAUNCHES", mode)
    model = _model(3).to(torch.bfloat16).cuda()
    params = SamplingParams(temperature=0.0, max_tokens=12, return_logprobs=True)
    prompts = [[1, 5, 9, 2], [7, 7, 3]]

    def generate(**options):
        config = InferenceConfig(
            max_batch_size=2,
            max_sequence_length=32,
            block_size=4,
            prefill_chunk_size=4,
            attention_split_size=8,
            **options,
        )
        with InferenceEngine(model, config) as engine:
            return [(r.tokens, r.logprobs) for r in engine.generate(prompts, params)]

    actual = generate()
    expected = generate(use_cuda_graphs=False, async_token_readback=False)
    monkeypatch.setattr(fused_decode, "PAIRED_LAUNCHES", "none")
    unpaired = generate(use_cuda_graphs=False, async_token_readback=False)
    for (tokens, logprobs), (eager_tokens, eager_logprobs), (plain_tokens, _) in zip(
        actual, expected, unpaired, strict=True
    ):
        assert tokens == eager_tokens == plain_tokens
        torch.testing.assert_close(logprobs, eager_logprobs, atol=0, rtol=0)
