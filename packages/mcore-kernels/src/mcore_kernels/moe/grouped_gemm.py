"""Grouped SwiGLU expert MLP: ``down_e(silu(gate_e(x)) * up_e(x))`` for every expert ``e``.

The experts' rows arrive sorted by expert with the group ends on the device (no host
synchronisation). Four Triton kernels do the work of a forward + backward pass:

- gate/up projection as one GEMM with SwiGLU in its epilogue (writes the gate/up product for
  the backward pass and the activation), optionally reading its input rows through the token
  permutation (no permuted copy of the tokens);
- down projection;
- backward of the down projection with the SwiGLU backward in its epilogue (the gradient of
  the activation never reaches memory);
- per-expert weight gradients, reducing over each expert's rows (zero for an expert without
  rows), and the input gradient of the gate/up projection.

No kernel uses atomics, so forward and backward are bitwise reproducible. On CPU tensors (or
with ``MCORE_KERNELS_BACKEND=torch``) :func:`grouped_swiglu_mlp_reference` runs instead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels.errors import (
    KernelDeviceError,
    KernelDtypeError,
    KernelShapeError,
    KernelValueError,
)

__all__ = ["GroupedTiles", "grouped_swiglu_mlp", "grouped_swiglu_mlp_reference"]


@dataclass(kw_only=True, slots=True)
class GroupedTiles:
    """Tile shape of one grouped GEMM kernel launch."""

    block_m: int = 128
    """Rows (tokens) per tile; the weight-gradient kernel's reduction step."""
    block_n: int = 128
    """Output columns per tile."""
    block_k: int = 64
    """Reduction step (output columns of the weight-gradient kernel's second dimension)."""
    num_warps: int = 8
    """Warps per program."""
    num_stages: int = 3
    """Software-pipelining depth."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise KernelShapeError(f"{name}={value} must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise KernelValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise KernelValueError(f"num_stages={self.num_stages} must be >= 1")


FORWARD_TILES = GroupedTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
"""Tiles of the forward GEMMs and of the input-gradient GEMMs."""
SWIGLU_TILES = GroupedTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
"""Tiles of the gate/up GEMM with the SwiGLU epilogue (two accumulators)."""
WEIGHT_GRAD_TILES = GroupedTiles(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)
"""Tiles of the weight-gradient GEMMs."""


def _device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _precision(tensor: torch.Tensor) -> str | None:
    """float32 GEMMs in full precision (TF32 would change results against the references);
    Triton's default for 16-bit inputs."""
    return "ieee" if tensor.dtype == torch.float32 else None


def _pow2(value: int) -> int:
    import triton

    return max(16, triton.next_power_of_2(value))


Bounds = tuple[torch.Tensor, torch.Tensor]
"""``(starts, ends)``: int32 ``[E]`` first row and end row of every expert."""


