"""decode_step_metadata: the Triton kernel (interpreted on CPU) against the torch ops and a loop."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.decode_step_metadata import decode_step_metadata
from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")


def _independent(block_tables, positions, table_rows, block_size):
    """Python loops over the tokens: the block of each position, its slot and its row."""
    slots, rows, lengths = [], [], []
    for position, row in zip(positions.tolist(), table_rows.tolist(), strict=True):
        table = block_tables[row].tolist()
        slots.append(table[position // block_size] * block_size + position % block_size)
        rows.append(table)
        lengths.append(position + 1)
    return slots, rows, lengths


@needs_triton
@pytest.mark.parametrize("width", [7, 5])
def test_matches_the_torch_ops_and_a_loop_over_tokens(width):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(width)
    full = torch.randint(0, 1000, (6, 7), generator=generator, dtype=torch.int32)
    block_tables = full.to(device)[:, :width]  # a column slice: row stride 7
    block_size = 4
    positions = torch.randint(0, width * block_size, (9,), generator=generator).to(device)
    table_rows = torch.randint(0, 6, (9,), generator=generator).to(device)
    slots, tables, lengths = decode_step_metadata(block_tables, positions, table_rows, block_size)
    assert (slots.dtype, tables.dtype, lengths.dtype) == (torch.int64, torch.int32, torch.int32)
    # The torch ops the kernel replaces.
    expected_tables = block_tables.index_select(0, table_rows)
    blocks = expected_tables.gather(1, (positions // block_size)[:, None])[:, 0]
    assert torch.equal(slots, blocks.long() * block_size + positions % block_size)
    assert torch.equal(tables, expected_tables)
    assert torch.equal(lengths, (positions + 1).to(torch.int32))
    assert [t.tolist() for t in (slots, tables, lengths)] == list(
        _independent(block_tables.cpu(), positions.cpu(), table_rows.cpu(), block_size)
    )


def test_bad_input_raises_typed_errors():
    tables = torch.zeros((2, 3), dtype=torch.int32)
    index = torch.zeros(2, dtype=torch.long)
    with pytest.raises(KernelShapeError, match="expected"):
        decode_step_metadata(tables, index, index[:1], 4)
    with pytest.raises(KernelDtypeError, match="int32"):
        decode_step_metadata(tables.long(), index, index, 4)
    with pytest.raises(KernelDtypeError, match="positions"):
        decode_step_metadata(tables, index.float(), index, 4)
    with pytest.raises(KernelValueError, match="block_size=0"):
        decode_step_metadata(tables, index, index, 0)
