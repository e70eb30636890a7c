"""Paged attention: the Triton split-KV kernel (interpreted on CPU) against the torch reference."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelShapeError
from mcore_kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    paged_attention_triton,
)

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _random_paged_problem(
    context_lens, *, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, dtype, seed=0
):
    """Scatter each token's context over shuffled physical blocks; return the paged inputs."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens = len(context_lens)
    num_blocks = num_tokens * max_blocks + 1
    permutation = torch.randperm(num_blocks, generator=generator)
    block_tables = permutation[: num_tokens * max_blocks].reshape(num_tokens, max_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    q = torch.randn((num_tokens, num_q_heads, head_dim), generator=generator).to(dtype)
    device = _device()
    return (
        q.to(device),
        k_cache.to(device),
        v_cache.to(device),
        block_tables.to(torch.int32).to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
    )


def _dense_attention(q, keys, values, scale):
    """Textbook softmax attention of one token over contiguous keys/values [L, Hkv, D]."""
    group = q.shape[0] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.float(), keys) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), values)


def test_reference_matches_dense_attention_over_gathered_blocks():
    q, k_cache, v_cache, tables, lens = _random_paged_problem(
        [1, 5, 12],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        max_blocks=3,
        dtype=torch.float32,
    )
    out = paged_attention_reference(q, k_cache, v_cache, tables, lens, scale=0.3)
    for t, length in enumerate(lens.tolist()):
        keys = k_cache[tables[t].long()].reshape(-1, 2, 8)[:length]
        values = v_cache[tables[t].long()].reshape(-1, 2, 8)[:length]
        torch.testing.assert_close(out[t], _dense_attention(q[t], keys, values, 0.3))


@needs_triton
@pytest.mark.parametrize(
    ("dtype", "block_size", "split_size", "head_dim", "heads", "atol"),
    [
        (torch.float32, 4, 8, 8, (4, 2), 1e-5),  # broadcast-sum path (tiles of 8)
        (torch.float32, 4, 32, 8, (4, 2), 1e-5),  # tensor-core tiles spanning 8 blocks
        (torch.float32, 16, 32, 24, (7, 1), 1e-5),
        (torch.bfloat16, 16, 32, 16, (6, 3), 2e-2),
    ],
)
def test_triton_matches_reference(dtype, block_size, split_size, head_dim, heads, atol):
    num_q_heads, num_kv_heads = heads
    # Context lengths cover one position, exact block/split boundaries and several splits.
    lens = [1, block_size, block_size + 1, 2 * block_size + 3, 4 * block_size, split_size + 1]
    q, k_cache, v_cache, tables, lens_t = _random_paged_problem(
        lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        max_blocks=max(lens) // block_size + 1,
        dtype=dtype,
    )
    scale = head_dim**-0.5
    expected = paged_attention_reference(q, k_cache, v_cache, tables, lens_t, scale=scale)
    actual = paged_attention_triton(
        q, k_cache, v_cache, tables, lens_t, scale=scale, split_size=split_size
    )
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=atol)


@needs_triton
def test_triton_output_of_a_token_is_independent_of_the_batch():
    q, k_cache, v_cache, tables, lens = _random_paged_problem(
        [3, 9, 14, 16],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        max_blocks=4,
        dtype=torch.float32,
    )
    full = paged_attention_triton(q, k_cache, v_cache, tables, lens, scale=0.5, split_size=8)
    for t in range(4):
        alone = paged_attention_triton(
            q[t : t + 1],
            k_cache,
            v_cache,
            tables[t : t + 1],
            lens[t : t + 1],
            scale=0.5,
            split_size=8,
        )
        assert torch.equal(alone[0], full[t])


def test_dispatch_uses_reference_when_backend_is_torch(monkeypatch):
    q, k_cache, v_cache, tables, lens = _random_paged_problem(
        [2, 7],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=4,
        block_size=4,
        max_blocks=2,
        dtype=torch.float32,
    )
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    dispatched = paged_attention(q, k_cache, v_cache, tables, lens, scale=1.0)
    expected = paged_attention_reference(q, k_cache, v_cache, tables, lens, scale=1.0)
    assert torch.equal(dispatched, expected)


def test_mismatched_head_counts_raise_shape_error():
    q, k_cache, v_cache, tables, lens = _random_paged_problem(
        [2],
        num_q_heads=3,
        num_kv_heads=2,
        head_dim=4,
        block_size=4,
        max_blocks=1,
        dtype=torch.float32,
    )
    with pytest.raises(KernelShapeError, match="not a multiple"):
        paged_attention_reference(q, k_cache, v_cache, tables, lens, scale=1.0)


@needs_triton
def test_split_size_not_multiple_of_block_raises_shape_error():
    q, k_cache, v_cache, tables, lens = _random_paged_problem(
        [2],
        num_q_heads=2,
        num_kv_heads=2,
        head_dim=4,
        block_size=4,
        max_blocks=1,
        dtype=torch.float32,
    )
    with pytest.raises(KernelShapeError, match="split_size=6"):
        paged_attention_triton(q, k_cache, v_cache, tables, lens, scale=1.0, split_size=6)


@needs_triton
def test_single_split_launch_equals_wide_table_bit_for_bit():
    # Contexts within one split: a table cut to one split takes the single-launch path (no
    # merge); the full-width table merges only the splits that hold data. Same bits.
    q, k_cache, v_cache, tables, lens = _random_paged_problem(
        [1, 5, 8],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        max_blocks=8,
        dtype=torch.float32,
    )
    wide = paged_attention_triton(q, k_cache, v_cache, tables, lens, scale=0.5, split_size=8)
    narrow = paged_attention_triton(
        q, k_cache, v_cache, tables[:, :2], lens, scale=0.5, split_size=8
    )
    assert torch.equal(wide, narrow)
    expected = paged_attention_reference(q, k_cache, v_cache, tables, lens, scale=0.5)
    torch.testing.assert_close(narrow, expected, atol=1e-5, rtol=1e-5)
