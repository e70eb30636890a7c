"""RoPE + paged KV-cache write: the Triton kernel (interpreted on CPU) against the torch reference."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.rotary_kv_write import (
    rotary_kv_write,
    rotary_kv_write_reference,
    rotary_kv_write_triton,
)

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _problem(tokens, q_heads, kv_heads, head_dim, dtype, *, cache_dtype=None, seed=0):
    """A fused-projection output split into strided q/k/v views, tables and a cache."""
    generator = torch.Generator().manual_seed(seed)
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn((tokens, width), generator=generator).to(dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (tokens,), generator=generator).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[:, None] * inv_freq
    block_size, num_blocks = 4, 8
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    cache_dtype = cache_dtype or dtype
    k_cache = torch.randn(cache_shape, generator=generator).to(cache_dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    device = _device()
    views = [t.unflatten(-1, (-1, head_dim)).to(device) for t in (q, k, v)]
    return (
        *views,
        angles.cos().to(device),
        angles.sin().to(device),
        k_cache.to(device),
        v_cache.to(device),
        slots.to(device),
    )


def _rotate_like_the_model(x, cos, sin):
    """The model's apply_rotary (mcore_models.gpt.rope) for [T, H, D] inputs."""
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def test_reference_rotates_queries_and_stores_rotated_keys_and_raw_values():
    q, k, v, cos, sin, k_cache, v_cache, slots = _problem(5, 4, 2, 8, torch.float32)
    untouched = torch.ones(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    untouched[slots.long()] = False
    before_k = k_cache.clone()
    out = rotary_kv_write_reference(q, k, v, cos, sin, k_cache, v_cache, slots)
    torch.testing.assert_close(out, _rotate_like_the_model(q, cos, sin), rtol=0, atol=0)
    flat_k = k_cache.view(-1, 2, 8)
    flat_v = v_cache.view(-1, 2, 8)
    torch.testing.assert_close(flat_k[slots.long()], _rotate_like_the_model(k, cos, sin))
    torch.testing.assert_close(flat_v[slots.long()], v)
    assert torch.equal(flat_k[untouched], before_k.view(-1, 2, 8)[untouched])


def _assert_within_rounding(actual, expected, x):
    """``|actual - expected| <= 2 eps (|x1| + |x2|)`` per element, eps of ``x``'s dtype.

    With ``|cos|, |sin| <= 1`` that bounds the rounding of both products and of the result,
    whether or not the products are rounded separately (the reference) or contracted into
    fused multiply-adds (the GPU), and it is far below any error of the rotation itself.
    """
    half = x.shape[-1] // 2
    pair = x[..., :half].float().abs() + x[..., half:].float().abs()
    finfo = torch.finfo(x.dtype)
    bound = 2 * finfo.eps * torch.cat((pair, pair), dim=-1) + finfo.tiny
    error = (actual.float() - expected.float()).abs()
    assert bool((error <= bound).all()), f"error up to {(error / bound).max().item():.3g}x bound"


@needs_triton
@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim", "dtype", "cache_dtype"),
    [
        (3, (4, 2), 8, torch.float32, None),
        (5, (7, 1), 12, torch.float32, None),  # odd group, half dim not a power of two
        (4, (6, 3), 16, torch.bfloat16, None),
        (2, (2, 2), 8, torch.bfloat16, torch.float32),  # cache in another dtype
    ],
)
def test_triton_matches_reference(tokens, heads, head_dim, dtype, cache_dtype):
    args = _problem(tokens, *heads, head_dim, dtype, cache_dtype=cache_dtype)
    q, k, v, cos, sin, k_cache, v_cache, slots = args
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = rotary_kv_write_reference(q, k, v, cos, sin, ref_k, ref_v, slots)
    actual = rotary_kv_write_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert actual.dtype == dtype and actual.is_contiguous()
    torch.testing.assert_close(v_cache.float(), ref_v.float(), rtol=0, atol=0)
    if torch.cuda.is_available():
        # The GPU compiler may contract a product and the sum into one FMA: not bit-exact.
        _assert_within_rounding(actual, expected, q)
        keys, ref_keys = (c.view(-1, *c.shape[2:]) for c in (k_cache, ref_k))
        rows = slots.long()
        _assert_within_rounding(keys[rows], ref_keys[rows], k)
        # Every other slot is untouched.
        assert torch.equal(keys.index_copy(0, rows, ref_keys[rows]), ref_keys)
        return
    # The interpreter runs numpy without contraction: fp32 is bit-exact. It truncates each of
    # the four fp32 -> bf16 roundings (a bf16 ulp of inputs below 4 is at most 2**-6, and a
    # difference may cancel), so on CPU bf16 is allowed a few ulps of the inputs.
    exact = dtype == torch.float32
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1.6e-2, "atol": 4 * 2**-6}
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance)
    torch.testing.assert_close(k_cache.float(), ref_k.float(), **tolerance)


def test_dispatch_uses_reference_when_backend_is_torch(monkeypatch):
    q, k, v, cos, sin, k_cache, v_cache, slots = _problem(2, 2, 1, 4, torch.float32)
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    expected_k = k_cache.clone()
    expected = rotary_kv_write_reference(q, k, v, cos, sin, expected_k, v_cache.clone(), slots)
    assert torch.equal(rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, slots), expected)
    assert torch.equal(k_cache, expected_k)


def test_bad_shapes_and_dtypes_raise_typed_errors():
    q, k, v, cos, sin, k_cache, v_cache, slots = _problem(3, 4, 2, 8, torch.float32)
    with pytest.raises(KernelShapeError, match="cos"):
        rotary_kv_write_reference(q, k, v, cos[:, :2], sin, k_cache, v_cache, slots)
    with pytest.raises(KernelDtypeError, match="float32"):
        rotary_kv_write_reference(q, k, v, cos.double(), sin, k_cache, v_cache, slots)
    with pytest.raises(KernelShapeError, match="slot_mapping"):
        rotary_kv_write_reference(q, k, v, cos, sin, k_cache, v_cache, slots[:2])
    with pytest.raises(KernelShapeError, match="k_cache"):
        rotary_kv_write_reference(q, k, v, cos, sin, k_cache[..., :4], v_cache, slots)
