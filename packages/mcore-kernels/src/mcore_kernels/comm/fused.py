"""``fused_rs_add_rmsnorm_ag``: the public entry point and the choice of its path."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_kernels import _compile
from mcore_kernels.comm._validation import check_fused_args
from mcore_kernels.comm.availability import (
    log_fallback_once,
    symmetric_memory_unavailable_reason,
)
from mcore_kernels.comm.fallback import rs_add_rmsnorm_ag_collectives

__all__ = ["fused_rs_add_rmsnorm_ag"]


def fused_rs_add_rmsnorm_ag(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group: dist.ProcessGroup | None,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the tensor-parallel partials, add the residual, RMS-normalise, on every rank.

    On CUDA tensors of an NCCL group whose ranks share a host, Triton kernels read the peers'
    partial sums through symmetric memory (one-shot for small token counts, two-shot for larger
    ones); otherwise (CPU and gloo, several hosts, no symmetric memory in this torch) the
    collective sequence runs and the reason is logged once at INFO level on the
    ``mcore_kernels.comm`` logger. Symmetric buffers are allocated at the first call for a
    (group, dtype, hidden) and reused; that first call is collective and must not happen during
    CUDA graph capture, later calls with at most as many tokens are capturable.

    The result equals ``reduce_scatter(partial) -> + residual -> rms_norm -> all_gather``: for
    every token ``h = sum_over_ranks(partial) + residual`` (the sum rounded to the input dtype,
    then the add rounded to it, as :func:`mcore_kernels.rms_norm` does) and
    ``y = h * rsqrt(mean(h**2) + eps) * weight`` computed in float32.

    Under ``torch.compile`` the call is the opaque custom op
    ``torch.ops.mcore_kernels.fused_rs_add_rmsnorm_ag`` (the group travels by name; ``out`` is
    filled by a copy after it): inference only, no backward.

    Args:
        partial: ``[tokens, hidden]``, this rank's partial output of a row-parallel matmul; the
            true activation is the sum of ``partial`` over the ranks of ``group``. float16,
            bfloat16 or float32.
        residual: ``[tokens, hidden]``, the full residual stream (every token, every hidden
            unit), identical on every rank of ``group``, same dtype as ``partial``. Not modified
            unless passed as ``out[1]``.
        weight: ``[hidden]`` RMSNorm scale.
        eps: added to the mean square before the reciprocal square root.
        group: the tensor-parallel process group; None means the default group.
        out: optional pair ``(normed_out, residual_out)`` of ``[tokens, hidden]`` tensors of the
            input dtype written in place; ``residual_out`` may be ``residual`` itself.

    Returns:
        ``(normed, new_residual)``: ``normed`` is the RMS-normalised activation of all tokens
        (the input of the next layer) and ``new_residual`` is ``sum + residual`` for all tokens,
        both ``[tokens, hidden]`` in the input dtype and identical on every rank.

    Raises:
        KernelDtypeError: a tensor argument is not a tensor or has an unsupported dtype.
        KernelShapeError: shapes do not line up.
        KernelDeviceError: tensors live on different devices.
        KernelValueError: ``eps`` out of range, ``group`` not a process group, or
            torch.distributed not initialised.
    """
    pair = check_fused_args(partial, residual, weight, eps, group, out)
    if _compile.compiling():
        normed, new_residual = _fused_op(
            partial, residual, weight, float(eps), _compile.group_name(group)
        )
        if pair is None:
            return normed, new_residual
        pair[0].copy_(normed)
        pair[1].copy_(new_residual)
        return pair
    return _fused_run(partial, residual, weight, eps, group, pair)


def _fused_run(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group: dist.ProcessGroup | None,
    pair: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    reason = symmetric_memory_unavailable_reason(partial, group)
    if reason is None:
        # Imported here: it needs Triton, which CPU-only installs may lack.
        from mcore_kernels.comm.symmetric import get_workspace, symmetric_rs_add_rmsnorm_ag

        workspace = get_workspace(group, partial)
        if not isinstance(workspace, str):
            return symmetric_rs_add_rmsnorm_ag(
                partial, residual, weight, float(eps), workspace, out=pair
            )
        reason = workspace
    log_fallback_once(reason)
    return rs_add_rmsnorm_ag_collectives(partial, residual, weight, float(eps), group, pair)


@_compile.custom_op(
    "fused_rs_add_rmsnorm_ag",
    "(Tensor partial, Tensor residual, Tensor weight, float eps, str group_name) -> (Tensor, Tensor)",
)
def _fused_op(
    partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fused_run(partial, residual, weight, eps, _compile.resolve_group(group_name), None)


_fused_op.register_fake(
    lambda partial, *args: (partial.new_empty(partial.shape), partial.new_empty(partial.shape))
)
