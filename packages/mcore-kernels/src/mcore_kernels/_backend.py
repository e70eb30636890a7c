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
from collections.abc import Callable

import torch

from mcore_kernels.errors import KernelBackendError

__all__ = ["BACKEND_ENV", "backend_forced", "selected_backend", "use_triton"]

BACKEND_ENV = "MCORE_KERNELS_BACKEND"
"""Name of the environment variable that forces a backend."""

_BACKENDS = ("torch", "triton")

# ``os.environ.get`` encodes the key and decodes the value on every call (about 1 us, a
# measurable part of a one-row launch). ``os.environ`` keeps its variables in the mapping
# ``_data`` under encoded keys and updates it on every assignment and deletion (``putenv``
# bypasses both): a lookup there sees the same values for a twentieth of the cost.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY: object = BACKEND_ENV
if _ENV_DATA is not None:
    try:
        _ENV_KEY = os.environ.encodekey(BACKEND_ENV)  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover - another Python's os.environ layout
        _ENV_DATA = None


# ``backend_forced()``: the variable's value when set (a C-level call, no Python frame: the
# one-row hot paths read it on every call).
backend_forced: Callable[[], object] = (
    functools.partial(_ENV_DATA.get, _ENV_KEY)
    if _ENV_DATA is not None
    else functools.partial(os.environ.get, BACKEND_ENV)
)


def _backend_set() -> bool:
    """Whether ``MCORE_KERNELS_BACKEND`` is set to a non-empty value."""
    if _ENV_DATA is not None:
        return bool(_ENV_DATA.get(_ENV_KEY))
    return bool(os.environ.get(BACKEND_ENV))


# Looked up once at import: ``torch.compile`` traces the dispatch decision, and Dynamo refuses to
# trace ``importlib.util.find_spec`` (a graph break in ``moe.routed_experts`` on CUDA).
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def _triton_available() -> bool:
    return _TRITON_FOUND


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
    if not _backend_set():
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
