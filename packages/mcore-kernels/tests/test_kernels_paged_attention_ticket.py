"""Paged attention with the in-launch ticket merge of the splits, against the torch reference.

On CPU the Triton kernel runs in the interpreter (float32 inputs: its 16-bit products are not
usable there). The GPU tests run bf16 at the decode shape of Qwen2.5-0.5B.
"""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from test_kernels_paged_attention import _random_paged_problem

from mcore_kernels.errors import KernelValueError
from mcore_kernels.paged_attention import paged_attention_reference, paged_attention_triton

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")

# Contexts in one split, on split boundaries and over many splits (split 4, block 4).
LENS = [1, 4, 5, 8, 17, 30, 33]


@pytest.fixture(scope="module")
def problem():
    return _random_paged_problem(
        LENS,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        max_blocks=10,
        dtype=torch.float32,
    )


@needs_triton
def test_ticket_merge_matches_reference_and_the_merge_kernel(problem):
    expected = paged_attention_reference(*problem, scale=0.5)
    ticket = paged_attention_triton(*problem, scale=0.5, split_size=4, merge="ticket")
    kernel = paged_attention_triton(*problem, scale=0.5, split_size=4, merge="kernel")
    torch.testing.assert_close(ticket, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ticket, kernel, atol=1e-6, rtol=1e-6)


@needs_triton
def test_ticket_merge_gives_the_same_bits_for_any_table_width_batch_and_replay(problem):
    q, k_cache, v_cache, tables, lens = problem
    wide = paged_attention_triton(*problem, scale=0.5, split_size=4, merge="ticket")
    narrow = paged_attention_triton(
        q, k_cache, v_cache, tables[:, :9], lens, scale=0.5, split_size=4, merge="ticket"
    )
    assert torch.equal(wide, narrow)
    for t, length in enumerate(LENS):
        # Alone, with the table cut to its own blocks (one split: the kernel divides itself).
        alone = paged_attention_triton(
            q[t : t + 1],
            k_cache,
            v_cache,
            tables[t : t + 1, : -(-length // 4)],
            lens[t : t + 1],
            scale=0.5,
            split_size=4,
            merge="ticket",
        )
        assert torch.equal(alone[0], wide[t]), f"token {t}"
    # The tickets are left zeroed: a second launch merges again.
    again = paged_attention_triton(*problem, scale=0.5, split_size=4, merge="ticket")
    assert torch.equal(again, wide)


@needs_triton
def test_unknown_merge_raises_value_error(problem):
    with pytest.raises(KernelValueError, match="merge='tree'"):
        paged_attention_triton(*problem, scale=0.5, split_size=4, merge="tree")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split_size", [32, 64, 256])
def test_gpu_ticket_merge_matches_reference_in_bf16_at_the_decode_shape(split_size):
    lens = [1, 31, 32, 33, 160, 288, 1000, 4096]
    q, k_cache, v_cache, tables, lens_t = _random_paged_problem(
        lens,
        num_q_heads=14,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        max_blocks=300,
        dtype=torch.bfloat16,
    )
    args = (q, k_cache, v_cache, tables, lens_t)
    expected = paged_attention_reference(q.float(), k_cache, v_cache, tables, lens_t, scale=0.125)
    out = paged_attention_triton(*args, scale=0.125, split_size=split_size, merge="ticket")
    ulp = 2.0**-7 * float(expected.abs().max())
    torch.testing.assert_close(out.float(), expected, atol=ulp, rtol=0)
    narrow = paged_attention_triton(
        q, k_cache, v_cache, tables[:, :256], lens_t, scale=0.125, split_size=split_size,
        merge="ticket",
    )  # fmt: skip
    assert torch.equal(out, narrow)
