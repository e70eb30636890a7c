"""decode_layer_tail and decode_layer: the persistent Triton kernel (interpreted on CPU, one
program) against the chain of torch references it replaces (paged attention, ``decode_gemv``
projections, RoPE and the cache write), the argument checks, and on a GPU (every program
resident, grid barriers between the phases) against the ``decode_gemv`` chain and the paged
attention kernel, eagerly and replayed in a CUDA graph under programmatic dependent launch."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.decode_gemv import decode_gemv
from mcore_kernels.decode_layer import (
    LayerAttention,
    LayerTailConfig,
    NextProjection,
    decode_layer,
    decode_layer_tail,
)
from mcore_kernels.errors import KernelShapeError, KernelValueError
from mcore_kernels.paged_attention import paged_attention
from mcore_kernels.pdl import programmatic_dependent_launch
from mcore_kernels.reference import decode_gemv_reference, paged_attention_reference
from mcore_kernels.rotary_kv_write import RotaryCacheWrite, rotary_kv_write_reference

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper or newer GPU",
)

HIDDEN, ATTN, FFN, HQ, HKV, D = 48, 40, 72, 3, 2, 8
"""Widths that are not powers of two (masked tails), three query heads on two kv heads."""
LAYER_SIZES = (48, 64, 72, 4, 2, 16)
"""decode_layer's shapes: its attention needs a power-of-two head dim >= 16."""


def _problem(rows, dtype, device, *, seed=0, o_bias=True, qkv_bias=True, sizes=None):
    hidden, attn, ffn, hq, hkv, d = sizes or (HIDDEN, ATTN, FFN, HQ, HKV, D)
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(dtype).to(device)

    qkv = (hq + 2 * hkv) * d
    positions = torch.randint(0, 512, (rows,), generator=generator).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = positions[:, None] * inv_freq
    blocks, block_size = 4, 4
    return {
        "attention_out": rand(rows, attn),
        "residual": rand(rows, hidden),
        "o_weight": rand(hidden, attn, scale=attn**-0.5),
        "o_bias": rand(hidden, scale=0.3) if o_bias else None,
        "post_norm_weight": 1 + rand(hidden, scale=0.2),
        "gate_up_weight": rand(2 * ffn, hidden, scale=hidden**-0.5),
        "down_weight": rand(hidden, ffn, scale=ffn**-0.5),
        "qkv_weight": rand(qkv, hidden, scale=hidden**-0.5),
        "qkv_bias": rand(qkv, scale=0.3) if qkv_bias else None,
        "in_norm_weight": 1 + rand(hidden, scale=0.2),
        "cos": angles.cos().to(device),
        "sin": angles.sin().to(device),
        "cache": rand(2, blocks, block_size, hkv, d),
        "slots": torch.randperm(blocks * block_size, generator=generator)[:rows].to(device),
        "hq": hq,
    }


def _next(problem, cache):
    rope = RotaryCacheWrite(
        cos=problem["cos"],
        sin=problem["sin"],
        k_cache=cache[0],
        v_cache=cache[1],
        slot_mapping=problem["slots"],
        num_q_heads=problem["hq"],
    )
    return NextProjection(
        weight=problem["qkv_weight"],
        bias=problem["qkv_bias"],
        norm_weight=problem["in_norm_weight"],
        norm_eps=1e-6,
        rope=rope,
    )


def _tail(problem, with_next=True, **options):
    cache = problem["cache"].clone()
    out, q = decode_layer_tail(
        problem["attention_out"],
        problem["residual"],
        o_weight=problem["o_weight"],
        o_bias=problem["o_bias"],
        post_norm_weight=problem["post_norm_weight"],
        post_norm_eps=1e-6,
        gate_up_weight=problem["gate_up_weight"],
        down_weight=problem["down_weight"],
        next_qkv=_next(problem, cache) if with_next else None,
        **options,
    )
    return out, q, cache


