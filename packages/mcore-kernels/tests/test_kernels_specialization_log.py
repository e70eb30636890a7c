"""SpecializationLog: Triton's specialisation key of interpreted launches, and the kernels of
an inference step launching one key whatever the step's token count and table width."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel modules' import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels._triton_utils import jit, tl
from mcore_kernels.decode_step_metadata import decode_step_metadata
from mcore_kernels.row_argmax import row_argmax_triton
from mcore_kernels.specialization_log import SpecializationLog

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
    ),
]


@jit
def _copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


@jit(do_not_specialize=("x_ptr", "n"))
def _copy_kernel_unspecialised(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


def _launch_copies(kernel):
    x = torch.arange(40, dtype=torch.float32)
    out = torch.empty(40)
    with SpecializationLog() as log:
        for n, offset in ((1, 0), (16, 0), (17, 0), (18, 0), (16, 1)):
            kernel[(1,)](x[offset:], out, n, BLOCK=32)
    return log


def test_ints_equal_to_one_divisible_by_16_and_misaligned_pointers_are_distinct_keys():
    log = _launch_copies(_copy_kernel)
    assert log.launches == 5
    # n == 1, n % 16 == 0 (twice, one with x 4 bytes off 16-byte alignment), other n (twice).
    assert len(log.keys) == 4
    assert all(key[0] == "_copy_kernel" for key in log.keys)


def test_do_not_specialize_leaves_one_key():
    assert len(_launch_copies(_copy_kernel_unspecialised).keys) == 1


def test_the_log_restores_the_interpreter_on_exit():
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    with SpecializationLog():
        assert InterpretedFunction.run is not run
    assert InterpretedFunction.run is run


def test_row_argmax_launches_one_specialisation_at_any_row_count():
    with SpecializationLog() as log:
        for rows in (1, 2, 3, 5, 16, 17, 33):
            row_argmax_triton(torch.randn(rows, 3000))
    assert len(log.keys) == 1


def test_step_metadata_launches_one_specialisation_at_any_token_count_and_table_cut(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    tables = torch.arange(8 * 12, dtype=torch.int32).view(8, 12)
    with SpecializationLog() as log:
        for tokens, width in ((1, 1), (2, 3), (3, 12), (16, 5), (17, 12)):
            inputs = torch.zeros((3, tokens), dtype=torch.long)
            inputs[2] = torch.arange(tokens) % 8
            decode_step_metadata(tables[:, :width], inputs[1], inputs[2], 4)
    assert len(log.keys) == 1
