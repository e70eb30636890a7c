"""RoPE + cache write + paged attention in one launch (interpreted on CPU) against torch."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel modules' import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelShapeError
from mcore_kernels.normed_rotary_kv_write import normed_rotary_kv_write
from mcore_kernels.paged_attention import PagedDecodeConfig, paged_attention_reference
from mcore_kernels.reference import rotary_paged_attention_reference
from mcore_kernels.rotary_kv_write import rotary_kv_write_reference
from mcore_kernels.rotary_paged_attention import rotary_paged_attention

pytestmark = pytest.mark.interpreter


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _problem(contexts, q_heads, kv_heads, head_dim, hidden, dtype, *, block=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = len(contexts)
    width = (q_heads + 2 * kv_heads) * head_dim
    x = (2.0 * torch.randn(tokens, hidden, generator=g)).to(dtype)
    qkv = (torch.randn(tokens, width, generator=g)).to(dtype)
    bias = (0.5 * torch.randn(width, generator=g)).to(dtype)
    positions = torch.tensor(contexts).float() - 1
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[:, None] * inv_freq
    width_blocks = -(-max(contexts) // block)
    num_blocks = tokens * width_blocks + 1
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(dtype)
    # Token t owns blocks 1 + t * width .. ; its new key goes to position context - 1.
    tables = (torch.arange(tokens * width_blocks, dtype=torch.int32) + 1).view(tokens, -1)
    lens = torch.tensor(contexts, dtype=torch.int32)
    last = lens.long() - 1
    slots = tables[torch.arange(tokens), last // block].long() * block + last % block
    return x, qkv, bias, angles.cos(), angles.sin(), k_cache, v_cache, slots, tables, lens


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_and_writes_the_cache(triton_backend, normed, dtype):
    # Contexts: one position, a block boundary, several tiles of 16 positions.
    x, qkv, bias, cos, sin, k_cache, v_cache, slots, tables, lens = _problem(
        [1, 4, 37], 6, 2, 32, 40, dtype
    )
    norm = dict(norm_input=(x, 1e-6), bias=bias) if normed else {}
    caches = (k_cache.clone(), v_cache.clone())
    actual = rotary_paged_attention(
        qkv, cos, sin, k_cache, v_cache, slots, tables, lens, num_q_heads=6, scale=0.2,
        config=PagedDecodeConfig(tile=16), **norm,
    )  # fmt: skip
    expected = rotary_paged_attention_reference(
        qkv, cos, sin, *caches, slots, tables, lens, num_q_heads=6, scale=0.2, **norm
    )
    assert actual.shape == (3, 6, 32) and actual.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(actual.float(), expected.float(), **tol)
    # The new keys and values in their slots: those of the standalone kernels' references;
    # without the folded norm (whose row scale sums in another order) bit for bit, as the
    # rotation rounds every product and sum as the torch expression does.
    torch.testing.assert_close(k_cache.float(), caches[0].float(), **tol)
    torch.testing.assert_close(v_cache.float(), caches[1].float(), **tol)
    if not normed:
        assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])


def test_normed_path_equals_normed_rotary_kv_write_then_attention(triton_backend):
    # float32: the same finish and rotation as normed_rotary_kv_write, the same attention.
    x, qkv, bias, cos, sin, k_cache, v_cache, slots, tables, lens = _problem(
        [3, 9, 20], 4, 2, 32, 24, torch.float32, seed=2
    )
    caches = (k_cache.clone(), v_cache.clone())
    actual = rotary_paged_attention(
        qkv, cos, sin, k_cache, v_cache, slots, tables, lens, num_q_heads=4, scale=0.3,
        norm_input=(x, 1e-5), bias=bias,
    )  # fmt: skip
    q = normed_rotary_kv_write(qkv, x, 1e-5, bias, cos, sin, *caches, slots, 4)
    expected = paged_attention_reference(q, *caches, tables, lens, scale=0.3)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache, caches[0], atol=1e-6, rtol=1e-6)


def test_reference_composes_the_unfused_references():
    _, qkv, _, cos, sin, k_cache, v_cache, slots, tables, lens = _problem(
        [5, 8], 2, 1, 32, 16, torch.float32, seed=3
    )
    caches = (k_cache.clone(), v_cache.clone())
    actual = rotary_paged_attention_reference(
        qkv, cos, sin, k_cache, v_cache, slots, tables, lens, num_q_heads=2, scale=0.5
    )
    q, k, v = (t.unflatten(-1, (-1, 32)) for t in qkv.split([64, 32, 32], dim=-1))
    rotated = rotary_kv_write_reference(q, k, v, cos, sin, *caches, slots)
    expected = paged_attention_reference(rotated, *caches, tables, lens, scale=0.5)
    torch.testing.assert_close(actual, expected)


def test_shape_errors_name_the_argument():
    _, qkv, bias, cos, sin, k_cache, v_cache, slots, tables, lens = _problem(
        [2, 3], 2, 1, 32, 16, torch.float32
    )
    args = (cos, sin, k_cache, v_cache, slots, tables, lens)
    with pytest.raises(KernelShapeError, match=r"qkv\.shape"):
        rotary_paged_attention(qkv[:, :-1], *args, num_q_heads=2, scale=1.0)
    with pytest.raises(KernelShapeError, match=r"bias\.shape"):
        rotary_paged_attention(qkv, *args, num_q_heads=2, scale=1.0, bias=bias)
    with pytest.raises(KernelShapeError, match=r"context_lens\.shape"):
        rotary_paged_attention(qkv, *args[:-1], lens[:1], num_q_heads=2, scale=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("normed", [False, True])
def test_gpu_kernel_matches_the_two_kernels_in_bf16(normed):
    # 512 decode tokens of Qwen2.5-0.5B heads (14 query, 2 key/value, 64 channels): the
    # standalone RoPE + cache write kernel, then the paged attention of one split.
    from mcore_kernels.paged_attention import paged_attention
    from mcore_kernels.rotary_kv_write import rotary_kv_write

    contexts = torch.randint(1, 193, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    x, qkv, bias, cos, sin, k_cache, v_cache, slots, tables, lens = (
        t.cuda() for t in _problem(contexts, 14, 2, 64, 896, torch.bfloat16, block=16)
    )
    caches = (k_cache.clone(), v_cache.clone())
    norm = dict(norm_input=(x, 1e-6), bias=bias) if normed else {}
    actual = rotary_paged_attention(
        qkv, cos, sin, k_cache, v_cache, slots, tables, lens, num_q_heads=14, scale=0.125, **norm
    )
    if normed:
        q = normed_rotary_kv_write(qkv, x, 1e-6, bias, cos, sin, *caches, slots, 14)
    else:
        q, k, v = (t.unflatten(-1, (-1, 64)) for t in qkv.split([896, 128, 128], dim=-1))
        q = rotary_kv_write(q, k, v, cos, sin, *caches, slots)
    expected = paged_attention(q, *caches, tables, lens, scale=0.125, split_size=512)
    # The row scale's float32 sum may round in another order: one bf16 ulp at most.
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_cache.float(), caches[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(v_cache.float(), caches[1].float(), atol=2e-2, rtol=2e-2)
    if not normed:
        # RoPE and the cache write round as rotary_kv_write rounds (one shared rotation that
        # the compiler cannot contract), values are stored as they come: the same bits. The
        # attention agrees to bf16 rounding only: at 512 tokens paged_attention's own launch
        # may stack several tokens in one program's products (another summation order). With
        # the folded norm the values too carry the row scale (another order of its sum).
        assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
