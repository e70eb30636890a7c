"""Paged decode attention on a CUDA GPU, bf16, every group size and head dimension.

The default configuration of each shape (and every other mode) against the float32 torch
reference: at most one bf16 rounding step off, and nearly every output equal to the reference
rounded to bf16 (the tensor-core products must not lose accuracy against IEEE float32).
"""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.paged_attention import (
    PagedDecodeConfig,
    paged_attention_reference,
    paged_attention_triton,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _problem(lens, group, num_kv_heads, head_dim, block_size=16, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 1
    tables = torch.randperm(num_blocks, device="cuda", generator=generator)
    tables = tables[: len(lens) * max_blocks].reshape(len(lens), max_blocks).to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", generator=generator).bfloat16()
    v_cache = torch.randn(shape, device="cuda", generator=generator).bfloat16()
    q = torch.randn(
        (len(lens), group * num_kv_heads, head_dim), device="cuda", generator=generator
    ).bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, tables, lens_t


def _check(out, q, k_cache, v_cache, tables, lens, scale):
    expected = paged_attention_reference(q.float(), k_cache, v_cache, tables, lens, scale=scale)
    assert out.dtype == torch.bfloat16
    ulp = 2.0**-7 * float(expected.abs().max())
    torch.testing.assert_close(out.float(), expected, atol=ulp, rtol=0)
    differing = float((out != expected.bfloat16()).float().mean())
    assert differing < 0.02, f"{differing:.2%} of outputs differ from the rounded reference"


@pytest.mark.parametrize("group", [1, 2, 4, 7, 8, 16])
@pytest.mark.parametrize("head_dim", [64, 72, 80, 96, 128])
def test_default_config_matches_reference_in_bf16(group, head_dim):
    # One position, block and split boundaries, many splits (up to 4k positions).
    lens = [1, 16, 17, 255, 256, 257, 1000, 4096]
    args = _problem(lens, group, max(1, 16 // group), head_dim)
    scale = head_dim**-0.5
    _check(paged_attention_triton(*args, scale=scale), *args, scale)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_every_mode_matches_reference_in_bf16(group):
    args = _problem([5, 300, 2000], group, 3, 72)
    modes = [PagedDecodeConfig(mode="sum", tile=16), PagedDecodeConfig(mode="dot", tile=32)]
    for config in modes:
        out = paged_attention_triton(*args, scale=0.1, config=config)
        _check(out, *args, 0.1)


@pytest.mark.parametrize("group", [1, 4, 7])
def test_prefill_token_groups_equal_one_token_programs_bit_for_bit(group):
    # Chunked prefill: 3 sequences x 200 tokens (positions 300..499), then 40 decode rows of
    # other sequences; grouped launches share keys and values between a sequence's tokens.
    block_size, seqs, chunk = 16, 3, 200
    generator = torch.Generator(device="cuda").manual_seed(1)
    max_blocks = 32
    num_blocks = (seqs + 40) * max_blocks + 1
    order = torch.randperm(num_blocks, device="cuda", generator=generator)[: (seqs + 40) * 32]
    seq_tables = order.reshape(seqs + 40, max_blocks).to(torch.int32)
    rows = torch.cat([torch.arange(seqs).repeat_interleave(chunk), seqs + torch.arange(40)])
    tables = seq_tables[rows.cuda()]
    lens = torch.cat([torch.arange(301, 301 + chunk).repeat(seqs), 450 + torch.arange(40)])
    shape = (num_blocks, block_size, 2, 64)
    k_cache = torch.randn(shape, device="cuda", generator=generator).bfloat16()
    v_cache = torch.randn(shape, device="cuda", generator=generator).bfloat16()
    q = torch.randn((len(rows), 2 * group, 64), device="cuda", generator=generator).bfloat16()
    args = (q, k_cache, v_cache, tables, lens.to(torch.int32).cuda())
    grouped = paged_attention_triton(*args, scale=0.125, config=PagedDecodeConfig(prefill_tokens=1))
    alone = paged_attention_triton(
        *args, scale=0.125, config=PagedDecodeConfig(prefill_tokens=10**9)
    )
    _check(grouped, *args, 0.125)
    assert torch.equal(grouped, alone)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("head_dim", [64, 72, 128])
def test_warps_and_register_caps_never_change_a_bit(group, head_dim):
    # The default runs large decode launches with 2 warps and at most 128 registers per
    # thread, small ones with 4 warps. A token's output must not depend on that choice, so
    # the batch (which moves a launch across the threshold) never changes a result.
    lens = [1, 16, 17, 255, 256, 257, 1000, 4096]
    args = _problem(lens, group, 4, head_dim)
    scale = head_dim**-0.5
    base = paged_attention_triton(*args, scale=scale, config=PagedDecodeConfig(num_warps=4))
    _check(base, *args, scale)
    for config in (
        PagedDecodeConfig(num_warps=2),
        PagedDecodeConfig(num_warps=2, max_registers=128),
        PagedDecodeConfig(num_warps=4, max_registers=80),
    ):
        out = paged_attention_triton(*args, scale=scale, config=config)
        assert torch.equal(out, base), config
    q, k_cache, v_cache, tables, lens_t = args
    for batch in (1, 3, 8):
        rows = slice(0, batch)
        default = paged_attention_triton(
            q[rows], k_cache, v_cache, tables[rows], lens_t[rows], scale=scale
        )
        assert torch.equal(default, base[rows])
