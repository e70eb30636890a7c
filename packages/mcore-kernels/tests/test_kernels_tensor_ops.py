"""CUDA-graph-safe row copies: Triton (interpreted on CPU) against the torch references and
against plain slicing."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels import tensor_ops
from mcore_kernels.errors import (
    KernelDeviceError,
    KernelDtypeError,
    KernelShapeError,
    KernelValueError,
)
from mcore_kernels.reference import masked_update_reference, merge_reference, slice_after_reference
from mcore_kernels.tensor_ops import masked_update, merge, slice_after

# Every CPU test here may run the Triton kernels through the interpreter (see conftest.py).
pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
TRAILING = [(5,), (3, 4), (2, 3, 2)]  # 2-D, 3-D and 4-D tensors


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", request.param)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


def _rows(n, trailing, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, *trailing, generator=gen) * 10
    return values > 0 if dtype == torch.bool else values.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("trailing", TRAILING, ids=str)
@pytest.mark.parametrize("pos", [0, 3, 7, 9])
def test_slice_after_copies_rows_from_pos(backend, dtype, trailing, pos):
    inp = _rows(7, trailing, dtype, seed=0)
    out = _rows(5, trailing, dtype, seed=1)
    expected = out.clone()
    start = min(pos, 7)  # a pos past the end is clamped: nothing is copied
    count = min(7 - start, 5)
    expected[:count] = inp[start : start + count]
    result = slice_after(inp, torch.tensor([pos]), out)
    assert result is out
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("trailing", TRAILING, ids=str)
@pytest.mark.parametrize("pos", [0, 2, 4])
def test_merge_writes_a_prefix_then_b(backend, dtype, trailing, pos):
    a = _rows(4, trailing, dtype, seed=2)
    b = _rows(3, trailing, dtype, seed=3)
    out = _rows(6, trailing, dtype, seed=4)
    expected = out.clone()
    expected[:pos] = a[:pos]
    count = min(3, 6 - pos)
    expected[pos : pos + count] = b[:count]
    assert merge(a, b, torch.tensor(pos, dtype=torch.int32), out) is out
    assert torch.equal(out, expected)


@pytest.mark.parametrize("pos", [0, 3, 5])
def test_merge_without_out_updates_a_in_place(backend, pos):
    a = _rows(5, (4,), torch.float32, seed=5)
    b = _rows(4, (4,), torch.float32, seed=6)
    expected = a.clone()
    count = min(4, 5 - pos)
    expected[pos : pos + count] = b[:count]
    assert merge(a, b, torch.tensor([pos])) is a
    assert torch.equal(a, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("trailing", TRAILING, ids=str)
def test_masked_update_scatters_rows_and_skips_minus_one(backend, dtype, trailing):
    states = _rows(8, trailing, dtype, seed=7)
    new_states = _rows(4, trailing, dtype, seed=8)
    idx = torch.tensor([6, -1, 0, 3])
    expected = states.clone()
    for i, slot in enumerate(idx.tolist()):
        if slot != -1:
            expected[slot] = new_states[i]
    assert masked_update(states, idx, new_states) is states
    assert torch.equal(states, expected)


def test_masked_update_with_only_minus_one_changes_nothing(backend):
    states = _rows(4, (3,), torch.float32, seed=9)
    before = states.clone()
    masked_update(
        states, torch.full((2,), -1, dtype=torch.int32), _rows(2, (3,), torch.float32, seed=10)
    )
    assert torch.equal(states, before)


def test_triton_copies_are_bitwise_for_nan_payloads(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    payload = torch.tensor([0x7FC00001, 0x7F800001], dtype=torch.int32).view(torch.float32)
    out = torch.zeros(2)
    slice_after(payload.reshape(2, 1), torch.tensor([0]), out.reshape(2, 1))
    assert torch.equal(out.view(torch.int32), payload.view(torch.int32))


def test_references_match_triton_on_random_positions(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(11)
    for _ in range(5):
        pos = torch.randint(0, 7, (1,), generator=gen)
        inp, out = _rows(6, (3,), torch.float16, 12), _rows(4, (3,), torch.float16, 13)
        expected = slice_after_reference(inp, pos, out.clone())
        assert torch.equal(slice_after(inp, pos, out), expected)
        a, b, dst = (
            _rows(6, (3,), torch.float16, 14),
            _rows(3, (3,), torch.float16, 15),
            _rows(8, (3,), torch.float16, 16),
        )
        pos_a = pos.clamp(max=6)
        assert torch.equal(
            merge(a, b, pos_a, dst.clone()), merge_reference(a, b, pos_a, dst.clone())
        )
        idx = torch.randperm(6, generator=gen)[:3]
        idx[0] = -1
        states = _rows(6, (3,), torch.float16, 17)
        new = _rows(3, (3,), torch.float16, 18)
        assert torch.equal(
            masked_update(states.clone(), idx, new),
            masked_update_reference(states.clone(), idx, new),
        )


def test_check_bounds_rejects_out_of_range_positions_and_indices():
    inp, out = torch.zeros(4, 2), torch.zeros(4, 2)
    with pytest.raises(KernelValueError, match=r"pos=5 is outside \[0, 4\]"):
        slice_after(inp, torch.tensor([5]), out, check_bounds=True)
    with pytest.raises(KernelValueError, match=r"pos=-1 is outside"):
        merge(inp, torch.zeros(1, 2), torch.tensor([-1]), out, check_bounds=True)
    with pytest.raises(KernelValueError, match="idx holds 4"):
        masked_update(torch.zeros(4, 2), torch.tensor([0, 4]), torch.zeros(2, 2), check_bounds=True)


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (
            lambda: slice_after(torch.zeros(4, 2), torch.tensor([0]), torch.zeros(4, 3)),
            KernelShapeError,
            "out.shape=(4, 3)",
        ),
        (
            lambda: slice_after(torch.zeros(4, 2), torch.tensor([0, 1]), torch.zeros(4, 2)),
            KernelShapeError,
            "pos.shape=(2,)",
        ),
        (
            lambda: slice_after(torch.zeros(4, 2), torch.tensor([0.0]), torch.zeros(4, 2)),
            KernelDtypeError,
            "pos.dtype",
        ),
        (
            lambda: slice_after(torch.zeros(4, 2), torch.tensor([0]), torch.zeros(2, 4).t()),
            KernelShapeError,
            "out must be contiguous",
        ),
        (
            lambda: merge(
                torch.zeros(4, 2), torch.zeros(2, 2, dtype=torch.float16), torch.tensor([0])
            ),
            KernelDtypeError,
            "b.dtype=torch.float16",
        ),
        (
            lambda: merge(
                torch.zeros(4, 2), torch.zeros(2, 2), torch.tensor([0]), torch.zeros(3, 2)
            ),
            KernelShapeError,
            "out.shape[0]=3",
        ),
        (
            lambda: masked_update(torch.zeros(4, 2), torch.tensor([[0]]), torch.zeros(1, 2)),
            KernelShapeError,
            "idx.shape=(1, 1)",
        ),
        (
            lambda: masked_update(torch.zeros(4, 2), torch.tensor([0, 1]), torch.zeros(3, 2)),
            KernelShapeError,
            "new_states.shape[0]=3",
        ),
        (
            lambda: masked_update(
                torch.zeros(4, 2), torch.tensor([0], device="meta"), torch.zeros(1, 2)
            ),
            KernelDeviceError,
            "idx on meta",
        ),
    ],
)
def test_bad_arguments_raise_typed_errors_naming_them(call, error, fragment):
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value)


def test_module_exposes_the_three_ops():
    assert tensor_ops.__all__ == ["slice_after", "merge", "masked_update"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_follows_device_position():
    inp = torch.arange(40, dtype=torch.float32, device="cuda").reshape(10, 4)
    a = torch.full((10, 4), -1.0, device="cuda")
    out = torch.zeros(6, 4, device="cuda")
    merged = torch.zeros(12, 4, device="cuda")
    states = torch.zeros(5, 4, device="cuda")
    idx = torch.tensor([2, -1, 4], device="cuda")
    pos = torch.tensor([3], device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        slice_after(inp, pos, out)
        merge(a, inp, pos, merged)
        masked_update(states, idx, inp[:3])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slice_after(inp, pos, out)
        merge(a, inp, pos, merged)
        masked_update(states, idx, inp[:3])
    for new_pos, new_idx in ((1, [0, 1, -1]), (7, [-1, -1, 3])):
        pos.fill_(new_pos)
        idx.copy_(torch.tensor(new_idx))
        out.zero_()
        merged.zero_()
        states.zero_()
        graph.replay()
        torch.cuda.synchronize()
        expected_out = torch.zeros_like(out)
        slice_after_reference(inp, pos, expected_out)
        expected_merged = merge_reference(a, inp, pos, torch.zeros_like(merged))
        expected_states = masked_update_reference(torch.zeros_like(states), idx, inp[:3])
        assert torch.equal(out, expected_out)
        assert torch.equal(merged, expected_merged)
        assert torch.equal(states, expected_states)
