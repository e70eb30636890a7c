"""Choice between the Triton kernels and the torch references.

Triton runs on CUDA tensors and the torch reference on CPU tensors. The environment variable
``MCORE_KERNELS_BACKEND`` (``torch`` or ``triton``) overrides the choice; with ``triton`` and
``TRITON_INTERPRET=1`` the Triton kernels run on CPU tensors through the Triton interpreter, which
is how the test suite checks them without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from mcore_kernels.errors import KernelBackendError

__all__ = ["BACKEND_ENV", "selected_backend", "use_triton"]

BACKEND_ENV = "MCORE_KERNELS_BACKEND"
"""Name of the environment variable that forces a backend."""

_BACKENDS = ("torch", "triton")


@functools.lru_cache(maxsize=1)
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip() == "1"


def selected_backend() -> str | None:
    """Return the backend forced through ``MCORE_KERNELS_BACKEND``, if any.

    Returns:
        ``"torch"``, ``"triton"`` or ``None`` when the variable is unset or empty.

    Raises:
        KernelBackendError: the variable holds another value.
    """
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not value:
        return None
    if value not in _BACKENDS:
        raise KernelBackendError(
            f"{BACKEND_ENV}={value!r} is not a backend; expected one of {_BACKENDS}"
        )
    return value


def use_triton(*tensors: torch.Tensor) -> bool:
    """Decide whether the Triton kernel should handle these tensors.

    Args:
        *tensors: the tensor arguments of the kernel call (all on one device, as the callers'
            argument checks ensure; only the first is looked at).

    Returns:
        True to launch the Triton kernel, False to run the torch reference.

    Raises:
        KernelBackendError: ``MCORE_KERNELS_BACKEND=triton`` was requested but Triton is not
            installed, or the tensors are on the CPU without ``TRITON_INTERPRET=1``.
    """
    on_cuda = tensors[0].is_cuda
    if not os.environ.get(BACKEND_ENV):
        # The common case, kept to two attribute reads and one dictionary lookup.
        return on_cuda and _triton_available()
    backend = selected_backend()
    if backend == "torch":
        return False
    if backend == "triton":
        if not _triton_available():
            raise KernelBackendError(
                f"{BACKEND_ENV}=triton but the triton package is not installed"
            )
        if not on_cuda and not _interpreting():
            raise KernelBackendError(
                f"{BACKEND_ENV}=triton with tensors on {tensors[0].device}: Triton needs CUDA "
                "tensors or TRITON_INTERPRET=1 to run on the CPU"
            )
        return True
    return on_cuda and _triton_available()
