"""The swap-AB few-row GEMM (interpreted on CPU) against torch.

float16 here: the interpreter (Triton 3.9) hands bfloat16 TMA-descriptor loads to ``tl.dot`` as
their raw 16-bit integers; the GPU path is the same code for both dtypes.
"""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel modules' import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.normed_swiglu import normed_swiglu_reference
from mcore_kernels.reference import rotary_kv_write_reference
from mcore_kernels.rotary_kv_write import RotaryCacheWrite
from mcore_kernels.skinny_gemm import SkinnyGemmConfig, skinny_gemm, skinny_gemm_reference

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("triton_backend")]


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


_SMALL = SkinnyGemmConfig(block_n=64, block_k=64, num_stages=2)


def _inputs(rows: int, outputs: int, inputs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inputs, generator=g).half()
    weight = (torch.randn(outputs, inputs, generator=g) / inputs**0.5).half()
    bias = torch.randn(outputs, generator=g).half()
    residual = torch.randn(rows, outputs, generator=g).half()
    return x, weight, bias, residual


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    # One rounding of the same float32 value up to the order of the float32 sums.
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(("rows", "outputs", "inputs"), [(64, 128, 192), (5, 96, 136), (3, 64, 64)])
def test_product_matches_torch(rows, outputs, inputs):
    x, weight, _, _ = _inputs(rows, outputs, inputs)
    _close(skinny_gemm(x, weight, config=_SMALL), skinny_gemm_reference(x, weight))
    expected = (x.float() @ weight.float().T).half()
    _close(skinny_gemm(x, weight, config=_SMALL), expected)


def test_bias_and_residual_round_once():
    x, weight, bias, residual = _inputs(20, 130, 128, seed=1)
    actual = skinny_gemm(x, weight, bias=bias, residual=residual, config=_SMALL)
    expected = (x.float() @ weight.float().T + bias.float() + residual.float()).half()
    _close(actual, expected)
    _close(actual, skinny_gemm_reference(x, weight, bias=bias, residual=residual))


def test_rows_past_one_tile():
    x, weight, _, _ = _inputs(150, 64, 64, seed=2)
    _close(skinny_gemm(x, weight, config=_SMALL), skinny_gemm_reference(x, weight))


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_split_partials_are_the_products_of_whole_k_blocks(splits):
    x, weight, _, _ = _inputs(9, 64, 320, seed=3)
    config = SkinnyGemmConfig(block_n=64, block_k=128, num_stages=2)
    partials = skinny_gemm(x, weight, splits=splits, config=config)
    assert partials.shape == (splits, 9, 64) and partials.dtype == torch.float32
    torch.testing.assert_close(partials.sum(0), x.float() @ weight.float().T, atol=1e-3, rtol=1e-3)
    expected = skinny_gemm_reference(x, weight, splits=splits, block_k=128)
    torch.testing.assert_close(partials, expected, atol=1e-3, rtol=1e-3)
    if splits == 5:
        # 3 blocks of 128 over 5 slices: the slices past the last block are zero.
        assert torch.equal(partials[3:], torch.zeros_like(partials[3:]))


def test_errors_name_the_argument():
    x, weight, bias, residual = _inputs(4, 64, 64)
    with pytest.raises(KernelShapeError, match=r"weight\.shape"):
        skinny_gemm(x, weight[:, :32])
    with pytest.raises(KernelDtypeError, match=r"weight\.dtype"):
        skinny_gemm(x, weight.float())
    with pytest.raises(KernelValueError, match="splits"):
        skinny_gemm(x, weight, splits=0)
    with pytest.raises(KernelValueError, match="splits"):
        skinny_gemm(x, weight, splits=2, bias=bias)
    with pytest.raises(KernelShapeError, match=r"bias\.shape"):
        skinny_gemm(x, weight, bias=bias[:3])
    with pytest.raises(KernelShapeError, match=r"residual\.shape"):
        skinny_gemm(x, weight, residual=residual[:2])
    with pytest.raises(KernelShapeError, match="multiple of 8"):
        skinny_gemm(x[:, :60], weight[:, :60])


@pytest.mark.parametrize("bias", [False, True])
def test_rope_epilogue_rotates_queries_and_keys_and_writes_the_cache(bias):
    tokens, q_heads, kv_heads, head_dim, inputs = 7, 4, 2, 64, 128
    x, weight, bias_values, _ = _inputs(tokens, (q_heads + 2 * kv_heads) * head_dim, inputs, 4)
    g = torch.Generator().manual_seed(5)
    angles = 6.0 * torch.rand(tokens, head_dim // 2, generator=g)
    slots = torch.tensor([3, 5, 0, 9, 15, 1, 2])

    def rope():
        cache = torch.zeros(4, 4, kv_heads, head_dim).half()
        return RotaryCacheWrite(
            cos=angles.cos(),
            sin=angles.sin(),
            k_cache=cache,
            v_cache=cache.clone(),
            slot_mapping=slots,
            num_q_heads=q_heads,
        )

    actual, expected = rope(), rope()
    b = bias_values if bias else None
    q = skinny_gemm(x, weight, bias=b, rope=actual, config=_SMALL)
    # The unfused path: the projection rounded, then the RoPE + cache-write kernel's reference.
    qkv = (x.float() @ weight.float().T + (b.float() if bias else 0.0)).half()
    parts = expected.split(qkv)
    reference_q = rotary_kv_write_reference(
        *parts, expected.cos, expected.sin, expected.k_cache, expected.v_cache, slots
    )
    _close(q, reference_q.flatten(1))
    _close(actual.k_cache, expected.k_cache)
    _close(actual.v_cache, expected.v_cache)
    assert actual.k_cache[3, 3].abs().sum() > 0 and actual.v_cache[0, 0].abs().sum() > 0


def test_rope_needs_whole_heads():
    x, weight, _, residual = _inputs(3, 6 * 64, 64)
    cache = torch.zeros(2, 4, 2, 64).half()
    rope = RotaryCacheWrite(
        cos=torch.ones(3, 32),
        sin=torch.zeros(3, 32),
        k_cache=cache,
        v_cache=cache,
        slot_mapping=torch.arange(3),
        num_q_heads=4,
    )
    with pytest.raises(KernelShapeError, match="heads"):
        skinny_gemm(x, weight[:-64], rope=rope)
    with pytest.raises(KernelValueError, match="residual"):
        skinny_gemm(x, weight, rope=rope, residual=residual)


@pytest.mark.parametrize(("rows", "ffn", "inputs"), [(5, 96, 192), (64, 64, 128)])
def test_swiglu_epilogue_is_normed_swiglu_of_the_rounded_product(rows, ffn, inputs):
    x, weight, _, _ = _inputs(rows, 2 * ffn, inputs, seed=6)
    x = (3.0 * x.float()).half()
    actual = skinny_gemm(x, weight, swiglu_norm_eps=1e-6, config=_SMALL)
    product = (x.float() @ weight.float().T).half()
    _close(actual, normed_swiglu_reference(product, x, 1e-6))
    with pytest.raises(KernelValueError, match="swiglu_norm_eps"):
        skinny_gemm(x, weight, swiglu_norm_eps=1e-6, splits=2)
    with pytest.raises(KernelShapeError, match="gate then up"):
        skinny_gemm(x, weight[:-1], swiglu_norm_eps=1e-6)
