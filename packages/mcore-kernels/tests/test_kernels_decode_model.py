"""decode_model: every decoder layer of a decode step in one persistent launch, the Triton
kernel (interpreted on CPU, one program) against the torch references layer by layer (paged
attention, ``decode_gemv`` projections, RoPE and the cache write), the argument checks, and
on a GPU against ``decode_layer`` launch by launch (to a few bfloat16 ulps), and graph replays
under PDL against the eager launch (bit for bit)."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.decode_layer import LayerAttention, NextProjection, decode_layer
from mcore_kernels.decode_model import DecoderLayerWeights, decode_model
from mcore_kernels.errors import KernelShapeError, KernelValueError
from mcore_kernels.pdl import programmatic_dependent_launch
from mcore_kernels.rotary_kv_write import RotaryCacheWrite

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper or newer GPU",
)


def _problem(rows, dtype, device, *, sizes=(48, 72, 4, 2, 16, 3), seed=0):
    hidden, ffn, hq, hkv, d, count = sizes
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(dtype).to(device)

    qkv = (hq + 2 * hkv) * d
    layers = [
        DecoderLayerWeights(
            qkv_weight=rand(qkv, hidden, scale=hidden**-0.5),
            qkv_bias=rand(qkv, scale=0.3),
            input_norm_weight=1 + rand(hidden, scale=0.2),
            o_weight=rand(hidden, hq * d, scale=(hq * d) ** -0.5),
            o_bias=rand(hidden, scale=0.3),
            post_norm_weight=1 + rand(hidden, scale=0.2),
            gate_up_weight=rand(2 * ffn, hidden, scale=hidden**-0.5),
            down_weight=rand(hidden, ffn, scale=ffn**-0.5),
        )
        for _ in range(count)
    ]
    block_size, blocks = 16, 24
    positions = torch.tensor([150, 7, 64, 0][:rows])
    tables = torch.stack([torch.randperm(blocks, generator=generator)[:12] for _ in range(rows)])
    slots = tables[torch.arange(rows), positions // block_size].long() * block_size
    slots += positions % block_size
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = positions[:, None].float() * inv_freq
    return {
        "q": rand(rows, hq * d),
        "residual": rand(rows, hidden),
        "layers": layers,
        "cache": rand(2, count, blocks, block_size, hkv, d),
        "block_tables": tables.to(torch.int32).to(device),
        "context_lens": (positions + 1).to(torch.int32).to(device),
        "slot_mapping": slots.to(device),
        "cos": angles.cos().to(device),
        "sin": angles.sin().to(device),
        "scale": d**-0.5,
        "hq": hq,
    }


def _model(problem, **options):
    cache = problem["cache"].clone()
    out = decode_model(
        problem["q"],
        problem["residual"],
        layers=problem["layers"],
        k_cache=cache[0],
        v_cache=cache[1],
        block_tables=problem["block_tables"],
        context_lens=problem["context_lens"],
        slot_mapping=problem["slot_mapping"],
        cos=problem["cos"],
        sin=problem["sin"],
        scale=problem["scale"],
        **options,
    )
    return out, cache


def _by_layer(problem):
    """The same layers as one ``decode_layer`` call each."""
    cache = problem["cache"].clone()
    q, residual, layers = problem["q"], problem["residual"], problem["layers"]
    for index, layer in enumerate(layers):
        following = None
        if index + 1 < len(layers):
            nxt = layers[index + 1]
            rope = RotaryCacheWrite(
                cos=problem["cos"],
                sin=problem["sin"],
                k_cache=cache[0][index + 1],
                v_cache=cache[1][index + 1],
                slot_mapping=problem["slot_mapping"],
                num_q_heads=problem["hq"],
            )
            following = NextProjection(
                weight=nxt.qkv_weight,
                bias=nxt.qkv_bias,
                norm_weight=nxt.input_norm_weight,
                norm_eps=1e-6,
                rope=rope,
            )
        attention = LayerAttention(
            k_cache=cache[0][index],
            v_cache=cache[1][index],
            block_tables=problem["block_tables"],
            context_lens=problem["context_lens"],
            scale=problem["scale"],
        )
        residual, next_q = decode_layer(
            q,
            residual,
            attention=attention,
            o_weight=layer.o_weight,
            o_bias=layer.o_bias,
            post_norm_weight=layer.post_norm_weight,
            gate_up_weight=layer.gate_up_weight,
            down_weight=layer.down_weight,
            next_qkv=following,
        )
        if next_q is not None:
            q = next_q
    return residual, cache


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 2])
def test_triton_matches_the_layer_by_layer_references(monkeypatch, rows):
    problem = _problem(rows, torch.float32, "cpu")
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    want, want_cache = _by_layer(problem)
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    out, cache = _model(problem)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, want_cache, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise():
    problem = _problem(1, torch.float32, "cpu")
    with pytest.raises(KernelValueError, match="no layers"):
        _model({**problem, "layers": []})
    layers = list(problem["layers"])
    layers[1] = DecoderLayerWeights(
        **{
            name: getattr(layers[1], name) if name != "o_bias" else None
            for name in DecoderLayerWeights.__slots__
        }
    )
    with pytest.raises(KernelShapeError, match=r"layers\[1\]\.o_bias differs"):
        _model({**problem, "layers": layers})
    with pytest.raises(KernelShapeError, match="k_cache"):
        _model({**problem, "cache": problem["cache"][:, :2]})


@pytest.mark.gpu
@needs_hopper
def test_gpu_equals_decode_layer_by_layer_eager_and_in_a_pdl_graph():
    problem = _problem(1, torch.bfloat16, "cuda", sizes=(896, 4864, 14, 2, 64, 2))
    want, want_cache = _by_layer(problem)
    out, cache = _model(problem)
    # The same phases in the same order, compiled into another kernel: the compiler may fuse
    # other products and sums (multiply-adds), so a few bfloat16 ulps at most.
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-5, atol=2**-4)
    torch.testing.assert_close(cache.float(), want_cache.float(), rtol=2**-5, atol=2**-4)
    with programmatic_dependent_launch():
        _model(problem)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, captured_cache = _model(problem)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out) and torch.equal(captured_cache, cache)