def _chain(problem, gemv):
    """The unfused chain: o, gate/up, down, q/k/v, then RoPE and the cache write."""
    cache = problem["cache"].clone()
    h = gemv(
        problem["attention_out"],
        problem["o_weight"],
        problem["o_bias"],
        residual=problem["residual"],
    )
    act = gemv(h, problem["gate_up_weight"], norm_weight=problem["post_norm_weight"], swiglu=True)
    out = gemv(act, problem["down_weight"], residual=h)
    qkv = gemv(
        out, problem["qkv_weight"], problem["qkv_bias"], norm_weight=problem["in_norm_weight"]
    )
    rope = _next(problem, cache).rope
    q, k, v = rope.split(qkv)
    rotated = rotary_kv_write_reference(
        q, k, v, rope.cos, rope.sin, rope.k_cache, rope.v_cache, rope.slot_mapping
    )
    return out, rotated.flatten(-2), cache


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("biases", [True, False], ids=["bias", "no_bias"])
def test_triton_matches_the_reference_chain_float32(monkeypatch, rows, biases):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    problem = _problem(rows, torch.float32, "cpu", o_bias=biases, qkv_bias=biases)
    out, q, cache = _tail(problem)
    want_out, want_q, want_cache = _chain(problem, decode_gemv_reference)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, want_cache, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.interpreter
def test_triton_bfloat16_within_one_ulp_and_without_next_projection(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    problem = _problem(1, torch.bfloat16, "cpu", seed=3)
    out, q, cache = _tail(problem, with_next=False)
    assert q is None
    assert torch.equal(cache, problem["cache"]), "no next projection: the cache is untouched"
    want_out, _, _ = _chain(problem, decode_gemv_reference)
    # The interpreter truncates float32 -> bfloat16 casts: one bfloat16 ulp.
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2**-7, atol=2**-7)


def test_torch_path_is_the_reference_chain(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    problem = _problem(2, torch.float32, "cpu", seed=1)
    out, q, cache = _tail(problem)
    want_out, want_q, want_cache = _chain(problem, decode_gemv_reference)
    assert torch.equal(out, want_out) and torch.equal(q, want_q) and torch.equal(cache, want_cache)


def test_bad_shapes_and_configs_raise():
    problem = _problem(1, torch.float32, "cpu")
    with pytest.raises(KernelShapeError, match="gate_up_weight has shape"):
        _tail({**problem, "gate_up_weight": problem["gate_up_weight"][:-2]})
    with pytest.raises(KernelShapeError, match="o_weight has shape"):
        _tail({**problem, "o_weight": problem["o_weight"][:-1]})
    with pytest.raises(KernelShapeError, match=r"next_qkv\.weight has shape"):
        _tail({**problem, "qkv_weight": problem["qkv_weight"][:-2]})
    with pytest.raises(KernelShapeError, match="5 rows; expected at most 4"):
        _tail(_problem(5, torch.float32, "cpu"))
    with pytest.raises(KernelValueError, match=r"LayerTailConfig\.block_n_down=3"):
        LayerTailConfig(block_n_down=3)
    with pytest.raises(KernelValueError, match="programs_per_sm=0"):
        LayerTailConfig(programs_per_sm=0)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_matches_decode_gemv_chain_eager_and_in_a_pdl_graph(rows):
    # The Qwen2.5-0.5B layer widths: many tiles per program, every program resident.
    problem = _problem(rows, torch.bfloat16, "cuda", sizes=(896, 896, 4864, 14, 2, 64))
    want_out, want_q, want_cache = _chain(problem, decode_gemv)
    out, q, cache = _tail(problem)
    # Same roundings; float32 sums in another order: within a bfloat16 ulp of the chain.
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2**-7, atol=2**-6)
    torch.testing.assert_close(q.float(), want_q.float(), rtol=2**-7, atol=2**-6)
    torch.testing.assert_close(cache.float(), want_cache.float(), rtol=2**-7, atol=2**-6)
    with programmatic_dependent_launch():
        _tail(problem)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _tail(problem)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, (out, q, cache), strict=True):
        assert torch.equal(got, want), "replays (counters reused) give the eager result"


