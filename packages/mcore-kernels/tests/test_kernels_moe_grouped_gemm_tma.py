"""Grouped SwiGLU expert MLP on TMA grouped GEMMs (Triton, through the interpreter) against its
torch reference: values and gradients of rows, weights and row weights, an expert without
rows, a group longer than a row tile, bitwise-equal repeated backward passes, bad input."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.errors import KernelDeviceError, KernelShapeError
from mcore_kernels.moe import grouped_gemm_tma as tma_module
from mcore_kernels.moe import grouped_swiglu_mlp_tma
from mcore_kernels.moe.grouped_gemm import GroupedTiles, grouped_swiglu_mlp_reference
from mcore_kernels.moe.reference import weighted_swiglu_reference

pytestmark = pytest.mark.interpreter

EXPERTS, HIDDEN, FFN = 4, 48, 40
COUNTS = torch.tensor([7, 0, 37, 3])
"""Expert 1 gets no row; expert 2 more rows than a 16-row tile (a partial last tile)."""
SMALL = GroupedTiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Small tiles: several row and column tiles per expert and reduction steps per tile.
    for name in ("ROW_TILES", "SWIGLU_TILES", "WEIGHT_GRAD_TILES"):
        monkeypatch.setattr(tma_module, name, SMALL)


def _inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = int(COUNTS.sum())
    return [
        torch.randn(rows, HIDDEN, generator=g),
        torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=g) * 0.2,
        torch.randn(EXPERTS, HIDDEN, FFN, generator=g) * 0.2,
        torch.rand(rows, generator=g),
    ]


def _reference(x, gate_up, down, row_weights):
    """Torch loop over experts with the row weights on the activations."""
    outputs, start = [], 0
    for expert, size in enumerate(COUNTS.tolist()):
        rows = slice(start, start + size)
        pre = x[rows] @ gate_up[expert].T
        act = weighted_swiglu_reference(pre, row_weights[rows])
        outputs.append(act @ down[expert].T)
        start += size
    return torch.cat(outputs)


def _run(fn, inputs, grad):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [leaf.grad for leaf in leaves]


def test_values_and_gradients_match_reference_with_an_empty_expert():
    inputs = _inputs(0)
    grad = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1))
    got = _run(lambda x, gu, d, w: grouped_swiglu_mlp_tma(x, gu, d, COUNTS, w), inputs, grad)
    want = _run(_reference, inputs, grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # The expert without rows gets zero weight gradients.
    assert torch.equal(got[2][1], torch.zeros_like(got[2][1]))
    assert torch.equal(got[3][1], torch.zeros_like(got[3][1]))


def test_without_row_weights_matches_the_unweighted_reference():
    x, gate_up, down, _ = _inputs(2)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    got = _run(lambda x, gu, d: grouped_swiglu_mlp_tma(x, gu, d, COUNTS), [x, gate_up, down], grad)
    want = _run(
        lambda x, gu, d: grouped_swiglu_mlp_reference(x, gu, d, COUNTS), [x, gate_up, down], grad
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_repeated_backward_is_bitwise_equal():
    inputs = _inputs(4)
    grad = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(5))

    def fn(x, gu, d, w):
        return grouped_swiglu_mlp_tma(x, gu, d, COUNTS, w)

    first, second = _run(fn, inputs, grad), _run(fn, inputs, grad)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_bad_input_raises_typed_errors():
    x, gate_up, down, weights = _inputs(6)
    with pytest.raises(KernelShapeError, match="expected \\[M, H\\]"):
        grouped_swiglu_mlp_tma(x, gate_up, down, COUNTS, weights[:-1])
    with pytest.raises(KernelShapeError, match="must be \\[rows, H\\]"):
        grouped_swiglu_mlp_tma(x[0], gate_up, down, COUNTS)
    with pytest.raises(KernelShapeError, match="16-byte aligned"):
        grouped_swiglu_mlp_tma(x[:, :3], gate_up[..., :3], down[:, :3], COUNTS)
    with pytest.raises(KernelDeviceError, match="expected one device"):
        grouped_swiglu_mlp_tma(x, gate_up, down, COUNTS.to("meta"))
