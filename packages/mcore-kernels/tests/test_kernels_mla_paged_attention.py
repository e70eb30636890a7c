"""Absorbed MLA paged attention: the Triton split-KV kernel (interpreted on CPU) against the torch
reference, and the reference against textbook attention over up-projected heads."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelShapeError
from mcore_kernels.mla_paged_attention import (
    paged_mla_attention,
    paged_mla_attention_reference,
    paged_mla_attention_triton,
)

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")


def _problem(context_lens, *, heads, rank, rope, block_size, max_blocks, dtype, seed=0):
    """Scatter each token's latent rows over shuffled physical blocks."""
    generator = torch.Generator().manual_seed(seed)
    tokens = len(context_lens)
    num_blocks = tokens * max_blocks + 1
    tables = torch.randperm(num_blocks, generator=generator)[: tokens * max_blocks]
    cache = torch.randn((num_blocks, block_size, rank + rope), generator=generator).to(dtype)
    q_latent = torch.randn((tokens, heads, rank), generator=generator).to(dtype)
    q_rope = torch.randn((tokens, heads, rope), generator=generator).to(dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return (
        q_latent.to(device),
        q_rope.to(device),
        cache.to(device),
        tables.reshape(tokens, max_blocks).to(torch.int32).to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
    )


def test_reference_equals_attention_over_up_projected_heads():
    # Absorption identity: scores q_nope . (W_UK c) = (W_UK^T q_nope) . c, output W_UV (sum p c).
    generator = torch.Generator().manual_seed(3)
    heads, rank, rope, nope, value, length = 3, 8, 4, 5, 6, 7
    w_uk = torch.randn(heads, nope, rank, generator=generator, dtype=torch.float64)
    w_uv = torch.randn(heads, value, rank, generator=generator, dtype=torch.float64)
    c_kv = torch.randn(length, rank, generator=generator, dtype=torch.float64)
    k_rope = torch.randn(length, rope, generator=generator, dtype=torch.float64)
    q_nope = torch.randn(heads, nope, generator=generator, dtype=torch.float64)
    q_rope = torch.randn(heads, rope, generator=generator, dtype=torch.float64)
    keys = torch.cat(
        [torch.einsum("hdr,sr->hsd", w_uk, c_kv), k_rope.expand(heads, length, rope)], dim=-1
    )
    values = torch.einsum("hvr,sr->hsv", w_uv, c_kv)
    query = torch.cat([q_nope, q_rope], dim=-1)
    scores = torch.einsum("hd,hsd->hs", query, keys) * 0.3
    expected = torch.einsum("hs,hsv->hv", scores.softmax(-1), values)
    cache = torch.cat([c_kv, k_rope], dim=-1).reshape(length, 1, rank + rope)
    latent = paged_mla_attention_reference(
        torch.einsum("hd,hdr->hr", q_nope, w_uk)[None].float(),
        q_rope[None].float(),
        cache.float(),
        torch.arange(length, dtype=torch.int32)[None],
        torch.tensor([length], dtype=torch.int32),
        scale=0.3,
    )
    actual = torch.einsum("hr,hvr->hv", latent[0].double(), w_uv)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize(
    "context_lens,heads,rank,rope,block_size,split_size",
    [
        ([1, 5, 16, 37], 4, 32, 16, 4, 16),  # several splits, ragged contexts, dot path
        ([9, 3], 5, 24, 6, 2, 4),  # odd widths and heads, broadcast (no tl.dot) path
        ([33], 18, 16, 8, 8, 32),  # heads beyond one block of 16
    ],
)
def test_triton_matches_reference(context_lens, heads, rank, rope, block_size, split_size):
    max_blocks = -(-max(context_lens) // block_size) + 1
    args = _problem(
        context_lens,
        heads=heads,
        rank=rank,
        rope=rope,
        block_size=block_size,
        max_blocks=max_blocks,
        dtype=torch.float32,
    )
    expected = paged_mla_attention_reference(*args, scale=0.2)
    actual = paged_mla_attention_triton(*args, scale=0.2, split_size=split_size)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@needs_triton
def test_triton_bf16_matches_reference_and_a_token_ignores_its_batch():
    args = _problem(
        [6, 20], heads=4, rank=32, rope=16, block_size=4, max_blocks=6, dtype=torch.bfloat16
    )
    expected = paged_mla_attention_reference(*args, scale=0.2).float()
    together = paged_mla_attention_triton(*args, scale=0.2, split_size=8)
    torch.testing.assert_close(together.float(), expected, atol=2e-2, rtol=2e-2)
    alone = paged_mla_attention_triton(
        args[0][1:], args[1][1:], args[2], args[3][1:], args[4][1:], scale=0.2, split_size=8
    )
    assert torch.equal(alone, together[1:])


def test_shape_errors_name_the_argument():
    args = list(
        _problem([3], heads=2, rank=8, rope=4, block_size=2, max_blocks=2, dtype=torch.float32)
    )
    args[2] = args[2][..., :-1]
    with pytest.raises(KernelShapeError, match="latent_cache has shape"):
        paged_mla_attention(*args, scale=1.0)