def _rows(
    a: torch.Tensor,
    weight: torch.Tensor,
    bounds: Bounds,
    num_rows: int,
    *,
    transpose_weight: bool,
    tiles: GroupedTiles,
    index: torch.Tensor | None = None,
    index_div: int = 1,
    epilogue: int = 0,
    aux: torch.Tensor | None = None,
    zero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row-tile GEMM of every expert: ``A[rows of e] @ W[e].T`` (``transpose_weight``) or
    ``@ W[e]``; see :func:`~mcore_kernels.moe._grouped_gemm_triton.grouped_rows_kernel`."""
    import triton

    from mcore_kernels.moe._grouped_gemm_triton import grouped_rows_kernel

    experts, w_rows, w_cols = weight.shape
    starts, ends = bounds
    k = a.shape[1]
    if transpose_weight:
        n, stride_bk, stride_bn = w_rows, 1, w_cols
    else:
        n, stride_bk, stride_bn = w_cols, w_cols, 1
    up_offset = 0
    if epilogue == 1:
        n //= 2
        up_offset = n
    # Rows outside every group (drop-and-pad padding) are never written: zeros with ``zero``.
    out = a.new_zeros(num_rows, n) if zero else a.new_empty(num_rows, n)
    second = a.new_empty(num_rows, 2 * n) if epilogue else None
    if num_rows == 0 or n == 0:
        return out, second
    if k == 0:
        out.zero_()
        if second is not None:
            second.zero_()
        return out, second
    grid = ((triton.cdiv(num_rows, tiles.block_m) + experts) * triton.cdiv(n, tiles.block_n),)
    aux_arg = second if epilogue == 1 else aux
    with _device(a):
        grouped_rows_kernel[grid](
            a,
            weight,
            out,
            aux_arg if aux_arg is not None else out,
            second if epilogue == 2 else out,
            index if index is not None else ends,
            starts,
            ends,
            experts,
            n,
            k,
            a.stride(0),
            weight.stride(0),
            stride_bk,
            stride_bn,
            out.stride(0),
            up_offset,
            INDEX_DIV=index_div,
            GATHER=index is not None,
            EPILOGUE=epilogue,
            PRECISION=_precision(a),
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k,
            E_PAD=_pow2(experts),
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
    return out, second


def _weight_grad(
    g: torch.Tensor,
    x: torch.Tensor,
    bounds: Bounds,
    experts: int,
    *,
    tiles: GroupedTiles,
    index: torch.Tensor | None = None,
    index_div: int = 1,
) -> torch.Tensor:
    """``out[e] = G[rows of e].T @ X[rows of e]`` as ``[E, N, K]``."""
    import triton

    from mcore_kernels.moe._grouped_gemm_triton import grouped_weight_grad_kernel

    n, k = g.shape[1], x.shape[1]
    starts, ends = bounds
    out = g.new_empty(experts, n, k)
    if experts == 0 or n == 0 or k == 0:
        return out
    grid = (triton.cdiv(n, tiles.block_n) * triton.cdiv(k, tiles.block_k), experts)
    with _device(g):
        grouped_weight_grad_kernel[grid](
            g,
            x,
            out,
            index if index is not None else ends,
            starts,
            ends,
            n,
            k,
            g.stride(0),
            x.stride(0),
            INDEX_DIV=index_div,
            GATHER=index is not None,
            PRECISION=_precision(g),
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
    return out


def _sum_token_rows(grad_rows: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
    from mcore_kernels.moe.permute import _sum_rows

    return _sum_rows(grad_rows, slots, top_k, None)


class GroupedSwiGLUMLPFunction(torch.autograd.Function):
    """Autograd wrapper of the grouped SwiGLU MLP kernels."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        starts: torch.Tensor,
        ends: torch.Tensor,
        num_rows: int,
        index: torch.Tensor | None,
        slots: torch.Tensor | None,
        top_k: int,
        padded: bool,
    ) -> torch.Tensor:
        bounds = (starts, ends)
        act, pre = _rows(
            x,
            gate_up,
            bounds,
            num_rows,
            transpose_weight=True,
            tiles=SWIGLU_TILES,
            index=index,
            index_div=top_k,
            epilogue=1,
        )
        out, _ = _rows(
            act, down, bounds, num_rows, transpose_weight=True, tiles=FORWARD_TILES, zero=padded
        )
        ctx.save_for_backward(x, gate_up, down, starts, ends, index, slots, pre, act)
        ctx.top_k = top_k
        ctx.padded = padded
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, gate_up, down, starts, ends, index, slots, pre, act = ctx.saved_tensors
        bounds = (starts, ends)
        grad = grad.contiguous()
        experts = gate_up.shape[0]
        num_rows = grad.shape[0]
        # Gradient of the gate/up product: the down projection's input gradient through the
        # SwiGLU backward (epilogue 2).
        _, grad_pre = _rows(
            grad,
            down,
            bounds,
            num_rows,
            transpose_weight=False,
            tiles=FORWARD_TILES,
            epilogue=2,
            aux=pre,
        )
        assert grad_pre is not None
        grad_down = _weight_grad(grad, act, bounds, experts, tiles=WEIGHT_GRAD_TILES)
        grad_gate_up = _weight_grad(
            grad_pre, x, bounds, experts, tiles=WEIGHT_GRAD_TILES, index=index, index_div=ctx.top_k
        )
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_rows, _ = _rows(
                grad_pre,
                gate_up,
                bounds,
                num_rows,
                transpose_weight=False,
                tiles=FORWARD_TILES,
                zero=ctx.padded and index is None,
            )
            if index is not None:
                assert slots is not None
                grad_x = _sum_token_rows(grad_rows, slots, ctx.top_k)
            else:
                grad_x = grad_rows
        return grad_x, grad_gate_up, grad_down, None, None, None, None, None, None, None


def _row_groups(counts: torch.Tensor, capacity: int | None) -> Bounds:
    """``(starts, ends)`` of every expert's rows."""
    counts = counts.to(torch.int32)
    if capacity is None:
        ends = counts.cumsum(0, dtype=torch.int32)
        return ends - counts, ends
    starts = torch.arange(counts.shape[0], device=counts.device, dtype=torch.int32) * capacity
    return starts, starts + counts


