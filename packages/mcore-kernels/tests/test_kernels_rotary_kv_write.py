"""RoPE + paged KV-cache write: the Triton kernel (interpreted on CPU) against the torch reference."""

import math
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


@needs_triton
@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim", "dtype", "cache_dtype"),
    [
        (3, (4, 2), 8, torch.float32, None),
        (5, (7, 1), 12, torch.float32, None),  # odd group, half dim not a power of two
        (4, (6, 3), 16, torch.bfloat16, None),
        (2, (2, 2), 8, torch.bfloat16, torch.float32),  # cache in another dtype
        (32, (14, 2), 64, torch.bfloat16, None),  # Qwen2.5-0.5B heads
        (8, (4, 2), 32, torch.float16, None),
    ],
)
def test_triton_matches_reference(tokens, heads, head_dim, dtype, cache_dtype):
    args = _problem(tokens, *heads, head_dim, dtype, cache_dtype=cache_dtype)
    q, k, v, cos, sin, k_cache, v_cache, slots = args
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = rotary_kv_write_reference(q, k, v, cos, sin, ref_k, ref_v, slots)
    actual = rotary_kv_write_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert actual.dtype == dtype and actual.is_contiguous()
    # Every product and sum rounds as the torch expression does (no contraction on the GPU,
    # round to nearest even in the interpreter too): the reference's bits, caches included
    # (every other slot untouched).
    assert torch.equal(actual, expected)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_rounds_like_the_torch_expression_over_the_whole_range(dtype):
    # Magnitudes from the subnormals of the dtype up to 2**10, and pairs where the two products
    # nearly cancel: a fused multiply-add or a flush to zero would show in the last bit.
    generator = torch.Generator().manual_seed(7)
    tokens, heads, head_dim = 8, 2, 16
    tiny = torch.finfo(dtype).tiny
    low = math.log2(tiny * torch.finfo(dtype).eps)
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        # The interpreter converts bfloat16 subnormals to float32 wrongly: normal values only.
        low = math.log2(tiny) + 16
    exponents = low + (10 - low) * torch.rand(tokens, 3 * heads, head_dim, generator=generator)
    signs = torch.randint(0, 2, exponents.shape, generator=generator) * 2 - 1
    values = (signs * torch.exp2(exponents.double())).to(dtype)
    values[:, :, head_dim // 2 :][::2] = values[:, :, : head_dim // 2][::2]
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 2 * math.pi
    angles[::2] = math.pi / 4
    q, k, v = values.split(heads, dim=1)
    device = _device()
    q, k, v, cos, sin = (t.to(device) for t in (q, k, v, angles.cos(), angles.sin()))
    caches = [torch.zeros(4, 2, heads, head_dim, dtype=dtype, device=device) for _ in "kv"]
    slots = torch.randperm(8, generator=generator)[:tokens].to(device)
    expected_k, expected_v = (c.clone() for c in caches)
    expected = rotary_kv_write_reference(q, k, v, cos, sin, expected_k, expected_v, slots)
    actual = rotary_kv_write_triton(q, k, v, cos, sin, *caches, slots)
    assert torch.equal(actual, expected)
    assert torch.equal(caches[0], expected_k) and torch.equal(caches[1], expected_v)


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
