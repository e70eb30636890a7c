"""Error types of mcore-kernels.

Every error raised on bad input derives from :class:`KernelError` and from the builtin
exception a caller would expect (``ValueError``, ``TypeError`` ...), so both ``except KernelError``
and ``except ValueError`` work.
"""

from __future__ import annotations

__all__ = [
    "KernelError",
    "KernelShapeError",
    "KernelDtypeError",
    "KernelDeviceError",
    "KernelBackendError",
    "KernelValueError",
]


class KernelError(Exception):
    """Base class of every error raised by mcore-kernels."""


class KernelShapeError(KernelError, ValueError):
    """A tensor argument has the wrong shape."""


class KernelDtypeError(KernelError, TypeError):
    """A tensor argument has an unsupported dtype."""


class KernelDeviceError(KernelError, ValueError):
    """Tensor arguments live on unsupported or mismatched devices."""


class KernelBackendError(KernelError, RuntimeError):
    """The requested kernel backend cannot run here."""


class KernelValueError(KernelError, ValueError):
    """An argument has a value outside its valid range (a target id, a temperature ...)."""
