"""Paged decode attention: every product mode of the split kernel against the torch reference.

Group sizes 1 (multi-head attention), 2, 4 and 8 at real head dimensions (64, 72, 128: 72 is
not a power of two, so the padded channels are masked), edge contexts (one position, block
and split boundaries, many splits), chunked-prefill token groups against one-token programs,
the accuracy of the split-probability value product, and the launch-configuration checks. On CPU the kernel runs
under the Triton interpreter (whose 16-bit casts truncate: bf16 results may differ from the
rounded reference by one ulp).
"""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelShapeError
from mcore_kernels.paged_attention import (
    AUTO_SPLIT_MAX,
    DEFAULT_SPLIT_SIZE,
    WIDE_LAUNCH_PROGRAMS_PER_SM,
    PagedDecodeConfig,
    auto_split_size,
    paged_attention_reference,
    paged_attention_triton,
    paged_decode_config,
)

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")


def _problem(lens, *, group, num_kv_heads, head_dim, block_size=4, dtype=torch.bfloat16, seed=0):
    """Each token's context on shuffled physical blocks; float32 reference output too."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 1
    tables = torch.randperm(num_blocks, generator=generator)[: len(lens) * max_blocks]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    q = torch.randn((len(lens), group * num_kv_heads, head_dim), generator=generator).to(dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = (
        q.to(device),
        k_cache.to(device),
        v_cache.to(device),
        tables.reshape(len(lens), max_blocks).to(torch.int32).to(device),
        torch.tensor(lens, dtype=torch.int32, device=device),
    )
    scale = head_dim**-0.5
    expected = paged_attention_reference(args[0].float(), *args[1:], scale=scale)
    return args, expected, scale


def _assert_close_bf16(actual, expected):
    # One bf16 ulp of the largest output (the interpreter truncates instead of rounding).
    assert actual.dtype == torch.bfloat16
    atol = 2.0**-7 * float(expected.abs().max())
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=0)


@needs_triton
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 72, 128])
def test_default_config_matches_reference(group, head_dim):
    # Contexts: one position, a block boundary, past the first split of 16 positions.
    args, expected, scale = _problem([1, 4, 21], group=group, num_kv_heads=2, head_dim=head_dim)
    out = paged_attention_triton(*args, scale=scale, split_size=16)
    _assert_close_bf16(out, expected)


_MODES = (PagedDecodeConfig(mode="sum", tile=8), PagedDecodeConfig(mode="dot", tile=16))


@needs_triton
@pytest.mark.parametrize("group", [1, 4])
def test_every_mode_matches_reference_at_head_dim_72(group):
    args, expected, scale = _problem([3, 17, 40], group=group, num_kv_heads=3, head_dim=72)
    for config in _MODES:
        out = paged_attention_triton(*args, scale=scale, split_size=16, config=config)
        _assert_close_bf16(out, expected)


def _prefill_problem(chunks, *, group, head_dim, block_size=4, dtype=torch.float32):
    """Chunked-prefill rows: ``chunks`` is a list of (sequence, first position, tokens)."""
    generator = torch.Generator().manual_seed(3)
    num_seqs = 1 + max(seq for seq, _, _ in chunks)
    longest = max(start + count for _, start, count in chunks)
    max_blocks = -(-longest // block_size)
    num_blocks = num_seqs * max_blocks + 1
    seq_tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * max_blocks]
    seq_tables = seq_tables.reshape(num_seqs, max_blocks).to(torch.int32)
    rows, lens = [], []
    for seq, start, count in chunks:
        rows += [seq] * count
        lens += list(range(start + 1, start + count + 1))
    shape = (num_blocks, block_size, 2, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    q = torch.randn((len(rows), 2 * group, head_dim), generator=generator).to(dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tables = seq_tables[torch.tensor(rows)]
    return tuple(
        t.to(device) for t in (q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32))
    )


@needs_triton
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_token_groups_match_one_token_programs(group):
    # Two sequences' chunks back to back (a program straddles them: its tokens' tables differ
    # and each takes its own pass), a decode row of a third, contexts across 3 splits of 16.
    # Bitwise equality is a GPU test: the interpreter's numpy matrix products round a row
    # differently depending on its position in the tile.
    args = _prefill_problem([(0, 0, 21), (1, 9, 14), (2, 40, 1)], group=group, head_dim=24)
    scale = 24**-0.5
    grouped = PagedDecodeConfig(mode="dot", tile=16, prefill_tokens=1)
    alone = PagedDecodeConfig(mode="dot", tile=16, prefill_tokens=10**6)
    out = paged_attention_triton(*args, scale=scale, split_size=16, config=grouped)
    single = paged_attention_triton(*args, scale=scale, split_size=16, config=alone)
    torch.testing.assert_close(out, single, atol=1e-6, rtol=1e-6)
    expected = paged_attention_reference(*args, scale=scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_triton
def test_many_splits_and_float32_inputs_match_reference_closely():
    # 6 splits of 8 positions (tiles of 8 and 16 straddle blocks of 4); float32 products.
    args, expected, scale = _problem(
        [1, 8, 9, 47], group=2, num_kv_heads=2, head_dim=24, dtype=torch.float32
    )
    for config in (*_MODES, PagedDecodeConfig(mode="dot", tile=64)):
        out = paged_attention_triton(*args, scale=scale, split_size=8, config=config)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_triton
def test_split_probabilities_are_more_accurate_than_one_rounding():
    # The value product keeps a second bf16 part of each probability: its error is far below
    # that of rounding the probabilities once to bf16 (flash attention's value product).
    args, _, scale = _problem([64, 64], group=4, num_kv_heads=1, head_dim=64, dtype=torch.float32)
    q, k_cache, v_cache, tables, lens = args
    # float32 queries over a bf16 cache take the IEEE float32 products: exact operands, so the
    # kernel's only rounding is that of the probabilities.
    bf16 = (q.bfloat16().float(), k_cache.bfloat16(), v_cache.bfloat16(), tables, lens)
    expected = paged_attention_reference(*bf16, scale=scale)
    out = paged_attention_triton(*bf16, scale=scale, split_size=16, config=PagedDecodeConfig())
    error = float((out - expected).abs().max())
    # One rounding of the probabilities: the reference with probabilities rounded to bf16.
    keys = k_cache[tables.long()].reshape(2, -1, 1, 64).float()
    values = v_cache[tables.long()].reshape(2, -1, 1, 64).float()
    scores = torch.einsum("thd,tlgd->thl", bf16[0], keys) * scale
    rounded = scores.softmax(-1).bfloat16().float()
    once = torch.einsum("thl,tlgd->thd", rounded, values)
    assert error < float((once - expected).abs().max()) / 8


@needs_triton
@pytest.mark.parametrize("group", [1, 8])
def test_token_output_is_independent_of_the_batch(group):
    args, _, scale = _problem([5, 13, 33], group=group, num_kv_heads=4, head_dim=72)
    q, k_cache, v_cache, tables, lens = args
    full = paged_attention_triton(*args, scale=scale, split_size=16)
    for t in range(3):
        rows = slice(t, t + 1)
        alone = paged_attention_triton(
            q[rows], k_cache, v_cache, tables[rows], lens[rows], scale=scale, split_size=16
        )
        assert torch.equal(alone[0], full[t])


def test_default_config_is_tensor_core_tiles_of_64():
    config = paged_decode_config(1, 72, 16, torch.bfloat16)
    assert (config.mode, config.tile, config.num_warps, config.max_registers) == ("dot", 64, 4, 0)
    # Wide decode launches: 2 warps with at most 128 registers per thread.
    wide = paged_decode_config(7, 64, 2, torch.bfloat16, WIDE_LAUNCH_PROGRAMS_PER_SM)
    assert (wide.tile, wide.num_warps, wide.max_registers) == (64, 2, 128)


@needs_triton
def test_wide_launch_gives_the_tokens_of_a_narrow_one():
    # 12 tokens x 2 KV heads x 3 splits = 72 programs: 18 per interpreter "multiprocessor",
    # a wide launch (2 warps); one token alone is narrow (4 warps). Same values either way.
    args, expected, scale = _problem(
        [40] * 12, group=7, num_kv_heads=2, head_dim=24, dtype=torch.float32
    )
    q, k_cache, v_cache, tables, lens = args
    wide = paged_attention_triton(*args, scale=scale, split_size=16)
    torch.testing.assert_close(wide, expected, atol=1e-5, rtol=1e-5)
    alone = paged_attention_triton(
        q[:1], k_cache, v_cache, tables[:1], lens[:1], scale=scale, split_size=16
    )
    torch.testing.assert_close(alone[0], wide[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"mode": "fast"}, "mode='fast'"),
        ({"tile": 24}, "tile=24; expected a power of two"),
        ({"num_warps": 3}, "num_warps=3; expected a power of two"),
        ({"num_stages": 0}, "num_stages=0"),
        ({"prefill_tokens": 0}, "prefill_tokens=0"),
        ({"max_registers": 300}, "max_registers=300"),
    ],
)
def test_invalid_config_raises_shape_error(fields, match):
    with pytest.raises(KernelShapeError, match=match):
        PagedDecodeConfig(**fields)


def test_auto_split_grows_while_the_launch_keeps_its_parallelism():
    cpu = torch.device("cpu")
    # On the CPU (the interpreter) a device counts 4 multiprocessors: at least 12 programs.
    # One token, 1 KV head, 2048 positions: 8 splits of 256 make only 8 programs, so the
    # default stays.
    assert auto_split_size(1, 1, 2048, 16, cpu) == DEFAULT_SPLIT_SIZE
    # One token, 2 KV heads, 4096 positions: 512-position splits still give 16 programs,
    # 1024-position splits only 8.
    assert auto_split_size(1, 2, 4096, 16, cpu) == 2 * DEFAULT_SPLIT_SIZE
    # Eight tokens: 1024-position splits still give 64 programs; never past the cap.
    assert auto_split_size(8, 2, 4096, 16, cpu) == AUTO_SPLIT_MAX
    assert auto_split_size(8, 2, 1 << 20, 16, cpu) == AUTO_SPLIT_MAX
    # A block size that does not divide the default rounds the start up to a multiple.
    assert auto_split_size(1, 2, 96, 48, cpu) % 48 == 0


@needs_triton
def test_split_size_none_is_the_auto_split():
    args, expected, scale = _problem([3, 40, 70], group=7, num_kv_heads=2, head_dim=24)
    q, k_cache, _, tables, _ = args
    chosen = auto_split_size(3, 2, tables.shape[1] * k_cache.shape[1], 4, q.device)
    auto = paged_attention_triton(*args, scale=scale, split_size=None)
    explicit = paged_attention_triton(*args, scale=scale, split_size=chosen)
    assert torch.equal(auto, explicit)
    torch.testing.assert_close(auto.float(), expected, atol=2e-2, rtol=2e-2)
