"""``decode_gemm`` (Triton, under the interpreter on CPU) against the torch reference of the
decode projection: plain, bias, RMSNorm prologue, SwiGLU and residual epilogues, split-K, tails
in every dimension; and, on a GPU, bfloat16 values."""

from __future__ import annotations

import os

import pytest
import torch

from mcore_kernels.decode_gemm import DecodeGemmConfig, decode_gemm, decode_gemm_config
from mcore_kernels.errors import KernelShapeError, KernelValueError
from mcore_kernels.reference import decode_gemv_reference, rotary_kv_write_reference
from mcore_kernels.rotary_kv_write import RotaryCacheWrite

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernel under TRITON_INTERPRET=1"
)


def _inputs(m, n, k, *, swiglu=False, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if swiglu else n
    x = torch.randn(m, k, generator=g)
    weight = torch.randn(rows, k, generator=g) / k**0.5
    bias = torch.randn(rows, generator=g)
    norm = 1 + 0.3 * torch.randn(k, generator=g)
    residual = torch.randn(m, n, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (x, weight, bias, norm, residual)]


CASES = [
    # (rows, out columns, K, swiglu, bias, norm, residual, config)
    (5, 24, 48, False, True, True, False, DecodeGemmConfig(block_m=16, block_n=16, block_k=16)),
    (19, 40, 64, True, False, True, False, DecodeGemmConfig(block_m=16, block_n=16, block_k=32)),
    (3, 16, 80, False, False, False, True, DecodeGemmConfig(block_m=16, block_n=16, block_k=16, split_k=3)),
    (17, 20, 96, True, True, True, True, DecodeGemmConfig(block_m=16, block_n=16, block_k=32, split_k=2)),
    (9, 32, 40, False, True, False, True, DecodeGemmConfig(block_m=16, block_n=32, block_k=16, split_k=2)),
]  # fmt: skip


@interpreted
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_matches_the_reference_in_float32(case):
    m, n, k, swiglu, has_bias, has_norm, has_residual, config = case
    x, weight, bias, norm, residual = _inputs(m, n, k, swiglu=swiglu)
    kwargs = {
        "norm_weight": norm if has_norm else None,
        "norm_eps": 1e-5,
        "swiglu": swiglu,
        "residual": residual if has_residual else None,
    }
    bias = bias if has_bias else None
    actual = decode_gemm(x, weight, bias, config=config, **kwargs)
    expected = decode_gemv_reference(x, weight, bias, **kwargs)
    assert actual.shape == (m, n)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@interpreted
def test_rows_do_not_change_each_others_values():
    x, weight, bias, norm, residual = _inputs(20, 16, 64, seed=3)
    config = DecodeGemmConfig(block_m=16, block_n=16, block_k=32, split_k=2)
    whole = decode_gemm(x, weight, bias, norm_weight=norm, residual=residual, config=config)
    part = decode_gemm(x[:7], weight, bias, norm_weight=norm, residual=residual[:7], config=config)
    torch.testing.assert_close(part, whole[:7], atol=0, rtol=0)


@interpreted
@pytest.mark.parametrize("split_k", [1, 2])
def test_rope_and_cache_write_match_projection_then_rotary_kv_write(split_k):
    # Three query heads on two key/value heads of 8 channels: head kinds meet inside tiles.
    hq, hkv, d, k, rows = 3, 2, 8, 48, 5
    x, weight, bias, norm, _ = _inputs(rows, (hq + 2 * hkv) * d, k, seed=7)
    g = torch.Generator().manual_seed(1)
    angles = torch.rand(rows, d // 2, generator=g) * 6.0
    cache = torch.randn(2, 4, 4, hkv, d, generator=g)
    slots = torch.randperm(16, generator=g)[:rows]
    expected_cache = cache.clone()
    qkv = decode_gemv_reference(x, weight, bias, norm_weight=norm)
    q, key, value = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    expected = rotary_kv_write_reference(
        q.unflatten(-1, (hq, d)), key.unflatten(-1, (hkv, d)), value.unflatten(-1, (hkv, d)),
        angles.cos(), angles.sin(), expected_cache[0], expected_cache[1], slots,
    ).flatten(-2)  # fmt: skip
    rope = RotaryCacheWrite(
        cos=angles.cos(), sin=angles.sin(), k_cache=cache[0], v_cache=cache[1],
        slot_mapping=slots, num_q_heads=hq,
    )  # fmt: skip
    config = DecodeGemmConfig(block_m=16, block_n=16, block_k=16, split_k=split_k)
    actual = decode_gemm(x, weight, bias, norm_weight=norm, rope=rope, config=config)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cache, expected_cache, atol=2e-5, rtol=2e-5)


def test_bad_arguments_raise():
    x, weight, _, _, residual = _inputs(4, 16, 32)
    with pytest.raises(KernelShapeError, match="residual"):
        decode_gemm(x, weight, residual=residual[:, :8])
    with pytest.raises(KernelShapeError, match="expected"):
        decode_gemm(x[:, :16], weight)
    with pytest.raises(KernelValueError, match="block_n"):
        DecodeGemmConfig(block_n=24)
    with pytest.raises(KernelValueError, match="split_k"):
        DecodeGemmConfig(split_k=0)
    with pytest.raises(KernelValueError, match="rows"):
        decode_gemm_config(0, 16, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [64, 200, 512])
@pytest.mark.parametrize(
    "shape", [(1152, 896, False), (4864, 896, True), (896, 4864, False)], ids=str
)
def test_bfloat16_on_gpu_matches_the_reference(rows, shape):
    n, k, swiglu = shape
    x, weight, bias, norm, residual = _inputs(
        rows, n, k, swiglu=swiglu, dtype=torch.bfloat16, device="cuda"
    )
    kwargs = {"norm_weight": norm if k == 896 else None, "swiglu": swiglu}
    if not swiglu and k != 896:
        kwargs["residual"] = residual
    actual = decode_gemm(x, weight, bias if not swiglu else None, **kwargs)
    expected = decode_gemv_reference(x, weight, bias if not swiglu else None, **kwargs)
    # Float32 sums in another order: at most a bfloat16 rounding step apart.
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=1.6e-2)
