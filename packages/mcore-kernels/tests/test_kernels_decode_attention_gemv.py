"""attention_o_proj (decode attention fused into the o projection): the Triton kernel
(interpreted on CPU) against paged attention followed by the projection (torch references),
against the two Triton kernels it replaces, the argument checks, and on a GPU the same."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.decode_attention_gemv import (
    ATTENTION_O_PROJ_SPLIT,
    attention_o_proj,
    attention_o_proj_reference,
)
from mcore_kernels.decode_gemv import decode_gemv
from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.paged_attention import (
    merge_splits,
    paged_attention,
    paged_attention_partials,
    paged_attention_triton,
)

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")


def _problem(contexts, *, hq=6, hkv=2, d=16, n=24, block_size=4, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(dtype).to(device)

    tokens = len(contexts)
    width = -(-max(contexts) // block_size)
    blocks = tokens * width + 1
    # Each token's blocks scattered over the cache (block 0 unused, as the engine's scratch).
    table = (torch.randperm(blocks - 1, generator=generator)[: tokens * width] + 1).view(
        tokens, width
    )
    return {
        "q": rand(tokens, hq, d),
        "k_cache": rand(blocks, block_size, hkv, d),
        "v_cache": rand(blocks, block_size, hkv, d),
        "block_tables": table.to(torch.int32).to(device),
        "context_lens": torch.tensor(contexts, dtype=torch.int32, device=device),
        "weight": rand(n, hq * d, scale=(hq * d) ** -0.5),
        "bias": rand(n),
        "residual": rand(tokens, n),
        "scale": d**-0.5,
    }


def _call(fn, problem, **options):
    p = problem
    return fn(
        p["q"],
        p["k_cache"],
        p["v_cache"],
        p["block_tables"],
        p["context_lens"],
        p["weight"],
        p["bias"],
        scale=p["scale"],
        residual=p["residual"],
        **options,
    )


def _unfused(problem, split_size):
    """Paged attention (split kernel, merge kernel), then decode_gemv: three launches."""
    p = problem
    attended = paged_attention(
        p["q"],
        p["k_cache"],
        p["v_cache"],
        p["block_tables"],
        p["context_lens"],
        scale=p["scale"],
        split_size=split_size,
    )
    return decode_gemv(attended.flatten(1), p["weight"], p["bias"], residual=p["residual"])


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize(("contexts", "block_n"), [([1], 32), ([5, 13], 8)])
def test_attention_o_proj_matches_reference_interpreted(contexts, block_n):
    problem = _problem(contexts, dtype=torch.float32, device="cpu")
    expected = _call(attention_o_proj_reference, problem)
    # Splits of 8 positions: the contexts of 13 merge two.
    got = _call(attention_o_proj, problem, block_n=block_n, split_size=8)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The merge of the paged attention, inside the projection (float32: IEEE products).
    torch.testing.assert_close(got, _unfused(problem, 8), rtol=1e-6, atol=1e-6)


@needs_triton
@pytest.mark.interpreter
def test_attention_o_proj_bfloat16_interpreted_and_grid_independent():
    problem = _problem([9, 3], dtype=torch.bfloat16, device="cpu", seed=1)
    expected = _call(attention_o_proj_reference, problem).float()
    narrow = _call(attention_o_proj, problem, block_n=8, split_size=4)
    wide = _call(attention_o_proj, problem, block_n=32, split_size=4)
    # Each output column is one program's fixed-order sum: the grid does not change a bit.
    assert torch.equal(narrow, wide)
    # Nor does a table wider than the contexts (splits past a context are never read).
    wider = {**problem, "block_tables": torch.cat([problem["block_tables"]] * 2, dim=1)}
    assert torch.equal(_call(attention_o_proj, wider, block_n=8, split_size=4), narrow)
    torch.testing.assert_close(narrow.float(), expected, rtol=2e-2, atol=2e-2)


@needs_triton
@pytest.mark.interpreter
def test_partials_merged_equal_the_paged_attention_bitwise():
    # One split holds the context of 3, two that of 9: both go through the partials.
    p = _problem([3, 9], dtype=torch.bfloat16, device="cpu", seed=2)
    args = (p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"])
    partials = paged_attention_partials(*args, scale=p["scale"], split_size=8)
    assert partials[1].shape == (2, 6, 2)
    merged = torch.empty_like(p["q"])
    merge_splits(*partials, p["context_lens"], merged, split_size=8)
    assert torch.equal(merged, paged_attention_triton(*args, scale=p["scale"], split_size=8))


@needs_triton
@pytest.mark.interpreter
def test_default_split_over_engine_blocks_matches_reference_interpreted():
    # The engine's 16-position blocks and the default split size (32): a context of 600 spans
    # 19 splits, more than one merge chunk (16), one of 40 two.
    problem = _problem([600, 40], block_size=16, dtype=torch.float32, device="cpu", seed=3)
    expected = _call(attention_o_proj_reference, problem)
    got = _call(attention_o_proj, problem)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, _unfused(problem, ATTENTION_O_PROJ_SPLIT), rtol=1e-6, atol=1e-6)


def test_attention_o_proj_rejects_bad_arguments():
    problem = _problem([3], dtype=torch.float32, device="cpu")
    with pytest.raises(KernelShapeError, match="weight"):
        _call(attention_o_proj, {**problem, "weight": problem["weight"][:, :-1]})
    with pytest.raises(KernelShapeError, match="residual"):
        _call(attention_o_proj, {**problem, "residual": problem["residual"][:, :-1]})
    with pytest.raises(KernelDtypeError, match="weight"):
        _call(attention_o_proj, {**problem, "weight": problem["weight"].double()})


def test_attention_o_proj_torch_backend_is_the_reference(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    problem = _problem([6], dtype=torch.float32, device="cpu")
    assert torch.equal(_call(attention_o_proj, problem), _call(attention_o_proj_reference, problem))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("contexts", [[1], [160], [256, 17]])
def test_gpu_attention_o_proj_matches_unfused_kernels(contexts):
    # The Qwen2.5-0.5B attention shape: 14 query heads on 2 key/value heads of 64 channels.
    problem = _problem(
        contexts, hq=14, hkv=2, d=64, n=896, block_size=16, dtype=torch.bfloat16, device="cuda"
    )
    got = _call(attention_o_proj, problem)
    torch.testing.assert_close(got.float(), _unfused(problem, 32).float(), rtol=2e-2, atol=2e-2)
    expected = _call(attention_o_proj_reference, problem).float()
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    assert torch.equal(got, _call(attention_o_proj, problem, block_n=32))
