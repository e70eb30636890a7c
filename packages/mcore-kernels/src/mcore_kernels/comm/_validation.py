"""Argument checks of the fused tensor-parallel communication ops.

Every check runs before the first collective, on values that are identical on every rank of a
correct program, so a bad call raises on every rank instead of leaving peers blocked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_kernels._compile import compiling
from mcore_kernels._validation import check_dtype, check_eps, check_tensor
from mcore_kernels.errors import (
    KernelDeviceError,
    KernelDtypeError,
    KernelShapeError,
    KernelValueError,
)

__all__ = ["COMM_DTYPES", "check_fused_args"]

COMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Activation dtypes accepted by :func:`mcore_kernels.comm.fused_rs_add_rmsnorm_ag`."""


def check_fused_args(
    partial: object,
    residual: object,
    weight: object,
    eps: object,
    group: object,
    out: object,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validate the arguments of ``fused_rs_add_rmsnorm_ag``.

    Args:
        partial: this rank's ``[tokens, hidden]`` partial sum.
        residual: ``[tokens, hidden]`` residual of the same dtype and device.
        weight: ``[hidden]`` RMSNorm scale on the same device.
        eps: finite float ``>= 0``.
        group: a ``torch.distributed.ProcessGroup`` or None.
        out: None or a pair of ``[tokens, hidden]`` tensors of the input dtype.

    Returns:
        ``out`` as a tuple of two tensors, or None.

    Raises:
        KernelDtypeError: a tensor argument is not a tensor, or has an unsupported dtype.
        KernelShapeError: shapes do not line up.
        KernelDeviceError: tensors live on different devices.
        KernelValueError: ``eps`` is negative or not finite, ``group`` is not a process group,
            or torch.distributed is not initialised.
    """
    partial = check_tensor("partial", partial)
    residual = check_tensor("residual", residual)
    weight = check_tensor("weight", weight)
    check_dtype("partial", partial, COMM_DTYPES)
    if partial.dim() != 2 or partial.shape[0] == 0 or partial.shape[1] == 0:
        raise KernelShapeError(
            f"partial.shape={tuple(partial.shape)} must be a non-empty [tokens, hidden]"
        )
    if residual.dtype != partial.dtype:
        raise KernelDtypeError(
            f"residual.dtype={residual.dtype} differs from partial.dtype={partial.dtype}"
        )
    if residual.shape != partial.shape:
        raise KernelShapeError(
            f"residual.shape={tuple(residual.shape)} must equal "
            f"partial.shape={tuple(partial.shape)} (the full residual on every rank)"
        )
    check_dtype("weight", weight, COMM_DTYPES)
    if weight.dim() != 1 or weight.shape[0] != partial.shape[1]:
        raise KernelShapeError(
            f"weight.shape={tuple(weight.shape)} does not match "
            f"partial.shape={tuple(partial.shape)}; expected ({partial.shape[1]},)"
        )
    for name, tensor in (("residual", residual), ("weight", weight)):
        if tensor.device != partial.device:
            raise KernelDeviceError(
                f"{name} is on {tensor.device} but partial is on {partial.device}"
            )
    check_eps(eps)
    pair = None if out is None else _check_out(out, partial)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise KernelValueError(
            f"group={group!r} must be a torch.distributed.ProcessGroup or None (the default group)"
        )
    if not dist.is_initialized():
        raise KernelValueError(
            "group: torch.distributed is not initialised; call init_process_group first"
        )
    return pair


def _check_out(out: object, partial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise KernelShapeError(
            f"out={type(out).__name__} must be None or a pair (normed_out, residual_out)"
        )
    pair = (check_tensor("out[0]", out[0]), check_tensor("out[1]", out[1]))
    for index, tensor in enumerate(pair):
        if tensor.shape != partial.shape or tensor.dtype != partial.dtype:
            raise KernelShapeError(
                f"out[{index}] is {tuple(tensor.shape)} {tensor.dtype}; expected "
                f"{tuple(partial.shape)} {partial.dtype} like partial"
            )
        if tensor.device != partial.device:
            raise KernelDeviceError(
                f"out[{index}] is on {tensor.device} but partial is on {partial.device}"
            )
    # Dynamo cannot trace data_ptr(); while it traces, the same tensor object stands for it.
    same = pair[0] is pair[1] if compiling() else pair[0].data_ptr() == pair[1].data_ptr()
    if same:
        raise KernelValueError("out[0] and out[1] must be different tensors, got the same memory")
    return pair