def _attention_problem(rows, dtype, device, *, sizes=LAYER_SIZES, contexts=(150, 7, 64, 1)):
    """A layer problem plus a paged cache whose contexts span several 64-position splits."""
    problem = _problem(rows, dtype, device, seed=4, sizes=sizes)
    _, _, _, hq, hkv, d = sizes
    generator = torch.Generator().manual_seed(9)
    block_size, blocks = 16, 24
    lens = torch.tensor(contexts[:rows], dtype=torch.int32)
    tables = torch.stack([torch.randperm(blocks, generator=generator)[:12] for _ in range(rows)])
    problem["attention"] = LayerAttention(
        k_cache=torch.randn((blocks, block_size, hkv, d), generator=generator).to(dtype).to(device),
        v_cache=torch.randn((blocks, block_size, hkv, d), generator=generator).to(dtype).to(device),
        block_tables=tables.to(torch.int32).to(device),
        context_lens=lens.to(device),
        scale=d**-0.5,
    )
    problem["q"] = torch.randn((rows, hq * d), generator=generator).to(dtype).to(device)
    return problem


def _layer(problem, **options):
    cache = problem["cache"].clone()
    out, q = decode_layer(
        problem["q"],
        problem["residual"],
        attention=problem["attention"],
        o_weight=problem["o_weight"],
        o_bias=problem["o_bias"],
        post_norm_weight=problem["post_norm_weight"],
        post_norm_eps=1e-6,
        gate_up_weight=problem["gate_up_weight"],
        down_weight=problem["down_weight"],
        next_qkv=_next(problem, cache),
        **options,
    )
    return out, q, cache


def _layer_chain(problem, gemv, attend):
    attention = problem["attention"]
    head_dim = attention.k_cache.shape[3]
    attended = attend(
        problem["q"].unflatten(-1, (-1, head_dim)),
        attention.k_cache,
        attention.v_cache,
        attention.block_tables,
        attention.context_lens,
        scale=attention.scale,
    )
    return _chain({**problem, "attention_out": attended.flatten(-2)}, gemv)


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 3])
def test_layer_triton_matches_paged_attention_and_chain_references(monkeypatch, rows):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    problem = _attention_problem(rows, torch.float32, "cpu")
    out, q, cache = _layer(problem)
    want_out, want_q, want_cache = _layer_chain(
        problem, decode_gemv_reference, paged_attention_reference
    )
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, want_cache, rtol=1e-5, atol=1e-5)


def test_layer_torch_path_and_bad_attention_raise(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    problem = _attention_problem(2, torch.float32, "cpu")
    out, q, cache = _layer(problem)
    want = _layer_chain(problem, decode_gemv_reference, paged_attention_reference)
    assert all(torch.equal(a, b) for a, b in zip((out, q, cache), want, strict=True))
    attention = problem["attention"]
    odd = _attention_problem(1, torch.float32, "cpu", sizes=(48, 40, 72, 4, 2, 10))
    with pytest.raises(KernelShapeError, match="head dim 10"):
        _layer(odd)
    lens = attention.context_lens.long()
    with pytest.raises(KernelShapeError, match="context_lens"):
        _layer({**problem, "attention": LayerAttention(
            k_cache=attention.k_cache, v_cache=attention.v_cache,
            block_tables=attention.block_tables, context_lens=lens, scale=1.0,
        )})  # fmt: skip


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_layer_matches_paged_attention_and_decode_gemv_in_a_pdl_graph(rows):
    problem = _attention_problem(
        rows, torch.bfloat16, "cuda", sizes=(896, 896, 4864, 14, 2, 64), contexts=(150, 190)
    )
    want_out, want_q, want_cache = _layer_chain(problem, decode_gemv, paged_attention)
    out, q, cache = _layer(problem)
    # The attention's float32 sums run in another order than the attention kernel's, and
    # its output is rounded to bfloat16 before the projections: a few bfloat16 ulps.
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2**-6, atol=2**-5)
    torch.testing.assert_close(q.float(), want_q.float(), rtol=2**-6, atol=2**-5)
    torch.testing.assert_close(cache.float(), want_cache.float(), rtol=2**-6, atol=2**-5)
    with programmatic_dependent_launch():
        _layer(problem)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _layer(problem)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, (out, q, cache), strict=True):
        assert torch.equal(got, want), "replays (counters reused) give the eager result"
