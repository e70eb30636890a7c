"""Programmatic dependent launch: the switch, and on a Hopper GPU a chain of decode kernels
(projections, RoPE + cache write, paged attention) launched with it equals plain launches."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels import paged_attention as paged_attention_module
from mcore_kernels.decode_gemv import decode_gemv
from mcore_kernels.paged_attention import paged_attention
from mcore_kernels.pdl import pdl_enabled, programmatic_dependent_launch
from mcore_kernels.rotary_kv_write import rotary_kv_write


def test_context_switches_and_restores_the_request():
    cpu = torch.device("cpu")
    assert not pdl_enabled(cpu)
    with programmatic_dependent_launch():
        # The CPU (the interpreter) never launches with PDL, whatever is requested.
        assert not pdl_enabled(cpu)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        gpu = torch.device("cuda")
        assert not pdl_enabled(gpu)
        with programmatic_dependent_launch():
            assert pdl_enabled(gpu)
            with programmatic_dependent_launch(False):
                assert not pdl_enabled(gpu)
            assert pdl_enabled(gpu)
        assert not pdl_enabled(gpu)


def _layers(seed: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int):
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (0.05 * torch.randn(shape, generator=generator)).to("cuda", torch.bfloat16)

    width = (heads + 2 * kv_heads) * head_dim
    return [
        {
            "qkv": weight(width, hidden),
            "o": weight(hidden, heads * head_dim),
            "gate_up": weight(2 * ffn, hidden),
            "down": weight(hidden, ffn),
            "norm": 1.0 + weight(hidden),
        }
        for _ in range(3)
    ]


def _decode_chain(residual, layers, cache, tables, lens, cos, sin, slots, dims):
    """Three decoder layers of one token, every kernel reading the previous one's output."""
    heads, kv_heads, head_dim = dims
    keys, values = cache
    for index, layer in enumerate(layers):
        qkv = decode_gemv(residual, layer["qkv"], norm_weight=layer["norm"])
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in (q, k, v))
        rotated = rotary_kv_write(q, k, v, cos, sin, keys[index], values[index], slots)
        out = paged_attention(rotated, keys[index], values[index], tables, lens, scale=0.125)
        residual = decode_gemv(out.flatten(-2), layer["o"], residual=residual)
        activation = decode_gemv(residual, layer["gate_up"], norm_weight=layer["norm"], swiglu=True)
        residual = decode_gemv(activation, layer["down"], residual=residual)
    return residual


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper or newer GPU",
)
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "l2_prefetch"])
def test_gpu_decode_chain_with_pdl_equals_plain_launches_eager_and_in_a_graph(
    monkeypatch, prefetch
):
    # With prefetch, the attention requests its keys and values into L2 before waiting: a hint
    # that must change nothing.
    monkeypatch.setattr(paged_attention_module, "PREFETCH_KV_WITH_PDL", prefetch)
    hidden, heads, kv_heads, head_dim, ffn = 256, 4, 2, 64, 512
    layers = _layers(0, hidden, heads, kv_heads, head_dim, ffn)
    block_size, blocks, context = 16, 8, 70
    generator = torch.Generator().manual_seed(1)
    shape = (len(layers), blocks, block_size, kv_heads, head_dim)
    initial = torch.randn(shape, generator=generator).to("cuda", torch.bfloat16)
    tables = torch.randperm(blocks, generator=generator)[None].to("cuda", torch.int32)
    lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    position = context - 1
    slot = tables[0, position // block_size].long() * block_size + position % block_size
    slots = slot.reshape(1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = (position * inv_freq)[None].cuda()
    cos, sin = angles.cos(), angles.sin()
    x = torch.randn((1, hidden), generator=generator).to("cuda", torch.bfloat16)
    dims = (heads, kv_heads, head_dim)

    def run(pdl: bool, graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
        cache = (initial.clone(), initial.clone())
        with programmatic_dependent_launch(pdl):
            chain_args = (x, layers, cache, tables, lens, cos, sin, slots, dims)
            out = _decode_chain(*chain_args)
            if graph:
                captured = torch.cuda.CUDAGraph()
                with torch.cuda.graph(captured):
                    out = _decode_chain(*chain_args)
                cache[0].copy_(initial)
                cache[1].copy_(initial)
                captured.replay()
        torch.cuda.synchronize()
        return out.clone(), cache[0].clone()

    expected, expected_keys = run(False, False)
    for graph in (False, True):
        actual, keys = run(True, graph)
        assert torch.equal(actual, expected)
        assert torch.equal(keys, expected_keys)
