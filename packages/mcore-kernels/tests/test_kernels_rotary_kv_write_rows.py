"""rotary_kv_write_rows (one program per token) against rotary_kv_write (one per head): same bits."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelShapeError
from mcore_kernels.rotary_kv_write import rotary_kv_write_triton
from mcore_kernels.rotary_kv_write_rows import rotary_kv_write_rows

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")


def _problem(tokens, q_heads, kv_heads, head_dim, dtype, cache_dtype):
    """Strided q/k/v views of one fused projection output, RoPE tables and a cache."""
    generator = torch.Generator().manual_seed(tokens * q_heads + head_dim)
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn((tokens, width), generator=generator).to(dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    angles = torch.rand((tokens, head_dim // 2), generator=generator) * 100
    cache = torch.randn((8, 4, kv_heads, head_dim), generator=generator).to(cache_dtype)
    slots = torch.randperm(32, generator=generator)[:tokens]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    views = [t.unflatten(-1, (-1, head_dim)).to(device) for t in (q, k, v)]
    return (
        views,
        angles.cos().to(device),
        angles.sin().to(device),
        cache.to(device),
        slots.to(device),
    )


@needs_triton
@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim", "dtype", "cache_dtype"),
    [
        (3, (4, 2), 8, torch.float32, torch.float32),
        (5, (7, 1), 12, torch.bfloat16, torch.bfloat16),  # odd group, half dim not a power of 2
        (2, (6, 3), 16, torch.bfloat16, torch.float32),  # three key/value heads, fp32 cache
    ],
)
def test_same_bits_as_one_program_per_head(tokens, heads, head_dim, dtype, cache_dtype):
    (q, k, v), cos, sin, cache, slots = _problem(tokens, *heads, head_dim, dtype, cache_dtype)
    ref_k, ref_v = cache.clone(), cache.clone() + 1
    k_cache, v_cache = ref_k.clone(), ref_v.clone()
    expected = rotary_kv_write_triton(q, k, v, cos, sin, ref_k, ref_v, slots)
    actual = rotary_kv_write_rows(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert actual.dtype == dtype and actual.is_contiguous()
    assert torch.equal(actual, expected)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


def test_bad_shapes_raise_typed_errors():
    (q, k, v), cos, sin, cache, slots = _problem(2, 2, 1, 8, torch.float32, torch.float32)
    with pytest.raises(KernelShapeError, match="expected"):
        rotary_kv_write_rows(q, k, v[:, :, :4], cos, sin, cache, cache.clone(), slots)
    with pytest.raises(KernelShapeError, match="cos"):
        rotary_kv_write_rows(q, k, v, cos[:1], sin, cache, cache.clone(), slots)
