"""The fused decoder's batched steps (norm_linear: norms, RoPE + cache write and SwiGLU folded
into the q/k/v and gate/up GEMMs, residual adds into the o and down GEMMs) against the model's
own forward: hidden states and cache contents."""

from __future__ import annotations

import pytest
import torch

from mcore_inference.fused_decode import FusedDecoder
from mcore_inference.kv_cache import PagedKVCache
from mcore_models import GPTConfig, GPTModel


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _model(*, qk_norm: bool) -> GPTModel:
    # head_dim 32 (a power of two >= 32): the q/k/v GEMM takes RoPE and the cache write in,
    # unless QK-norm must run between the projection and RoPE.
    config = GPTConfig.from_name(
        "tiny",
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=64,
        seed=3,
        add_qkv_bias=True,
        qk_layernorm=qk_norm,
    )
    model = GPTModel(config).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return model


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


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope_in_gemm", "qk_norm"])
@pytest.mark.parametrize("max_rows", [512, 4], ids=["norm_linear", "unfused_above_max_rows"])
def test_batched_step_matches_model_hidden_states_and_cache(qk_norm, max_rows):
    # A prefill chunk of 6 tokens and 3 decode-like tokens of another request: 9 rows.
    model = _model(qk_norm=qk_norm)
    tables = torch.tensor([[1, 2, 0], [3, 4, 0]], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
    rows = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1])
    tokens = torch.tensor([[7, 3, 9, 1, 2, 60, 4, 4, 33]])
    reference, fused = _cache(model), _cache(model)
    decoder = FusedDecoder(model)
    decoder.norm_linear_max_rows = max_rows
    with torch.no_grad():
        reference.prepare_step(tables, positions, rows)
        expected = model(tokens, positions[None], kv_cache=reference, return_hidden=True)
        fused.prepare_step(tables, positions, rows)
        actual = decoder(tokens, positions[None], kv_cache=fused)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.keys, reference.keys, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused.values, reference.values, atol=1e-6, rtol=1e-6)
