"""Paged decode attention: every product mode of the split kernel against the torch reference.

Group sizes 1 (multi-head attention), 2, 4 and 8 at real head dimensions (64, 72, 128: 72 is
not a power of two, so the padded channels are masked), edge contexts (one position, block
and split boundaries, many splits), and the launch-configuration checks. On CPU the kernel runs
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
from mcore_kernels.paged_attention import paged_attention_reference, paged_attention_triton
from mcore_kernels.paged_attention_config import PagedDecodeConfig, paged_decode_config

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


def _modes(group):
    configs = [
        PagedDecodeConfig(mode="sum", tile=8),
        PagedDecodeConfig(mode="dot", tile=16),
        PagedDecodeConfig(mode="dot1", tile=16),
    ]
    if group == 1:
        configs += [
            PagedDecodeConfig(mode="heads", heads=1, tile=8),
            PagedDecodeConfig(mode="heads", heads=4, tile=16),
        ]
    return configs


@needs_triton
@pytest.mark.parametrize("group", [1, 4])
def test_every_mode_matches_reference_at_head_dim_72(group):
    # Three KV heads: with four heads per program the last head block is partly masked.
    args, expected, scale = _problem([3, 17, 40], group=group, num_kv_heads=3, head_dim=72)
    for config in _modes(group):
        out = paged_attention_triton(*args, scale=scale, split_size=16, config=config)
        _assert_close_bf16(out, expected)


@needs_triton
def test_many_splits_and_float32_inputs_match_reference_closely():
    # 6 splits of 8 positions (tiles of 8 and 16 straddle blocks of 4); float32 products.
    args, expected, scale = _problem(
        [1, 8, 9, 47], group=2, num_kv_heads=2, head_dim=24, dtype=torch.float32
    )
    for config in (*_modes(2), PagedDecodeConfig(mode="dot", tile=64)):
        out = paged_attention_triton(*args, scale=scale, split_size=8, config=config)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_triton
def test_split_probabilities_are_more_accurate_than_one_rounding():
    # The value product of mode "dot" keeps a second bf16 part of each probability: its error
    # is below that of a single rounding (flash-attention style, mode "dot1").
    args, expected, scale = _problem(
        [64, 64], group=4, num_kv_heads=1, head_dim=64, dtype=torch.float32
    )
    q, k_cache, v_cache, tables, lens = args
    bf16 = (q.bfloat16().float(), k_cache.bfloat16(), v_cache.bfloat16(), tables, lens)
    expected = paged_attention_reference(*bf16, scale=scale)
    errors = {}
    for mode in ("dot", "dot1"):
        config = PagedDecodeConfig(mode=mode, tile=16)
        # float32 queries over a bf16 cache take the IEEE float32 products: exact operands,
        # so the only difference between the modes is how the probabilities are rounded.
        out = paged_attention_triton(*bf16, scale=scale, split_size=16, config=config)
        errors[mode] = float((out - expected).abs().max())
    assert errors["dot"] < errors["dot1"] / 4


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


def test_default_config_per_shape():
    assert paged_decode_config(1, 72, 16, torch.bfloat16).mode == "heads"
    assert paged_decode_config(1, 128, 9, torch.bfloat16).heads == 1
    assert paged_decode_config(8, 64, 2, torch.bfloat16).mode == "dot"
    assert paged_decode_config(8, 64, 2, torch.float32).mode == "sum"


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"mode": "fast"}, "mode='fast'"),
        ({"mode": "sum", "heads": 2}, "heads=2 needs mode='heads'"),
        ({"mode": "dot", "tile": 8}, "tile=8; mode 'dot' needs at least 16"),
        ({"mode": "heads", "tile": 24}, "tile=24; expected a power of two"),
        ({"mode": "sum", "num_stages": 0}, "num_stages=0"),
    ],
)
def test_invalid_config_raises_shape_error(fields, match):
    with pytest.raises(KernelShapeError, match=match):
        PagedDecodeConfig(**fields)


@needs_triton
def test_heads_mode_with_grouped_queries_raises_shape_error():
    args, _, scale = _problem([4], group=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(KernelShapeError, match="mode 'heads' needs one query head per KV head"):
        paged_attention_triton(
            *args, scale=scale, split_size=16, config=PagedDecodeConfig(mode="heads")
        )
