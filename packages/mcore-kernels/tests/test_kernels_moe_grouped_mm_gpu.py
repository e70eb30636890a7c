"""Persistent grouped GEMMs on the GPU in bfloat16: each product against ``torch._grouped_mm``
at a fine-grained MoE shape with experts that get no rows, the fused routed experts with every
GEMM on these kernels against the same operation on ``torch._grouped_mm`` (values and
gradients), and two runs bitwise equal."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mcore_kernels.moe.expert_gemms import CUBLAS_LOOP, ExpertGemms
from mcore_kernels.moe.grouped_mm import (
    PersistentTiles,
    k_grouped_mm,
    m_grouped_mm,
)
from mcore_kernels.moe.routed import routed_experts

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a Hopper (or newer) GPU", allow_module_level=True)

ROWS_TILES = PersistentTiles(block_m=128, block_n=256, block_k=64, num_stages=4, flatten=True)
WEIGHT_TILES = PersistentTiles(block_m=64, block_n=128, block_k=256, num_stages=3)
EXPERTS, HIDDEN, FFN = 16, 512, 256


def _counts() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 400, (EXPERTS,), generator=g)
    counts[[0, 7, EXPERTS - 1]] = 0
    return counts


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.float().abs().max().clamp(min=1e-6)
    assert ((got.float() - want.float()).abs().max() / scale).item() < 2e-2


def test_products_match_grouped_mm():
    offsets = _counts().cumsum(0).to(torch.int32).cuda()
    rows = int(offsets[-1])
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, HIDDEN, **bf16)
    w_gu = torch.randn(EXPERTS, 2 * FFN, HIDDEN, **bf16) * 0.05
    grad_gu = torch.randn(rows, 2 * FFN, **bf16)
    want = torch._grouped_mm(x, w_gu.transpose(-2, -1), offs=offsets)
    _close(m_grouped_mm(x, w_gu, offsets, transpose_weight=True, tiles=ROWS_TILES), want)
    want = torch._grouped_mm(grad_gu, w_gu, offs=offsets)
    _close(m_grouped_mm(grad_gu, w_gu, offsets, transpose_weight=False, tiles=ROWS_TILES), want)
    want = torch._grouped_mm(grad_gu.t(), x, offs=offsets)
    got = k_grouped_mm(grad_gu, x, offsets, tiles=WEIGHT_TILES)
    _close(got, want)
    assert torch.count_nonzero(got[[0, 7, EXPERTS - 1]]) == 0


def _routed(gemms: ExpertGemms | None):
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens, top_k = 512, 4
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, HIDDEN, generator=g, **bf16)
    logits = torch.randn(tokens, EXPERTS, generator=g, device="cuda")
    logits[:, [0, 7]] = -1e9
    chosen = logits.topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g, **bf16)
    w_gu = torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=g, **bf16) * 0.05
    w_d = torch.randn(EXPERTS, HIDDEN, FFN, generator=g, **bf16) * 0.05
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device="cuda"))
    offsets = torch.bincount(flat, minlength=EXPERTS).cumsum(0).to(torch.int32)
    leaves = [t.requires_grad_(True) for t in (x, weights, w_gu, w_d)]
    out = routed_experts(*leaves, order, inverse, offsets, gemms=gemms)
    out.backward(torch.randn(out.shape, generator=g, **bf16))
    return [out.detach()] + [leaf.grad for leaf in leaves]


ALL_TRITON = ExpertGemms(
    gate_up=ROWS_TILES,
    down=ROWS_TILES,
    d_act=ROWS_TILES,
    d_x=ROWS_TILES,
    w_down=WEIGHT_TILES,
    w_gate_up=WEIGHT_TILES,
)


LOOPS = ExpertGemms(
    gate_up=CUBLAS_LOOP,
    down=ROWS_TILES,
    d_act=CUBLAS_LOOP,
    w_down=CUBLAS_LOOP,
    w_gate_up=CUBLAS_LOOP,
)


EXPERT_COLUMNS = ExpertGemms(
    gate_up=replace(ROWS_TILES, expert_columns=True),
    down=replace(ROWS_TILES, expert_columns=True),
    d_act=replace(ROWS_TILES, expert_columns=True),
    d_x=replace(ROWS_TILES, expert_columns=True),
    w_down=WEIGHT_TILES,
    w_gate_up=WEIGHT_TILES,
)


@pytest.mark.parametrize(
    "plan",
    [ALL_TRITON, EXPERT_COLUMNS, LOOPS],
    ids=["triton", "triton-expert-columns", "cublas-loops"],
)
def test_routed_experts_on_other_gemms_match_grouped_mm_and_repeat_bitwise(plan):
    want = _routed(None)
    first = _routed(plan)
    second = _routed(plan)
    for a, b, c in zip(first, second, want, strict=True):
        assert torch.equal(a, b)
        _close(a, c)


def test_aligned_weight_gradients_match_grouped_mm_and_repeat_bitwise():
    # Rows padded per expert to the 64-row chunk (empty experts first, in the middle and
    # last): the unmasked aligned kernel against torch._grouped_mm, two runs bitwise equal.
    counts = (_counts() + 63) // 64 * 64
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    rows = int(offsets[-1])
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, HIDDEN, **bf16)
    grad_gu = torch.randn(rows, 2 * FFN, **bf16)
    want = torch._grouped_mm(grad_gu.t(), x, offs=offsets)
    got = k_grouped_mm(grad_gu, x, offsets, tiles=WEIGHT_TILES, aligned=True)
    _close(got, want)
    assert torch.equal(got, k_grouped_mm(grad_gu, x, offsets, tiles=WEIGHT_TILES, aligned=True))
    assert torch.count_nonzero(got[[0, 7, EXPERTS - 1]]) == 0


def test_expert_column_order_equals_the_plain_kernel_bitwise():
    # The expert-column job order changes when a tile is computed, not its sums: bitwise the
    # plain kernel's products (experts without rows, several row tiles), and run to run.
    offsets = _counts().cumsum(0).to(torch.int32).cuda()
    rows = int(offsets[-1])
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, HIDDEN, **bf16)
    w_gu = torch.randn(EXPERTS, 2 * FFN, HIDDEN, **bf16) * 0.05
    grad_gu = torch.randn(rows, 2 * FFN, **bf16)
    tiles = replace(ROWS_TILES, expert_columns=True)
    for a, transpose in ((x, True), (grad_gu, False)):
        want = m_grouped_mm(a, w_gu, offsets, transpose_weight=transpose, tiles=ROWS_TILES)
        got = m_grouped_mm(a, w_gu, offsets, transpose_weight=transpose, tiles=tiles)
        assert torch.equal(got, want)
        assert torch.equal(
            got, m_grouped_mm(a, w_gu, offsets, transpose_weight=transpose, tiles=tiles)
        )


def test_cached_launches_match_the_jit_path_bitwise(monkeypatch):
    """The kept compiled kernels (``moe._launch``) on new tensors of every call (other
    addresses, other row counts, a new descriptor each call) give the ``kernel[grid]`` path's
    results bit for bit: gathers, row sums, both grouped GEMMs and the fused routed experts."""
    from mcore_kernels.moe import _launch

    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    w_gu = torch.randn(EXPERTS, 2 * FFN, HIDDEN, **bf16) * 0.05

    def products(scale: float, extra_rows: int) -> list[torch.Tensor]:
        counts = _counts()
        counts[3] += extra_rows
        offsets = counts.cumsum(0).to(torch.int32).cuda()
        rows = int(offsets[-1])
        x = torch.randn(rows, HIDDEN, **bf16) * scale
        grad_gu = torch.randn(rows, 2 * FFN, **bf16)
        return [
            m_grouped_mm(x, w_gu, offsets, transpose_weight=True, tiles=ROWS_TILES),
            m_grouped_mm(grad_gu, w_gu, offsets, transpose_weight=False, tiles=ROWS_TILES),
            k_grouped_mm(grad_gu, x, offsets, tiles=WEIGHT_TILES),
        ]

    results = {}
    for cached in (False, True):
        monkeypatch.setattr(_launch, "CACHED_LAUNCH", cached)
        torch.manual_seed(1)
        # Three calls: the first compiles (or finds) the kernels, the next reuse them on
        # tensors at other addresses and of other sizes.
        results[cached] = [t for extra in (0, 37, 5) for t in products(1.0 + extra, extra)]
        results[cached] += _routed(ALL_TRITON)
    for a, b in zip(results[False], results[True], strict=True):
        assert torch.equal(a, b)
