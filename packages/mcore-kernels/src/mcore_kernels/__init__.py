"""mcore-kernels: Triton kernels, each with a torch reference of the same signature."""

from mcore_kernels import comm, reference, tensor_ops
from mcore_kernels._version import __version__
from mcore_kernels.errors import (
    KernelBackendError,
    KernelDeviceError,
    KernelDtypeError,
    KernelError,
    KernelShapeError,
    KernelValueError,
)
from mcore_kernels.rms_norm import RMSNorm, rms_norm
from mcore_kernels.token_logprobs import token_logprobs

__all__ = [
    "__version__",
    "rms_norm",
    "RMSNorm",
    "token_logprobs",
    "reference",
    "tensor_ops",
    "comm",
    "KernelError",
    "KernelShapeError",
    "KernelDtypeError",
    "KernelDeviceError",
    "KernelBackendError",
    "KernelValueError",
]
