"""norm_linear: RMSNorm + GEMM + epilogue (plain, SwiGLU, RoPE + cache write) in one Triton
launch (interpreted on CPU, compiled on a GPU) against the unfused torch ops."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.nn.functional as F

from mcore_kernels.errors import KernelShapeError
from mcore_kernels.norm_linear import (
    NormLinearConfig,
    norm_linear,
    norm_linear_reference,
    norm_linear_triton,
)
from mcore_kernels.reference import rms_norm_reference
from mcore_kernels.rotary_kv_write import RotaryCacheWrite, rotary_kv_write_reference

pytestmark = pytest.mark.interpreter

HQ, HKV, D, K = 4, 2, 32, 48
SMALL = NormLinearConfig(block_m=16, block_n=32, block_k=16, num_stages=1)
"""Tiles smaller than the problem: several row tiles, column tiles and reduction steps."""


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(rows: int, columns: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=generator)
    weight = torch.randn(columns, K, generator=generator) / K**0.5
    bias = torch.randn(columns, generator=generator)
    norm = 1 + 0.3 * torch.randn(K, generator=generator)
    return (t.to(dtype).to(_device()) for t in (x, weight, bias, norm))


def _rope(rows: int, dtype: torch.dtype, seed: int = 1) -> RotaryCacheWrite:
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 100, (rows,), generator=generator).float()
    inverse = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    angles = positions[:, None] * inverse[None, :]
    cache = torch.zeros(8, 4, HKV, D, dtype=dtype)
    slots = torch.randperm(32, generator=generator)[:rows]
    device = _device()
    return RotaryCacheWrite(
        cos=angles.cos().to(device),
        sin=angles.sin().to(device),
        k_cache=cache.to(device),
        v_cache=cache.clone().to(device),
        slot_mapping=slots.to(device),
        num_q_heads=HQ,
    )


def _unfused(x, weight, bias, norm, *, swiglu=False, rope=None):
    """The ops norm_linear replaces, written out: RMSNorm, linear, SwiGLU or RoPE + cache."""
    y = F.linear(rms_norm_reference(x, norm, 1e-6), weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        return (F.silu(gate.float()) * up.float()).to(y.dtype)
    if rope is None:
        return y
    q, k, v = y.split((HQ * D, HKV * D, HKV * D), dim=-1)
    return rotary_kv_write_reference(
        q.unflatten(-1, (HQ, D)),
        k.unflatten(-1, (HKV, D)),
        v.unflatten(-1, (HKV, D)),
        rope.cos,
        rope.sin,
        rope.k_cache,
        rope.v_cache,
        rope.slot_mapping,
    ).flatten(-2)


@pytest.mark.parametrize("rows", [1, 5, 37])
def test_plain_epilogue_matches_norm_then_linear(rows):
    x, weight, bias, norm = _inputs(rows, 100, torch.float32)
    expected = _unfused(x, weight, bias, norm)
    actual = norm_linear_triton(x, weight, bias, norm_weight=norm, config=SMALL)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)
    # Without the norm it is the linear layer alone.
    plain = norm_linear_triton(x, weight, None, config=SMALL)
    torch.testing.assert_close(plain, F.linear(x, weight), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("rows", [3, 37])
def test_swiglu_epilogue_matches_linear_then_swiglu(rows):
    x, weight, _, norm = _inputs(rows, 2 * 40, torch.float32)
    expected = _unfused(x, weight, None, norm, swiglu=True)
    actual = norm_linear_triton(x, weight, norm_weight=norm, swiglu=True, config=SMALL)
    assert actual.shape == (rows, 40)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_epilogue_rotates_queries_and_writes_the_cache(dtype):
    rows = 6
    x, weight, bias, norm = _inputs(rows, (HQ + 2 * HKV) * D, dtype)
    expected_rope, actual_rope = _rope(rows, dtype), _rope(rows, dtype)
    expected = _unfused(x, weight, bias, norm, rope=expected_rope)
    config = NormLinearConfig(block_m=16, block_n=D, block_k=16, num_stages=1)
    actual = norm_linear_triton(x, weight, bias, norm_weight=norm, rope=actual_rope, config=config)
    # bf16: a few ulp (the interpreter truncates float32 -> bf16 casts, the CPU reference
    # rounds its own GEMM output).
    tolerance = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=0.03, rtol=0.03)
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance)
    torch.testing.assert_close(
        actual_rope.k_cache.float(), expected_rope.k_cache.float(), **tolerance
    )
    torch.testing.assert_close(
        actual_rope.v_cache.float(), expected_rope.v_cache.float(), **tolerance
    )
    # Slots that no token owns stay untouched.
    written = torch.zeros(32, dtype=torch.bool)
    written[actual_rope.slot_mapping.cpu()] = True
    assert actual_rope.k_cache.flatten(0, 1)[~written.to(_device())].abs().sum() == 0


def test_rows_do_not_depend_on_the_other_rows_and_repeat_bitwise():
    # Every row's result is computed from its own row only, in a fixed order: a row alone,
    # the same row among others and a second launch give the same bits.
    x, weight, _, norm = _inputs(37, 2 * 40, torch.float32)
    full = norm_linear_triton(x, weight, norm_weight=norm, swiglu=True, config=SMALL)
    again = norm_linear_triton(x, weight, norm_weight=norm, swiglu=True, config=SMALL)
    alone = norm_linear_triton(x[20:21], weight, norm_weight=norm, swiglu=True, config=SMALL)
    assert torch.equal(full, again)
    assert torch.equal(full[20:21], alone)


def test_dispatch_runs_the_reference_or_the_kernel_to_the_same_values():
    x, weight, bias, norm = _inputs(5, 100, torch.float32)
    dispatched = norm_linear(x, weight, bias, norm_weight=norm)
    reference = norm_linear_reference(x, weight, bias, norm_weight=norm)
    torch.testing.assert_close(dispatched, reference, atol=2e-5, rtol=2e-5)


def test_bad_shapes_raise_naming_the_argument():
    x, weight, bias, norm = _inputs(5, 100, torch.float32)
    with pytest.raises(KernelShapeError, match="weight"):
        norm_linear_triton(x, weight[:, :10])
    with pytest.raises(KernelShapeError, match="norm_weight"):
        norm_linear_triton(x, weight, norm_weight=norm[:10])
    with pytest.raises(KernelShapeError, match="swiglu=True"):
        norm_linear_triton(x, weight, bias, swiglu=True)
    with pytest.raises(KernelShapeError, match="rope epilogue"):
        norm_linear_triton(x, weight, rope=_rope(5, torch.float32))
    with pytest.raises(KernelShapeError, match="block_m=24"):
        NormLinearConfig(block_m=24)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [3, 64, 200, 512])
def test_gpu_bf16_matches_the_unfused_ops_at_decode_shapes(rows):
    # Qwen2.5-0.5B-like widths (K 896, 14 + 2 + 2 heads of 64, FFN 4864) at decode batch sizes.
    generator = torch.Generator(device="cuda").manual_seed(rows)
    hidden, ffn, heads, head_dim = 896, 4864, (14, 2), 64
    x = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    norm = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=generator)).bfloat16()
    gate_up = (0.03 * torch.randn(2 * ffn, hidden, device="cuda", generator=generator)).bfloat16()
    expected = norm_linear_reference(x, gate_up, norm_weight=norm, swiglu=True)
    actual = norm_linear(x, gate_up, norm_weight=norm, swiglu=True)
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)
    columns = (heads[0] + 2 * heads[1]) * head_dim
    qkv = (0.03 * torch.randn(columns, hidden, device="cuda", generator=generator)).bfloat16()
    bias = (0.1 * torch.randn(columns, device="cuda", generator=generator)).bfloat16()
    positions = torch.randint(0, 4000, (rows,), device="cuda", generator=generator).float()
    inverse = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
    angles = positions[:, None] * inverse
    slots = torch.randperm(rows * 4, device="cuda", generator=generator)[:rows]
    caches = [torch.zeros(rows, 4, heads[1], head_dim, device="cuda").bfloat16() for _ in range(4)]
    ropes = [
        RotaryCacheWrite(
            cos=angles.cos(),
            sin=angles.sin(),
            k_cache=k_cache,
            v_cache=v_cache,
            slot_mapping=slots,
            num_q_heads=heads[0],
        )
        for k_cache, v_cache in (caches[:2], caches[2:])
    ]
    expected = norm_linear_reference(x, qkv, bias, norm_weight=norm, rope=ropes[0])
    actual = norm_linear(x, qkv, bias, norm_weight=norm, rope=ropes[1])
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)
    for got, want in ((caches[2], caches[0]), (caches[3], caches[1])):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
