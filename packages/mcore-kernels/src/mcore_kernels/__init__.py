"""mcore-kernels: Triton kernels, each with a torch reference of the same signature."""

from mcore_kernels._version import __version__
from mcore_kernels.errors import (
    KernelBackendError,
    KernelDeviceError,
    KernelDtypeError,
    KernelError,
    KernelShapeError,
)

__all__ = [
    "__version__",
    "KernelError",
    "KernelShapeError",
    "KernelDtypeError",
    "KernelDeviceError",
    "KernelBackendError",
]
