"""decode_gemv_pair (two dependent decode projections in one launch, the second waiting on a
counter of the first): the Triton kernel (interpreted on CPU) against the two projections by
the torch reference, the counter cycle, the argument checks, and on a GPU the same against
two ``decode_gemv`` launches, eager and in a CUDA graph."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels import decode_gemv_config
from mcore_kernels.decode_gemv import decode_gemv
from mcore_kernels.decode_gemv_pair import (
    PAIR_SLOT_STRIDE,
    GemvStage,
    decode_gemv_pair,
    pair_counters,
)
from mcore_kernels.errors import KernelShapeError, KernelValueError
from mcore_kernels.reference import decode_gemv_reference
from mcore_kernels.rotary_kv_write import RotaryCacheWrite, rotary_kv_write_reference

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")

HQ, HKV, D = 3, 2, 8


def _rand(generator, *shape, scale=1.0, dtype=torch.bfloat16, device="cpu"):
    return (torch.randn(shape, generator=generator) * scale).to(dtype).to(device)


def _mlp_problem(rows, k, ffn, hidden, device="cpu", seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": _rand(g, rows, k, device=device, dtype=dtype),
        "gate_up": _rand(g, 2 * ffn, k, scale=k**-0.5, device=device, dtype=dtype),
        "down": _rand(g, hidden, ffn, scale=ffn**-0.5, device=device, dtype=dtype),
        "norm": 1 + _rand(g, k, scale=0.1, device=device, dtype=dtype),
        "residual": _rand(g, rows, hidden, device=device, dtype=dtype),
    }


def _mlp_pair(p, counters, slot=0):
    return decode_gemv_pair(
        p["x"],
        p["gate_up"],
        p["down"],
        counters=counters,
        slot=slot,
        norm_weight=p["norm"],
        swiglu=True,
        second_residual=p["residual"],
    )


@pytest.fixture()
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 2])
# One masked tile; one full tile and a tail (both requested before the waits); a loop.
@pytest.mark.parametrize(
    ("k", "ffn", "whole_row"), [(40, 24, True), (96, 80, True), (64, 2100, True), (64, 4500, False)]
)
def test_mlp_pair_matches_the_two_projections(triton_backend, monkeypatch, rows, k, ffn, whole_row):
    if not whole_row:
        monkeypatch.setattr(decode_gemv_config, "WHOLE_ROW_MAX_K", 0)
    p = _mlp_problem(rows, k, ffn, 48, dtype=torch.float32)
    counters = pair_counters(2, "cpu")
    activation, out = _mlp_pair(p, counters)
    expected_activation = decode_gemv_reference(
        p["x"], p["gate_up"], norm_weight=p["norm"], swiglu=True
    )
    expected = decode_gemv_reference(expected_activation, p["down"], residual=p["residual"])
    torch.testing.assert_close(activation, expected_activation, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Every program of the first projection counted in slot 0.
    assert counters[0].item() > 0
    assert counters[PAIR_SLOT_STRIDE:].eq(0).all()


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 2])
def test_down_then_qkv_with_rope_and_cache_write(triton_backend, rows):
    g = torch.Generator().manual_seed(1)
    f32 = {"dtype": torch.float32}
    ffn, hidden = 40, 32
    n = (HQ + 2 * HKV) * D
    activation = _rand(g, rows, ffn, **f32)
    down = _rand(g, hidden, ffn, scale=ffn**-0.5, **f32)
    residual = _rand(g, rows, hidden, **f32)
    qkv_weight = _rand(g, n, hidden, scale=hidden**-0.5, **f32)
    qkv_bias = _rand(g, n, **f32)
    norm = 1 + _rand(g, hidden, scale=0.1, **f32)
    angles = torch.rand(rows, D // 2, generator=g) * 6
    cache = _rand(g, 2, 4, 4, HKV, D, **f32)
    slots = torch.randperm(16, generator=g)[:rows]

    def rope(target):
        return RotaryCacheWrite(
            cos=angles.cos(),
            sin=angles.sin(),
            k_cache=target[0],
            v_cache=target[1],
            slot_mapping=slots,
            num_q_heads=HQ,
        )

    actual_cache = cache.clone()
    new_residual, q = decode_gemv_pair(
        activation,
        down,
        qkv_weight,
        counters=pair_counters(3, "cpu"),
        slot=2,
        residual=residual,
        second_bias=qkv_bias,
        second_norm_weight=norm,
        second_rope=rope(actual_cache),
    )
    expected_cache = cache.clone()
    expected_residual = decode_gemv_reference(activation, down, residual=residual)
    qkv = decode_gemv_reference(expected_residual, qkv_weight, qkv_bias, norm_weight=norm)
    split = rope(expected_cache)
    expected_q = rotary_kv_write_reference(
        *split.split(qkv), split.cos, split.sin, expected_cache[0], expected_cache[1], slots
    ).flatten(-2)
    torch.testing.assert_close(new_residual, expected_residual, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q, expected_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual_cache, expected_cache, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.interpreter
def test_bfloat16_is_bitwise_the_two_decode_gemv_launches(triton_backend):
    # Same tiles and float32 sums as decode_gemv's vector path, so the same bits.
    p = _mlp_problem(2, 96, 2100, 48)
    activation, out = _mlp_pair(p, pair_counters(2, "cpu"))
    expected_activation = decode_gemv(p["x"], p["gate_up"], norm_weight=p["norm"], swiglu=True)
    expected = decode_gemv(expected_activation, p["down"], residual=p["residual"])
    assert torch.equal(activation, expected_activation) and torch.equal(out, expected)


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 2])
def test_three_projections_mlp_then_next_qkv(triton_backend, rows):
    # gate/up + SwiGLU, down + residual, then the next layer's normed q/k/v with RoPE.
    f32 = {"dtype": torch.float32}
    p = _mlp_problem(rows, 32, 40, 32, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    n = (HQ + 2 * HKV) * D
    qkv_weight = _rand(g, n, 32, scale=32**-0.5, **f32)
    qkv_bias = _rand(g, n, **f32)
    norm = 1 + _rand(g, 32, scale=0.1, **f32)
    angles = torch.rand(rows, D // 2, generator=g) * 6
    cache = _rand(g, 2, 4, 4, HKV, D, **f32)
    slots = torch.randperm(16, generator=g)[:rows]

    def rope(target):
        return RotaryCacheWrite(
            cos=angles.cos(),
            sin=angles.sin(),
            k_cache=target[0],
            v_cache=target[1],
            slot_mapping=slots,
            num_q_heads=HQ,
        )

    counters = pair_counters(2, "cpu")
    actual_cache = cache.clone()
    activation, out, q = decode_gemv_pair(
        p["x"],
        p["gate_up"],
        p["down"],
        counters=counters,
        slot=0,
        norm_weight=p["norm"],
        swiglu=True,
        second_residual=p["residual"],
        third=GemvStage(qkv_weight, qkv_bias, norm, rope=rope(actual_cache)),
    )
    expected_activation = decode_gemv_reference(
        p["x"], p["gate_up"], norm_weight=p["norm"], swiglu=True
    )
    expected = decode_gemv_reference(expected_activation, p["down"], residual=p["residual"])
    qkv = decode_gemv_reference(expected, qkv_weight, qkv_bias, norm_weight=norm)
    expected_cache = cache.clone()
    split = rope(expected_cache)
    expected_q = rotary_kv_write_reference(
        *split.split(qkv), split.cos, split.sin, expected_cache[0], expected_cache[1], slots
    ).flatten(-2)
    for actual, wanted in (
        (activation, expected_activation),
        (out, expected),
        (q, expected_q),
        (actual_cache, expected_cache),
    ):
        torch.testing.assert_close(actual, wanted, atol=1e-5, rtol=1e-5)
    # Both counts of slot 0: 10 gate/up programs (40 columns by 4), then 8 down programs.
    half = PAIR_SLOT_STRIDE // 2
    assert counters[0].item() == 10 and counters[half].item() == 8


@needs_triton
@pytest.mark.interpreter
def test_a_cycle_of_calls_zeroes_each_next_slot(triton_backend):
    p = _mlp_problem(1, 40, 24, 48)
    counters = pair_counters(3, "cpu")
    counts = []
    for slot in (0, 1, 2, 0):
        _mlp_pair(p, counters, slot)
        counts.append(counters.view(3, PAIR_SLOT_STRIDE)[:, 0].tolist())
    # 24 outputs over blocks of 4 columns: 6 programs count; the next slot is zeroed.
    assert counts == [[6, 0, 0], [6, 6, 0], [0, 6, 6], [6, 0, 6]]


def test_torch_path_is_the_two_decode_gemv_calls(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    p = _mlp_problem(2, 40, 24, 48)
    counters = pair_counters(2, "cpu")
    activation, out = _mlp_pair(p, counters)
    expected_activation = decode_gemv(p["x"], p["gate_up"], norm_weight=p["norm"], swiglu=True)
    expected = decode_gemv(expected_activation, p["down"], residual=p["residual"])
    assert torch.equal(activation, expected_activation) and torch.equal(out, expected)
    assert counters.eq(0).all()


def test_bad_arguments_raise():
    p = _mlp_problem(1, 40, 24, 48)
    counters = pair_counters(2, "cpu")
    with pytest.raises(KernelValueError, match="slots=1"):
        pair_counters(1, "cpu")
    with pytest.raises(KernelValueError, match="slot=2"):
        _mlp_pair(p, counters, slot=2)
    with pytest.raises(KernelShapeError, match="at most 2"):
        _mlp_pair({**p, "x": p["x"].repeat(3, 1)}, counters)
    with pytest.raises(KernelShapeError, match="projection 2"):
        _mlp_pair({**p, "down": p["down"][:, :10]}, counters)
    with pytest.raises(KernelValueError, match="RoPE last"):
        rope = RotaryCacheWrite(
            cos=torch.ones(1, 4),
            sin=torch.zeros(1, 4),
            k_cache=torch.zeros(4, 4, HKV, D),
            v_cache=torch.zeros(4, 4, HKV, D),
            slot_mapping=torch.zeros(1, dtype=torch.long),
            num_q_heads=HQ,
        )
        decode_gemv_pair(
            p["x"],
            p["gate_up"],
            torch.zeros((HQ + 2 * HKV) * D, 24, dtype=torch.bfloat16),
            counters=counters,
            slot=0,
            swiglu=True,
            second_rope=rope,
            third=GemvStage(torch.zeros(8, HQ * D, dtype=torch.bfloat16)),
        )
    with pytest.raises(KernelShapeError, match="residual"):
        _mlp_pair({**p, "residual": p["residual"][:, :10]}, counters)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_bfloat16_equals_two_launches_eager_and_graph(rows):
    from mcore_kernels.pdl import programmatic_dependent_launch

    # The Qwen2.5-0.5B MLP shape: 1216 programs count, 896 wait.
    p = _mlp_problem(rows, 896, 4864, 896, device="cuda")
    counters = pair_counters(2, "cuda")
    expected_activation = decode_gemv(p["x"], p["gate_up"], norm_weight=p["norm"], swiglu=True)
    expected = decode_gemv(expected_activation, p["down"], residual=p["residual"])
    with programmatic_dependent_launch(True):
        for slot in (0, 1, 0):
            activation, out = _mlp_pair(p, counters, slot)
            torch.testing.assert_close(activation, expected_activation, atol=0, rtol=0)
            torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            first = _mlp_pair(p, counters, 1)
            second = _mlp_pair(p, counters, 0)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            for activation, out in (first, second):
                assert torch.equal(activation, expected_activation)
                torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
