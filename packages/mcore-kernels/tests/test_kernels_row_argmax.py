"""row_argmax: the Triton kernel (interpreted on CPU) against ``torch.argmax``, index for index."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.reference import greedy_feed_reference
from mcore_kernels.row_argmax import greedy_feed, row_argmax, row_argmax_triton

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize(
    ("rows", "columns", "dtype", "chunks"),
    [
        (1, 5000, torch.bfloat16, None),
        (3, 151, torch.float32, None),
        (2, 270000, torch.bfloat16, None),
        (4, 2048, torch.float16, 1),  # one program per row: no workspace
        (4, 7000, torch.float32, 2),  # a partial last tile in every program
        (4, 151, torch.bfloat16, 7),  # more programs asked than tiles: capped
    ],
)
def test_matches_torch_argmax_with_ties_negatives_zeros_infinities_and_nan(
    rows, columns, dtype, chunks
):
    generator = torch.Generator().manual_seed(rows * columns)
    x = torch.randn(rows, columns, generator=generator).to(dtype)
    # A tie across lanes and programs: the first index wins.
    x[0, columns - 3] = x[0, 7] = x[0, 3] = x[0, 4100 % columns] = x[0].max() + 1
    if rows > 1:
        x[1] = -x[1].abs()  # every value negative
        x[1, columns // 2] = -0.0
        x[1, columns - 1] = 0.0  # -0.0 == 0.0: the first of them wins
    if rows > 2:
        x[2, columns - 1] = x[2, 10] = x[2, 20] = float("nan")  # NaN is the largest: first wins
    if rows > 3:
        x[3] = float("-inf")  # every value -inf: index 0
    x = x.to(_device())
    expected = x.argmax(dim=-1)
    actual = row_argmax_triton(x, chunks=chunks)
    assert actual.dtype == torch.int64
    assert torch.equal(actual, expected)
    # The tickets are left zeroed: a second launch gives the same indices.
    assert torch.equal(row_argmax_triton(x, chunks=chunks), expected)


def test_many_rows_take_their_own_programs_per_row(monkeypatch):
    from mcore_kernels import row_argmax as module

    assert module._MANY_ROWS_CHUNKS == (8, 256)
    assert module._chunks(512, 151936, 132) == 8
    assert module._chunks(255, 151936, 132) == 16
    assert module._chunks(64, 151936, 132) == 17
    monkeypatch.setattr(module, "_MANY_ROWS_CHUNKS", (0, 256))
    assert module._chunks(512, 151936, 132) == 16


def test_dispatch_and_bad_input():
    x = torch.randn(2, 9)
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    with pytest.raises(KernelShapeError, match="expected"):
        row_argmax(torch.randn(9))
    with pytest.raises(KernelDtypeError, match="int64"):
        row_argmax(torch.ones(2, 3, dtype=torch.int64))
    if _RUNS_TRITON:
        with pytest.raises(KernelShapeError, match="chunks=0"):
            row_argmax_triton(torch.randn(2, 3, device=_device()), chunks=0)


def _feed_buffers(rows, device):
    samples = torch.full((rows,), float("nan"), dtype=torch.float64, device=device)
    tokens = torch.full((rows,), -1, dtype=torch.int64, device=device)
    positions = torch.arange(rows, dtype=torch.int64, device=device) * 7 + 3
    return samples, tokens, positions


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize(("rows", "columns"), [(1, 5000), (3, 1500)])
def test_greedy_feed_writes_the_next_step_inputs(monkeypatch, rows, columns):
    # One program per row (1500 columns) and several with the ticket reduction (5000).
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    device = _device()
    generator = torch.Generator().manual_seed(rows + columns)
    x = torch.randn(rows, columns, generator=generator).to(torch.bfloat16).to(device)
    got = _feed_buffers(rows, device)
    expected = _feed_buffers(rows, device)
    index = greedy_feed(x, *got)
    expected_index = greedy_feed_reference(x, *expected)
    assert torch.equal(index, expected_index)
    assert torch.equal(index, x.argmax(dim=-1))
    for buffer, reference in zip(got, expected, strict=True):
        assert torch.equal(buffer, reference)
    assert torch.equal(got[2], torch.arange(rows, device=device) * 7 + 4)


def test_greedy_feed_reference_path_and_checks(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    x = torch.randn(2, 50)
    samples, tokens, positions = _feed_buffers(2, "cpu")
    index = greedy_feed(x, samples, tokens, positions)
    assert torch.equal(index, x.argmax(dim=-1))
    assert torch.equal(samples, index.double()) and torch.equal(tokens, index)
    assert positions.tolist() == [4, 11]
    with pytest.raises(KernelShapeError, match="samples"):
        greedy_feed(x, samples[:1], tokens, positions)
    with pytest.raises(KernelDtypeError, match="tokens"):
        greedy_feed(x, samples, tokens.int(), positions)
    with pytest.raises(KernelShapeError, match="positions"):
        greedy_feed(x, samples, tokens, torch.zeros(2, 2, dtype=torch.int64)[:, 0])


def test_opcheck_greedy_feed(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    x = torch.randn(2, 50)
    torch.library.opcheck(torch.ops.mcore_kernels.greedy_feed, (x, *_feed_buffers(2, "cpu")))
