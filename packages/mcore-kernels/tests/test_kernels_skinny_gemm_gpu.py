"""The swap-AB few-row GEMM on a Hopper GPU in bfloat16 at the Qwen2.5-0.5B decode shapes
(64 rows): each epilogue against torch, PDL launches bitwise equal to plain ones."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.normed_swiglu import normed_swiglu_reference
from mcore_kernels.pdl import programmatic_dependent_launch
from mcore_kernels.reference import rotary_kv_write_reference
from mcore_kernels.rotary_kv_write import RotaryCacheWrite
from mcore_kernels.skinny_gemm import SkinnyGemmConfig, skinny_gemm

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a Hopper (or newer) GPU", allow_module_level=True)

ROWS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 64, 896, 4864, 14, 2, 64
CONFIG = SkinnyGemmConfig(block_n=64, block_k=128, num_stages=4, prefetch=True)


def _tensor(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, device="cuda")).to(torch.bfloat16)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # One bf16 rounding of float32 sums taken in another order: within two bf16 ulps.
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("pdl", [False, True])
def test_projections_match_torch_and_pdl_changes_no_bit(pdl):
    torch.manual_seed(0)
    x = _tensor(ROWS, HIDDEN)
    weight = _tensor(HIDDEN, HIDDEN, scale=HIDDEN**-0.5)
    bias, residual = _tensor(HIDDEN), _tensor(ROWS, HIDDEN)
    with programmatic_dependent_launch(pdl):
        out = skinny_gemm(x, weight, bias=bias, residual=residual, config=CONFIG)
        partials = skinny_gemm(_tensor(ROWS, FFN), _tensor(HIDDEN, FFN), splits=4, config=CONFIG)
    expected = (x.float() @ weight.float().T + bias.float() + residual.float()).bfloat16()
    _close(out, expected)
    assert partials.shape == (4, ROWS, HIDDEN) and partials.dtype == torch.float32
    with programmatic_dependent_launch(not pdl):
        again = skinny_gemm(x, weight, bias=bias, residual=residual, config=CONFIG)
    assert torch.equal(out, again)


def test_rope_and_swiglu_epilogues_match_torch():
    torch.manual_seed(1)
    x = _tensor(ROWS, HIDDEN, scale=3.0)
    qkv_weight = _tensor((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, scale=HIDDEN**-0.5)
    bias = _tensor(qkv_weight.shape[0])
    angles = 6.0 * torch.rand(ROWS, HEAD_DIM // 2, device="cuda")
    slots = torch.randperm(8 * 16, device="cuda")[:ROWS]

    def rope() -> RotaryCacheWrite:
        cache = torch.zeros(8, 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        return RotaryCacheWrite(
            cos=angles.cos(),
            sin=angles.sin(),
            k_cache=cache,
            v_cache=cache.clone(),
            slot_mapping=slots,
            num_q_heads=HEADS,
        )

    actual, expected = rope(), rope()
    with programmatic_dependent_launch(True):
        q = skinny_gemm(x, qkv_weight, bias=bias, rope=actual, config=CONFIG)
    qkv = (x.float() @ qkv_weight.float().T + bias.float()).bfloat16()
    reference_q = rotary_kv_write_reference(
        *expected.split(qkv), expected.cos, expected.sin, expected.k_cache, expected.v_cache, slots
    )
    _close(q, reference_q.flatten(1))
    _close(actual.k_cache, expected.k_cache)
    _close(actual.v_cache, expected.v_cache)

    gate_up = _tensor(2 * FFN, HIDDEN, scale=HIDDEN**-0.5)
    activation = skinny_gemm(x, gate_up, swiglu_norm_eps=1e-6, config=CONFIG)
    product = (x.float() @ gate_up.float().T).bfloat16()
    _close(activation, normed_swiglu_reference(product, x, 1e-6))
