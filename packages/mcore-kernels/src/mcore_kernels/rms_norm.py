"""Fused residual add + RMSNorm: the public function and the ``RMSNorm`` module."""

from __future__ import annotations

import torch
from torch import nn

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._rms_norm_op import rms_norm_via_op
from mcore_kernels._validation import check_rms_norm_args
from mcore_kernels.errors import KernelValueError
from mcore_kernels.reference import rms_norm_reference

__all__ = ["rms_norm", "RMSNorm"]


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm, differentiable in ``x``, ``weight`` and ``residual``.

    ``h = x + residual`` is computed and returned in the input dtype (as Hugging Face models
    do); the normalisation ``h * rsqrt(mean(h**2) + eps) * weight`` runs in float32 and is cast
    once to the dtype of ``x``. Runs the Triton kernel on CUDA tensors and the torch reference
    on CPU tensors (see ``MCORE_KERNELS_BACKEND``). Each row's result is bitwise independent of
    the number of rows. Under ``torch.compile`` the call is the opaque custom op
    ``torch.ops.mcore_kernels.rms_norm_fwd`` (with a registered backward), so it compiles with
    ``fullgraph=True``.

    Args:
        x: ``[..., hidden]`` input, float16, bfloat16 or float32 (float64 on the reference).
        weight: ``[hidden]`` scale.
        eps: added to the mean square before the reciprocal square root.
        residual: optional tensor shaped like ``x`` (same dtype) added to ``x`` first.

    Returns:
        ``y`` shaped like ``x``; with ``residual``, the pair ``(y, x + residual)``.

    Raises:
        KernelDtypeError: unsupported dtypes or a residual dtype different from ``x``.
        KernelShapeError: ``weight`` or ``residual`` do not match ``x``.
        KernelDeviceError: tensors on different devices.
        KernelValueError: ``eps`` negative or not finite.
        KernelBackendError: ``MCORE_KERNELS_BACKEND`` asks for a backend that cannot run.
    """
    check_rms_norm_args(x, weight, eps, residual)
    if _compile.compiling():
        if _compile.CUSTOM_OPS:
            return rms_norm_via_op(x, weight, eps, residual)
        return _compile.run_eagerly(_rms_norm_eager, x, weight, eps, residual)
    return _rms_norm_eager(x, weight, eps, residual)


def _rms_norm_eager(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if x.dtype != torch.float64 and use_triton(*tensors):
        from mcore_kernels._rms_norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual=residual)
    return rms_norm_reference(x, weight, eps, residual=residual)


class RMSNorm(nn.Module):
    """RMSNorm layer with an optional fused residual add.

    The parameter is named ``weight`` (initialised to ones) like Hugging Face's ``LlamaRMSNorm``,
    so its state dict loads from Hugging Face checkpoints unchanged.

    Args:
        hidden_size: size of the normalised last dimension.
        eps: added to the mean square before the reciprocal square root.
        dtype: dtype of ``weight`` (default: torch's default dtype).
        device: device of ``weight``.

    Raises:
        KernelValueError: ``hidden_size`` is not a positive int or ``eps`` is negative.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise KernelValueError(f"hidden_size={hidden_size!r} must be a positive int")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise KernelValueError(f"eps={eps!r} must be a number >= 0")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` (after adding ``residual`` when given).

        Args:
            x: ``[..., hidden_size]`` input.
            residual: optional tensor shaped like ``x``.

        Returns:
            ``y``; with ``residual``, the pair ``(y, x + residual)``.
        """
        return rms_norm(x, self.weight, self.eps, residual=residual)

    def extra_repr(self) -> str:
        """Return the printed summary of the layer.

        Returns:
            ``"hidden_size, eps=..."``.
        """
        return f"{self.hidden_size}, eps={self.eps}"
