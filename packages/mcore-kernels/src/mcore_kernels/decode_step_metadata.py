"""A paged-cache step's metadata (cache slots, block-table rows, context lengths) in one launch.

Before each forward a paged KV cache derives, from each new token's position and its
request's block-table row, where the token's key and value go (``slot_mapping``), the table row
the attention reads (``tables``) and how many positions it attends to (``context_lens``). In
torch that is an ``index_select``, a ``gather`` and half a dozen elementwise kernels, each a
launch of a few microseconds at decode; here one program per token does all of it.

Integer arithmetic only: the results are exactly those of the torch ops (which run where Triton
does not).

Shapes: ``block_tables`` int32 ``[rows, W]`` (any row stride, contiguous along ``W``),
``positions`` and ``table_rows`` integer ``[T]``; returns int64 ``slot_mapping [T]``, int32
``tables [T, W]`` (contiguous) and int32 ``context_lens [T]``.

Dispatch: Triton on CUDA, the torch reference elsewhere (with ``TRITON_INTERPRET=1`` the Triton
path runs on CPU tensors). While ``torch.compile`` traces a call it becomes the ``torch.library``
op ``torch.ops.mcore_kernels.decode_step_metadata``, which runs the same dispatch when the graph
runs.
"""

from __future__ import annotations

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    gdc_launch_dependents,
    jit,
    next_power_of_2,
    pdl_supported,
    tl,
)
from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.reference import decode_step_metadata_reference

__all__ = ["decode_step_metadata"]


# The token count and the table width vary from step to step (eager steps cut the table to the
# step's longest context; the positions are a row of the step's [3, T] inputs, 16-byte aligned
# only for even T): specialising on them would compile a kernel in the request path.
@jit(do_not_specialize=("positions_ptr", "rows_ptr", "stride_table_row", "width"))
def _decode_step_metadata_kernel(
    tables_ptr,
    positions_ptr,
    rows_ptr,
    slots_out_ptr,
    tables_out_ptr,
    context_out_ptr,
    stride_table_row,
    width,
    block_size,
    BLOCK_W: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    if TRIGGER:
        # A kernel launched next with programmatic dependent launch (the step's first gather)
        # may start now; it waits for this one before reading anything.
        gdc_launch_dependents()
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token).to(tl.int64)
    row = tl.load(rows_ptr + token).to(tl.int64)
    source = tables_ptr + row * stride_table_row
    columns = tl.arange(0, BLOCK_W)
    for start in range(0, width, BLOCK_W):
        offsets = start + columns
        mask = offsets < width
        blocks = tl.load(source + offsets, mask=mask, other=0)
        tl.store(tables_out_ptr + token.to(tl.int64) * width + offsets, blocks, mask=mask)
    block = tl.load(source + position // block_size).to(tl.int64)
    tl.store(slots_out_ptr + token, block * block_size + position % block_size)
    tl.store(context_out_ptr + token, (position + 1).to(tl.int32))


def decode_step_metadata(
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    table_rows: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cache slots, table rows and context lengths of a step's tokens (one launch on CUDA).

    Args:
        block_tables: int32 ``[rows, W]`` block table (a column slice of a wider one is fine).
        positions: Integer ``[T]`` position of each new token (``position // block_size``
            must be a column of ``block_tables``).
        table_rows: Integer ``[T]`` block-table row of each token's request.
        block_size: Positions per cache block.

    Returns:
        ``(slot_mapping, tables, context_lens)``: int64 ``[T]`` flat slot of each token
        (``block * block_size + position % block_size``), int32 ``[T, W]`` the table row of
        each token, int32 ``[T]`` each token's position + 1.

    Raises:
        KernelShapeError: If the shapes do not match the layout above.
        KernelDtypeError: If ``block_tables`` is not int32 or an index is not an integer.
        KernelValueError: If ``block_size`` is not positive.
    """
    if block_tables.dim() != 2 or positions.dim() != 1 or positions.shape != table_rows.shape:
        raise KernelShapeError(
            f"block_tables {tuple(block_tables.shape)}, positions {tuple(positions.shape)}, "
            f"table_rows {tuple(table_rows.shape)}; expected [rows, W], [T] and [T]"
        )
    if block_tables.dtype != torch.int32:
        raise KernelDtypeError(f"block_tables is {block_tables.dtype}; expected torch.int32")
    for name, tensor in (("positions", positions), ("table_rows", table_rows)):
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise KernelDtypeError(f"{name} is {tensor.dtype}; expected an integer dtype")
    if block_size < 1:
        raise KernelValueError(f"block_size={block_size}; expected >= 1")
    if _compile.compiling():
        return _decode_step_metadata_op(block_tables, positions, table_rows, block_size)
    return _decode_step_metadata_run(block_tables, positions, table_rows, block_size)


def _decode_step_metadata_run(
    block_tables: torch.Tensor, positions: torch.Tensor, table_rows: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(block_tables, positions, table_rows) or block_tables.stride(1) != 1:
        return decode_step_metadata_reference(block_tables, positions, table_rows, block_size)
    count, width = positions.shape[0], block_tables.shape[1]
    device = positions.device
    slots = torch.empty(count, dtype=torch.int64, device=device)
    tables = torch.empty((count, width), dtype=torch.int32, device=device)
    context = torch.empty(count, dtype=torch.int32, device=device)
    if count == 0:
        return slots, tables, context
    _decode_step_metadata_kernel[(count,)](
        block_tables,
        positions.contiguous(),
        table_rows.contiguous(),
        slots,
        tables,
        context,
        block_tables.stride(0),
        width,
        block_size,
        # From the row stride, which a cut table keeps: one binary for every cut of it.
        BLOCK_W=min(1024, next_power_of_2(max(width, block_tables.stride(0), 1))),
        TRIGGER=pdl_supported(device),
        num_warps=1,
    )
    return slots, tables, context


@_compile.custom_op(
    "decode_step_metadata",
    "(Tensor block_tables, Tensor positions, Tensor table_rows, int block_size) "
    "-> (Tensor, Tensor, Tensor)",
)
def _decode_step_metadata_op(
    block_tables: torch.Tensor, positions: torch.Tensor, table_rows: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _decode_step_metadata_run(block_tables, positions, table_rows, block_size)


@_decode_step_metadata_op.register_fake
def _decode_step_metadata_fake(block_tables, positions, table_rows, block_size):
    count, width = positions.shape[0], block_tables.shape[1]
    return (
        positions.new_empty(count, dtype=torch.int64),
        block_tables.new_empty((count, width)),
        positions.new_empty(count, dtype=torch.int32),
    )
