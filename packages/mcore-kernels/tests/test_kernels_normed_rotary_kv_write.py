"""RoPE + cache write of a norm-folded q/k/v product (interpreted on CPU) against torch."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel modules' import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelShapeError
from mcore_kernels.normed_rotary_kv_write import normed_rotary_kv_write
from mcore_kernels.reference import normed_qkv_reference
from mcore_kernels.rms_norm import rms_norm
from mcore_kernels.rotary_kv_write import rotary_kv_write_reference

pytestmark = pytest.mark.interpreter


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _problem(tokens, q_heads, kv_heads, head_dim, hidden, dtype, *, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = (q_heads + 2 * kv_heads) * head_dim
    x = (2.0 * torch.randn(tokens, hidden, generator=g)).to(dtype)
    weight = torch.randn(width, hidden, generator=g) / hidden**0.5
    norm_weight = 1.0 + 0.3 * torch.randn(hidden, generator=g)
    b = 0.5 * torch.randn(width, generator=g) if bias else None
    positions = torch.randint(0, 4096, (tokens,), generator=g).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[:, None] * inv_freq
    cache_shape = (8, 4, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(dtype)
    v_cache = torch.randn(cache_shape, generator=g).to(dtype)
    slots = torch.randperm(32, generator=g)[:tokens]
    return x, weight, norm_weight, b, angles.cos(), angles.sin(), k_cache, v_cache, slots


def _split(qkv, q_heads, kv_heads, head_dim):
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return [t.unflatten(-1, (-1, head_dim)) for t in (q, k, v)]


def test_folded_projection_equals_the_projection_of_the_normed_rows():
    # float32: the fold is exact up to the order of the float32 sums.
    x, weight, norm_weight, b, *_ = _problem(5, 4, 2, 8, 24, torch.float32)
    expected = rms_norm(x, norm_weight, 1e-6) @ weight.T + b
    actual = normed_qkv_reference(x @ (weight * norm_weight).T, x, 1e-6, b)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_reference_is_rotary_kv_write_of_the_finished_projection(bias):
    x, weight, norm_weight, b, cos, sin, k_cache, v_cache, slots = _problem(
        5, 4, 2, 8, 24, torch.bfloat16, bias=bias
    )
    qkv = (x.float() @ (weight * norm_weight).T).to(torch.bfloat16)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    finished = normed_qkv_reference(qkv, x, 1e-6, b)
    expected = rotary_kv_write_reference(
        *_split(finished, 4, 2, 8), cos, sin, k_expected, v_expected, slots
    )
    actual = normed_rotary_kv_write(qkv, x, 1e-6, b, cos, sin, k_cache, v_cache, slots, 4)
    assert torch.equal(actual, expected)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


@pytest.mark.parametrize(
    ("tokens", "q_heads", "kv_heads", "head_dim", "hidden", "bias"),
    [(5, 4, 2, 8, 24, True), (3, 7, 1, 16, 40, False), (1, 2, 2, 4, 8, True)],
)
def test_kernel_matches_reference(
    triton_backend, tokens, q_heads, kv_heads, head_dim, hidden, bias
):
    x, weight, norm_weight, b, cos, sin, k_cache, v_cache, slots = _problem(
        tokens, q_heads, kv_heads, head_dim, hidden, torch.bfloat16, bias=bias, seed=tokens
    )
    b = None if b is None else b.to(torch.bfloat16)
    qkv = (x.float() @ (weight * norm_weight).T).to(torch.bfloat16)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    expected = rotary_kv_write_reference(
        *_split(normed_qkv_reference(qkv, x, 1e-6, b), q_heads, kv_heads, head_dim),
        cos,
        sin,
        k_expected,
        v_expected,
        slots,
    )
    actual = normed_rotary_kv_write(qkv, x, 1e-6, b, cos, sin, k_cache, v_cache, slots, q_heads)
    # The kernel's rstd and fused multiply-adds against torch's: one bf16 ulp at most (as in
    # test_kernels_rotary_kv_write's non-exact cases).
    tolerance = {"rtol": 1.6e-2, "atol": 4 * 2**-6}
    torch.testing.assert_close(actual, expected, **tolerance)
    torch.testing.assert_close(k_cache, k_expected, **tolerance)
    torch.testing.assert_close(v_cache, v_expected, **tolerance)


def test_shape_errors_name_the_argument():
    x, weight, _norm, b, cos, sin, k_cache, v_cache, slots = _problem(5, 4, 2, 8, 24, torch.float32)
    qkv = x @ weight.T
    with pytest.raises(KernelShapeError, match=r"qkv\.shape"):
        normed_rotary_kv_write(qkv[:, 1:], x, 1e-6, b, cos, sin, k_cache, v_cache, slots, 4)
    with pytest.raises(KernelShapeError, match=r"x\.shape"):
        normed_rotary_kv_write(qkv, x[1:], 1e-6, b, cos, sin, k_cache, v_cache, slots, 4)
    with pytest.raises(KernelShapeError, match=r"bias\.shape"):
        normed_rotary_kv_write(qkv, x, 1e-6, b[1:], cos, sin, k_cache, v_cache, slots, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 7, 32])
@pytest.mark.parametrize("bias", [True, False])
def test_gpu_kernel_matches_reference(tokens, bias):
    # The decode engine's q/k/v shape (Qwen2.5-0.5B: 14 query and 2 key/value heads of 64,
    # hidden 896), bf16.
    x, weight, norm_weight, b, cos, sin, k_cache, v_cache, slots = (
        t if t is None else t.cuda()
        for t in _problem(tokens, 14, 2, 64, 896, torch.bfloat16, bias=bias, seed=tokens)
    )
    b = None if b is None else b.to(torch.bfloat16)
    qkv = (x.float() @ (weight * norm_weight).T).to(torch.bfloat16)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    expected = rotary_kv_write_reference(
        *_split(normed_qkv_reference(qkv, x, 1e-6, b), 14, 2, 64),
        cos,
        sin,
        k_expected,
        v_expected,
        slots,
    )
    actual = normed_rotary_kv_write(qkv, x, 1e-6, b, cos, sin, k_cache, v_cache, slots, 14)
    tolerance = {"rtol": 1.6e-2, "atol": 4 * 2**-6}
    torch.testing.assert_close(actual, expected, **tolerance)
    torch.testing.assert_close(k_cache, k_expected, **tolerance)
    torch.testing.assert_close(v_cache, v_expected, **tolerance)