def grouped_swiglu_mlp_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: torch.Tensor,
    *,
    capacity: int | None = None,
    index: torch.Tensor | None = None,
    top_k: int = 1,
) -> torch.Tensor:
    """Torch reference of :func:`grouped_swiglu_mlp` (one expert at a time; syncs the host).

    Args:
        x: Rows or tokens, as for :func:`grouped_swiglu_mlp`.
        gate_up: ``[E, 2F, H]`` gate rows then up rows of every expert.
        down: ``[E, H, F]``.
        counts: ``[E]`` rows of each expert.
        capacity: Rows reserved per expert (drop-and-pad), or None (consecutive groups).
        index: ``[M]`` routing assignment of each row (row ``r`` reads token
            ``index[r] // top_k``), or None.
        top_k: Assignments per token.

    Returns:
        ``[M, H]`` outputs in row order (zero in unused padding rows).
    """
    if index is None:
        rows = x
    else:
        rows = x.index_select(0, index.clamp(min=0) // top_k)
    ffn = down.shape[-1]
    out = rows.new_zeros(rows.shape[0], down.shape[1])
    sizes = counts.tolist()
    start = 0
    for expert, size in enumerate(sizes):
        if capacity is not None:
            start = expert * capacity
        chunk = rows[start : start + size]
        pre = F.linear(chunk, gate_up[expert])
        act = F.silu(pre[:, :ffn]) * pre[:, ffn:]
        out[start : start + size] = F.linear(act, down[expert])
        start += size
    return out


def grouped_swiglu_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: torch.Tensor,
    *,
    capacity: int | None = None,
    index: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    top_k: int = 1,
) -> torch.Tensor:
    """Every expert's SwiGLU MLP on its rows, in grouped Triton GEMMs (no host sync).

    Expert ``e`` owns ``counts[e]`` rows: consecutive groups (``capacity=None``, dropless
    routing), or the first ``counts[e]`` of its ``capacity`` rows ``e * capacity ...``
    (drop-and-pad; the padding rows are skipped, not multiplied, and come out zero).

    Args:
        x: ``[M, H]`` rows; or, with ``index``, the ``[T, H]`` tokens, read through the
            permutation (row ``r`` is token ``index[r] // top_k``).
        gate_up: ``[E, 2F, H]`` gate projection rows then up projection rows of every expert
            (``nn.Linear`` layout).
        down: ``[E, H, F]`` down projections.
        counts: ``[E]`` integer rows used by each expert (on the device of ``x``).
        capacity: Rows reserved per expert (``M = E * capacity``), or None (``M`` is the sum
            of ``counts``).
        index: ``[M]`` int64 routing assignment of each row (any value in padding rows), or
            None.
        slots: ``[T * top_k]`` int64 row of each assignment, -1 when dropped (the inverse of
            ``index``); required with ``index``, for the input gradient.
        top_k: Assignments per token (with ``index``).

    Returns:
        ``[M, H]`` expert outputs in row order.

    Raises:
        KernelShapeError: If the shapes do not match.
        KernelDtypeError: If the dtypes differ or an index is not int64.
        KernelDeviceError: If the tensors are not on one device.
    """
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)}, gate_up.shape={tuple(gate_up.shape)}, "
            f"down.shape={tuple(down.shape)} must be [rows, H], [E, 2F, H], [E, H, F]"
        )
    experts, two_ffn, hidden = gate_up.shape
    if (
        x.shape[1] != hidden
        or two_ffn % 2
        or tuple(down.shape) != (experts, hidden, two_ffn // 2)
        or tuple(counts.shape) != (experts,)
    ):
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)}, gate_up.shape={tuple(gate_up.shape)}, "
            f"down.shape={tuple(down.shape)}, counts.shape={tuple(counts.shape)}: expected "
            "[rows, H], [E, 2F, H], [E, H, F], [E]"
        )
    if x.dtype != gate_up.dtype or x.dtype != down.dtype:
        raise KernelDtypeError(
            f"x.dtype={x.dtype}, gate_up.dtype={gate_up.dtype}, down.dtype={down.dtype} must match"
        )
    tensors = [t for t in (gate_up, down, counts, index, slots) if t is not None]
    if any(t.device != x.device for t in tensors):
        raise KernelDeviceError(
            f"x is on {x.device} but gate_up, down, counts, index, slots are on "
            f"{[str(t.device) for t in tensors]}: expected one device"
        )
    if capacity is not None and capacity < 0:
        raise KernelShapeError(f"capacity={capacity} must be >= 0")
    if index is not None:
        if index.dim() != 1 or index.dtype != torch.int64:
            raise KernelDtypeError(
                f"index must be a 1-D int64 tensor, got shape {tuple(index.shape)} and dtype "
                f"{index.dtype}"
            )
        if slots is None or slots.dtype != torch.int64 or slots.numel() != x.shape[0] * top_k:
            raise KernelShapeError(
                f"slots must be a [{x.shape[0] * top_k}] int64 tensor with index, got "
                f"{None if slots is None else (tuple(slots.shape), slots.dtype)}"
            )
    num_rows = x.shape[0] if index is None else index.shape[0]
    if capacity is not None and num_rows != experts * capacity:
        raise KernelShapeError(
            f"{num_rows} rows with capacity={capacity} and {experts} experts: expected "
            f"{experts * capacity}"
        )
    if not use_triton(x, gate_up, down):
        return grouped_swiglu_mlp_reference(
            x, gate_up, down, counts, capacity=capacity, index=index, top_k=top_k
        )
    starts, ends = _row_groups(counts, capacity)
    apply = GroupedSwiGLUMLPFunction.apply
    if _compile.compiling():
        apply = torch.ops.mcore_kernels.moe_grouped_swiglu_mlp
    return apply(
        x.contiguous(),
        gate_up.contiguous(),
        down.contiguous(),
        starts,
        ends,
        num_rows,
        index,
        slots,
        top_k,
        capacity is not None,
    )
