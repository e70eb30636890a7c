"""decode_gemv with RoPE and the key/value cache write folded in (``rope=RotaryCacheWrite``):
the Triton kernel (interpreted on CPU) against the projection followed by ``rotary_kv_write``
(both torch references), the argument checks, and on a GPU the same against the two kernels."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.decode_gemv import GemvConfig, decode_gemv, decode_gemv_triton
from mcore_kernels.errors import KernelShapeError, KernelValueError
from mcore_kernels.reference import decode_gemv_reference
from mcore_kernels.rotary_kv_write import (
    RotaryCacheWrite,
    rotary_kv_write,
    rotary_kv_write_reference,
)

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")

HQ, HKV, D, K = 3, 2, 8, 40
"""Three query heads on two key/value heads: the head kinds meet inside tiles."""


def _problem(rows, dtype, device, *, seed=0, bias=True, norm=True):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(dtype).to(device)

    n = (HQ + 2 * HKV) * D
    positions = torch.randint(0, 512, (rows,), generator=generator).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    angles = positions[:, None] * inv_freq
    blocks, block_size = 4, 4
    cache = rand(2, blocks, block_size, HKV, D)
    slots = torch.randperm(blocks * block_size, generator=generator)[:rows].to(device)
    return {
        "x": rand(rows, K),
        "weight": rand(n, K, scale=K**-0.5),
        "bias": rand(n) if bias else None,
        "norm_weight": (1 + rand(K, scale=0.1)) if norm else None,
        "cos": angles.cos().to(device),
        "sin": angles.sin().to(device),
        "cache": cache,
        "slots": slots,
    }


def _rope(problem, cache):
    return RotaryCacheWrite(
        cos=problem["cos"],
        sin=problem["sin"],
        k_cache=cache[0],
        v_cache=cache[1],
        slot_mapping=problem["slots"],
        num_q_heads=HQ,
    )


def _expected(problem, project, rotate):
    """The projection, then RoPE + cache write, each by its own function."""
    cache = problem["cache"].clone()
    qkv = project(
        problem["x"], problem["weight"], problem["bias"], norm_weight=problem["norm_weight"]
    )
    q, k, v = _rope(problem, cache).split(qkv)
    rotated = rotate(q, k, v, problem["cos"], problem["sin"], cache[0], cache[1], problem["slots"])
    return rotated.flatten(-2), cache


@needs_triton
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize(
    "config",
    [
        None,
        GemvConfig(block_n=4, block_k=16, split_k=3),
        GemvConfig(block_n=16, block_k=16, use_dot=True),
    ],
    ids=["default", "vector_split_k", "dot"],
)
def test_triton_equals_projection_then_rotary_kv_write(rows, config):
    problem = _problem(rows, torch.float32, "cpu" if not torch.cuda.is_available() else "cuda")
    expected, expected_cache = _expected(problem, decode_gemv_reference, rotary_kv_write_reference)
    cache = problem["cache"].clone()
    actual = decode_gemv_triton(
        problem["x"],
        problem["weight"],
        problem["bias"],
        norm_weight=problem["norm_weight"],
        config=config,
        rope=_rope(problem, cache),
    )
    assert actual.shape == (rows, HQ * D)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, expected_cache, atol=1e-5, rtol=1e-5)


def test_torch_path_is_the_projection_then_rotary_kv_write(monkeypatch):
    problem = _problem(2, torch.float64, "cpu", bias=False)
    expected, expected_cache = _expected(problem, decode_gemv_reference, rotary_kv_write_reference)
    cache = problem["cache"].clone()
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    actual = decode_gemv(
        problem["x"],
        problem["weight"],
        norm_weight=problem["norm_weight"],
        rope=_rope(problem, cache),
    )
    assert torch.equal(actual, expected)
    assert torch.equal(cache, expected_cache)


def test_bad_arguments_raise():
    problem = _problem(2, torch.float32, "cpu")
    cache = problem["cache"].clone()
    rope = _rope(problem, cache)
    with pytest.raises(KernelValueError, match="rope with swiglu"):
        decode_gemv(problem["x"], problem["weight"], swiglu=True, rope=rope)
    with pytest.raises(KernelShapeError, match="rows with rope"):
        decode_gemv(problem["x"], problem["weight"][:-D], rope=rope)
    with pytest.raises(KernelShapeError, match="num_q_heads"):
        RotaryCacheWrite(
            cos=rope.cos,
            sin=rope.sin,
            k_cache=cache[0],
            v_cache=cache[1],
            slot_mapping=rope.slot_mapping,
            num_q_heads=0,
        )
    with pytest.raises(KernelShapeError, match="cos"):
        bad = RotaryCacheWrite(
            cos=rope.cos[:1],
            sin=rope.sin,
            k_cache=cache[0],
            v_cache=cache[1],
            slot_mapping=rope.slot_mapping,
            num_q_heads=HQ,
        )
        decode_gemv(problem["x"], problem["weight"], rope=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_bfloat16_equals_the_two_kernels(rows):
    problem = _problem(rows, torch.bfloat16, "cuda")
    expected, expected_cache = _expected(problem, decode_gemv, rotary_kv_write)
    cache = problem["cache"].clone()
    actual = decode_gemv(
        problem["x"],
        problem["weight"],
        problem["bias"],
        norm_weight=problem["norm_weight"],
        rope=_rope(problem, cache),
    )
    # The same roundings at the same points: at most the order of a row's float32 sums can
    # differ (another tile shape), one bf16 ulp.
    torch.testing.assert_close(actual, expected, atol=2**-7, rtol=2**-7)
    torch.testing.assert_close(cache, expected_cache, atol=2**-7, rtol=2**-7)
