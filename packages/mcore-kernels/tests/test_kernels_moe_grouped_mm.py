"""Persistent grouped GEMMs (Triton, through the interpreter) against their torch references:
the device-side tile schedule, row-grouped products in both weight layouts (plain and
flattened loops), reduction-grouped weight gradients, experts without rows, the fused routed
experts with every GEMM on these kernels or on cuBLAS loops (values and gradients, dropped
assignments), bitwise repeats, and bad input.

The interpreter reads bfloat16 tiles through TMA descriptors wrongly, so these tests run in
float16; the GPU tests (``test_kernels_moe_grouped_mm_gpu.py``) cover bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.moe.expert_gemms import (
    CUBLAS_LOOP,
    CUBLAS_LOOP_PLAN,
    GROUPED_MM,
    ExpertGemms,
    choose_expert_gemms,
    measured_expert_gemms,
    without_host_sync,
)
from mcore_kernels.moe.grouped_mm import (
    PersistentTiles,
    k_grouped_mm,
    k_grouped_mm_reference,
    m_grouped_mm,
    m_grouped_mm_reference,
    tile_schedule,
)
from mcore_kernels.moe.routed import grouped_experts, routed_experts, routed_experts_reference

pytestmark = pytest.mark.interpreter

DTYPE = torch.float16
TILES = PersistentTiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
# Experts 0, 3 and 5 get no rows (first, middle, last); expert 2 spans several row tiles.
COUNTS = [0, 5, 37, 0, 8, 0]


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _offsets(counts=COUNTS):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DTYPE)


def test_tile_schedule_lists_every_row_tile_of_every_expert():
    offsets = _offsets()
    sched = tile_schedule(offsets, int(offsets[-1]), 16)
    max_tiles = (sched.numel() - 1) // 3
    want = []
    start = 0
    for expert, count in enumerate(COUNTS):
        want += [(expert, row, start + count) for row in range(start, start + count, 16)]
        start += count
    assert int(sched[-1]) == len(want)
    got = list(zip(*(sched[i * max_tiles : i * max_tiles + len(want)].tolist() for i in range(3))))
    assert got == want


@pytest.mark.parametrize(
    "options",
    [{}, {"flatten": True}, {"expert_columns": True}, {"flatten": True, "expert_columns": True}],
    ids=["plain", "flat", "expert-columns", "flat-expert-columns"],
)
@pytest.mark.parametrize("transpose", [True, False])
def test_m_grouped_mm_matches_reference(transpose, options):
    offsets = _offsets()
    rows, n, k = int(offsets[-1]), 48, 32
    a = _randn(rows, k, seed=1)
    w = _randn(len(COUNTS), *((n, k) if transpose else (k, n)), seed=2)
    tiles = PersistentTiles(
        block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2, **options
    )
    got = m_grouped_mm(a, w, offsets, transpose_weight=transpose, tiles=tiles)
    want = m_grouped_mm_reference(a, w, offsets, transpose_weight=transpose)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    # Every loop and job order sums each element in the same order: bitwise the plain kernel.
    plain = PersistentTiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
    torch.testing.assert_close(
        got, m_grouped_mm(a, w, offsets, transpose_weight=transpose, tiles=plain), rtol=0, atol=0
    )


@pytest.mark.parametrize("n", [32, 40], ids=["tma-store", "masked-store"])
def test_k_grouped_mm_matches_reference_and_zeroes_empty_experts(n):
    offsets = _offsets()
    rows = int(offsets[-1])
    g, x = _randn(rows, n, seed=7), _randn(rows, 48, seed=8)
    got = k_grouped_mm(g, x, offsets, tiles=TILES)
    torch.testing.assert_close(got, k_grouped_mm_reference(g, x, offsets), rtol=2e-3, atol=2e-3)
    for expert, count in enumerate(COUNTS):
        if count == 0:
            assert torch.count_nonzero(got[expert]) == 0


# Row counts that are multiples of the 16-row chunk (rows padded per expert, or equal slots):
# empty experts first, in the middle and last, and one of several chunks.
ALIGNED_COUNTS = [0, 16, 48, 0, 32, 0]


@pytest.mark.parametrize("counts", [ALIGNED_COUNTS, [32, 32, 32], [0, 0], [16]])
def test_aligned_k_grouped_mm_matches_reference_and_zeroes_empty_experts(counts):
    offsets = _offsets(counts)
    # Rows past the last expert (read by no chunk) hold NaN: they must not leak in.
    rows = int(offsets[-1]) + 16
    g, x = _randn(rows, 32, seed=11), _randn(rows, 48, seed=12)
    g[int(offsets[-1]) :] = float("nan")
    got = k_grouped_mm(g, x, offsets, tiles=TILES, aligned=True)
    torch.testing.assert_close(got, k_grouped_mm_reference(g, x, offsets), rtol=2e-3, atol=2e-3)
    for expert, count in enumerate(counts):
        if count == 0:
            assert torch.count_nonzero(got[expert]) == 0
    # The same sums as the masked kernel, run to run bitwise.
    assert torch.equal(got, k_grouped_mm(g, x, offsets, tiles=TILES, aligned=True))


def _routed_problem(tokens=20, hidden=32, ffn=16, experts=5, top_k=2, empty=(0, 3)):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(tokens, hidden, generator=g).to(DTYPE)
    allowed = torch.tensor([e for e in range(experts) if e not in empty])
    chosen = allowed[torch.rand(tokens, allowed.numel(), generator=g).topk(top_k, -1).indices]
    weights = torch.rand(tokens, top_k, generator=g).to(DTYPE)
    w_gu = (torch.randn(experts, 2 * ffn, hidden, generator=g) * 0.2).to(DTYPE)
    w_d = (torch.randn(experts, hidden, ffn, generator=g) * 0.2).to(DTYPE)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    offsets = torch.bincount(flat, minlength=experts).cumsum(0).to(torch.int32)
    return x, weights, w_gu, w_d, order, inverse, offsets


ALL_TRITON = ExpertGemms(
    gate_up=TILES, down=TILES, d_act=TILES, d_x=TILES, w_down=TILES, w_gate_up=TILES
)


def _run(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [leaf.grad for leaf in leaves]


MIXED = ExpertGemms(
    gate_up=CUBLAS_LOOP, down=TILES, d_act=CUBLAS_LOOP, d_x=TILES, w_down=CUBLAS_LOOP
)


@pytest.mark.parametrize("plan", [ALL_TRITON, MIXED], ids=["triton", "triton-and-loop"])
def test_routed_experts_on_triton_gemms_match_reference_values_and_gradients(plan):
    x, weights, w_gu, w_d, order, inverse, offsets = _routed_problem()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(10)).to(DTYPE)
    got = _run(
        lambda *t: routed_experts(*t, order, inverse, offsets, gemms=plan),
        (x, weights, w_gu, w_d),
        grad,
    )
    # The reference in float32 (its autograd runs through index_select / index_copy).
    want = _run(
        lambda *t: routed_experts_reference(*t, order, offsets),
        [t.float() for t in (x, weights, w_gu, w_d)],
        grad.float(),
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2)
    # Experts 0 and 3 got no token: their weight gradients are exactly zero.
    for expert in (0, 3):
        assert torch.count_nonzero(got[3][expert]) == 0
        assert torch.count_nonzero(got[4][expert]) == 0


def test_routed_experts_on_triton_gemms_are_bitwise_reproducible():
    x, weights, w_gu, w_d, order, inverse, offsets = _routed_problem()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(11)).to(DTYPE)

    def fn(*t):
        return routed_experts(*t, order, inverse, offsets, gemms=ALL_TRITON)

    first = _run(fn, (x, weights, w_gu, w_d), grad)
    second = _run(fn, (x, weights, w_gu, w_d), grad)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_bad_input_raises_typed_errors():
    offsets = _offsets()
    rows = int(offsets[-1])
    a, w = _randn(rows, 32), _randn(len(COUNTS), 48, 32)
    with pytest.raises(KernelDtypeError, match=r"a\.dtype"):
        m_grouped_mm(a.float(), w, offsets, transpose_weight=True, tiles=TILES)
    with pytest.raises(KernelShapeError, match=r"a\.shape"):
        m_grouped_mm(a, w, offsets, transpose_weight=False, tiles=TILES)
    with pytest.raises(KernelShapeError, match=r"x\.shape"):
        k_grouped_mm(a, _randn(rows + 1, 16), offsets, tiles=TILES)
    with pytest.raises(KernelShapeError, match="block_m=48"):
        PersistentTiles(block_m=48)
    with pytest.raises(KernelValueError, match="num_warps=3"):
        PersistentTiles(num_warps=3)
    with pytest.raises(KernelValueError, match=r"ExpertGemms\.down=.cutlass.: expected one of"):
        ExpertGemms(down="cutlass")
    with pytest.raises(KernelValueError, match=r"ExpertGemms\.row_align=24"):
        ExpertGemms(row_align=24)


def test_routed_experts_on_triton_gemms_with_dropped_assignments_match_reference():
    # Capacity routing: each expert keeps its first 3 rows; the dropped assignments have no
    # row (inverse -1) and the rows past the kept ones hold no assignment (order -1).
    x, weights, w_gu, w_d, order, inverse, offsets = _routed_problem()
    ends = offsets.tolist()
    rows = torch.full_like(order, -1)
    kept_inverse = torch.full_like(inverse, -1)
    kept_ends, start, row = [], 0, 0
    for end in ends:
        for assignment in order[start : min(end, start + 3)].tolist():
            rows[row] = assignment
            kept_inverse[assignment] = row
            row += 1
        kept_ends.append(row)
        start = end
    kept_offsets = torch.tensor(kept_ends, dtype=torch.int32)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(12)).to(DTYPE)
    got = _run(
        lambda *t: routed_experts(*t, rows, kept_inverse, kept_offsets, gemms=ALL_TRITON),
        (x, weights, w_gu, w_d),
        grad,
    )
    want = _run(
        lambda *t: routed_experts_reference(*t, rows, kept_offsets),
        [t.float() for t in (x, weights, w_gu, w_d)],
        grad.float(),
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2)
    dropped = (kept_inverse < 0).view(weights.shape)
    assert dropped.any()
    assert torch.count_nonzero(got[2][dropped]) == 0


def test_grouped_experts_on_rows_in_expert_order_match_reference():
    offsets = _offsets()
    rows = int(offsets[-1])
    x = _randn(rows, 32, seed=13) * 0.5
    weights = torch.rand(rows, generator=torch.Generator().manual_seed(14)).to(DTYPE)
    w_gu = _randn(len(COUNTS), 32, 32, seed=15) * 0.2
    w_d = _randn(len(COUNTS), 32, 16, seed=16) * 0.2
    grad = _randn(rows, 32, seed=17)
    got = _run(
        lambda a, b, c, d: grouped_experts(a, b, c, d, offsets, gemms=ALL_TRITON),
        (x, weights, w_gu, w_d),
        grad,
    )
    order = torch.arange(rows)
    want = _run(
        lambda a, b, c, d: routed_experts_reference(a, b[:, None], c, d, order, offsets),
        [t.float() for t in (x, weights, w_gu, w_d)],
        grad.float(),
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2)


def test_measured_plans_follow_the_routed_rows_per_expert():
    # DeepSeek-V3 at 8k tokens: its Triton row GEMMs take each expert's jobs column by column.
    deepseek = measured_expert_gemms(8192 * 8, 7168, 2048, 256)
    for gemm in (deepseek.gate_up, deepseek.down, deepseek.d_act, deepseek.d_x):
        assert isinstance(gemm, PersistentTiles) and gemm.expert_columns
    assert deepseek.row_align == 64
    qwen3 = measured_expert_gemms(8192 * 8, 2048, 768, 128)
    for gemm in (qwen3.gate_up, qwen3.down, qwen3.d_act, qwen3.d_x):
        assert isinstance(gemm, PersistentTiles) and not gemm.expert_columns
    assert qwen3.w_down == GROUPED_MM and qwen3.w_gate_up == GROUPED_MM and qwen3.row_align == 1
    # Mixtral with 2048 rows per expert runs the cuBLAS loop; with 512 torch._grouped_mm.
    assert measured_expert_gemms(8192 * 2, 4096, 14336, 8) == CUBLAS_LOOP_PLAN
    assert measured_expert_gemms(2048 * 2, 4096, 14336, 8) == ExpertGemms()
    # Capacity routing packs the kept rows, so its plan is that of the routed rows: at 16k
    # tokens 1024 per expert (the Qwen3 plan), where the padded slots (1280 per expert at
    # capacity factor 1.25) would be past the plan's bound.
    assert measured_expert_gemms(16384 * 8, 2048, 768, 128) == qwen3
    assert measured_expert_gemms(128 * 1280, 2048, 768, 128) == ExpertGemms()
    assert measured_expert_gemms(100, 64, 32, 4) == ExpertGemms()
    # Off a Hopper GPU every GEMM runs on torch._grouped_mm.
    assert choose_expert_gemms(8192 * 8, 2048, 768, 128, torch.device("cpu")) == ExpertGemms()


def test_without_host_sync_replaces_only_the_loops():
    assert without_host_sync(CUBLAS_LOOP_PLAN) == ExpertGemms()
    mixed = ExpertGemms(down=TILES, d_x=CUBLAS_LOOP, w_down=CUBLAS_LOOP)
    assert without_host_sync(mixed) == ExpertGemms(down=TILES)
    plain = ExpertGemms(down=TILES)
    assert without_host_sync(plain) is plain
