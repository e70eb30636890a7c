"""Grouped SwiGLU expert MLP on persistent TMA grouped GEMMs (Hopper and newer).

The rows arrive already in expert order (the token permutation is a separate kernel), the
group ends stay on the device, and four kernels (:mod:`mcore_kernels.moe._grouped_gemm_tma`)
do a forward + backward pass:

- gate/up projection as one GEMM with SwiGLU (optionally scaled by each row's routing weight)
  in its epilogue, saving the gate/up product for the backward pass;
- down projection;
- the down projection's input gradient with the SwiGLU backward in its epilogue (and each
  column tile's share of the row-weight gradients, summed afterwards in a fixed order);
- per-expert weight gradients (zero for an expert without rows) and the input gradient.

No atomics: bitwise reproducible. Rows and weights must be 2-byte dtypes or float32 with
16-byte aligned rows (the tensor descriptors' requirement).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels.errors import KernelDeviceError, KernelShapeError
from mcore_kernels.moe.grouped_gemm import GroupedTiles

__all__ = ["grouped_swiglu_mlp_tma", "tma_grouped_supported"]

ROW_TILES = GroupedTiles(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
"""Tiles of the plain row-tile GEMMs (down projection, input gradients)."""
SWIGLU_TILES = GroupedTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
"""Tiles of the GEMMs with a SwiGLU epilogue (two accumulators in the forward pass)."""
WEIGHT_GRAD_TILES = GroupedTiles(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
"""Tiles of the weight gradients: ``block_m`` x ``block_n`` outputs, ``block_k`` rows a step."""


def tma_grouped_supported(*tensors: torch.Tensor) -> bool:
    """Whether the TMA kernels take these tensors: the Triton backend selected for them (see
    :func:`mcore_kernels._backend.use_triton`: CUDA tensors, or CPU tensors through the
    interpreter), rows 16-byte aligned and a GPU of compute capability 9.0 or newer.

    Args:
        *tensors: The operands (rows, weights).

    Returns:
        True when every tensor qualifies.
    """
    if not use_triton(*tensors):
        return False
    for tensor in tensors:
        if (tensor.shape[-1] * tensor.element_size()) % 16:
            return False
        if tensor.is_cuda and torch.cuda.get_device_capability(tensor.device)[0] < 9:
            return False
    return True


def _cfg(tiles: GroupedTiles) -> dict[str, Any]:
    return dict(
        bm=tiles.block_m,
        bn=tiles.block_n,
        bk=tiles.block_k,
        warps=tiles.num_warps,
        stages=tiles.num_stages,
    )


def _device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


class TMAGroupedSwiGLUMLPFunction(torch.autograd.Function):
    """Autograd wrapper of the TMA grouped SwiGLU MLP kernels."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        starts: torch.Tensor,
        ends: torch.Tensor,
        row_weights: torch.Tensor | None,
    ) -> torch.Tensor:
        from mcore_kernels.moe._grouped_gemm_tma import tma_rows

        with _device(x):
            act, pre = tma_rows(
                x,
                gate_up,
                starts,
                ends,
                kmajor=True,
                epilogue=1,
                row_weights=row_weights,
                **_cfg(SWIGLU_TILES),
            )
            out, _ = tma_rows(act, down, starts, ends, kmajor=True, **_cfg(ROW_TILES))
        ctx.save_for_backward(x, gate_up, down, starts, ends, pre, act, row_weights)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from mcore_kernels.moe._grouped_gemm_tma import tma_rows, tma_weight_grad

        x, gate_up, down, starts, ends, pre, act, row_weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        with _device(x):
            grad_pre, parts = tma_rows(
                grad,
                down,
                starts,
                ends,
                kmajor=False,
                epilogue=2,
                aux=pre,
                row_weights=row_weights,
                **_cfg(SWIGLU_TILES),
            )
            grad_down = tma_weight_grad(grad, act, starts, ends, **_cfg(WEIGHT_GRAD_TILES))
            grad_gate_up = tma_weight_grad(grad_pre, x, starts, ends, **_cfg(WEIGHT_GRAD_TILES))
            if ctx.needs_input_grad[0]:
                grad_x, _ = tma_rows(
                    grad_pre, gate_up, starts, ends, kmajor=False, **_cfg(ROW_TILES)
                )
        if row_weights is not None and parts is not None:
            grad_w = parts.sum(dim=1).to(row_weights.dtype)
        return grad_x, grad_gate_up, grad_down, None, None, grad_w


def grouped_swiglu_mlp_tma(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: torch.Tensor,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every expert's SwiGLU MLP on its consecutive rows, on TMA grouped GEMMs (no host sync).

    Args:
        x: ``[M, H]`` rows sorted by expert (``counts[e]`` rows of expert ``e``, in order).
        gate_up: ``[E, 2F, H]`` gate rows then up rows of every expert (``nn.Linear`` layout).
        down: ``[E, H, F]`` down projections.
        counts: ``[E]`` integer rows of each expert (on the device of ``x``).
        row_weights: ``[M]`` routing weight of each row, applied to its activation (before
            the down projection), or None.

    Returns:
        ``[M, H]`` expert outputs in row order.

    Raises:
        KernelShapeError: If the shapes do not match or the rows are not 16-byte aligned.
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
        or (row_weights is not None and tuple(row_weights.shape) != (x.shape[0],))
    ):
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)}, gate_up.shape={tuple(gate_up.shape)}, "
            f"down.shape={tuple(down.shape)}, counts.shape={tuple(counts.shape)}, "
            f"row_weights.shape={None if row_weights is None else tuple(row_weights.shape)}: "
            "expected [M, H], [E, 2F, H], [E, H, F], [E], [M]"
        )
    tensors = [t for t in (gate_up, down, counts, row_weights) if t is not None]
    if any(t.device != x.device for t in tensors):
        raise KernelDeviceError(
            f"x is on {x.device} but gate_up, down, counts, row_weights are on "
            f"{[str(t.device) for t in tensors]}: expected one device"
        )
    if not tma_grouped_supported(x, down):
        raise KernelShapeError(
            f"hidden={hidden} and ffn={two_ffn // 2} in {x.dtype} must give 16-byte aligned "
            "rows (and the GPU compute capability 9.0 or newer) for the TMA kernels"
        )
    counts = counts.to(torch.int32)
    ends = counts.cumsum(0, dtype=torch.int32)
    return TMAGroupedSwiGLUMLPFunction.apply(
        x.contiguous(),
        gate_up.contiguous(),
        down.contiguous(),
        ends - counts,
        ends,
        None if row_weights is None else row_weights.contiguous(),
    )
