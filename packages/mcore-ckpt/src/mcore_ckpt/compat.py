"""Loading pickles whose classes were renamed, moved or removed since they were written.

Checkpoints outlive code. A checkpoint's pickled parts (the storage metadata of
torch.distributed.checkpoint and any Python objects of the state dict) name classes by module
path; when a later release renames or drops such a class, plain unpickling fails. Megatron-Core
users met this when ``MCoreMetadata``/``MCoreSavePlan`` subclasses stored in the storage metadata
stopped matching newer code. Every unpickling in mcore-ckpt goes through :class:`RemapUnpickler`,
which looks each class up in a rename table first and otherwise fails with a message saying how
to register the replacement.

The same unpickler also reconciles DCP's ``TensorProperties`` across torch releases: its pickled
state is a tuple whose length grows when torch adds a field (torch 2.15 appended ``strides`` to
the five fields of earlier releases), and each release's ``__setstate__`` unpacks only the
lengths it knows, so storage metadata written by a newer torch would not load on an older one.
"""

from __future__ import annotations

import functools
import importlib
import pickle
import threading
from typing import IO, Any

from torch.distributed.checkpoint.metadata import TensorProperties

from mcore_ckpt.errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointTypeError,
    CheckpointVersionError,
)

__all__ = [
    "RemapUnpickler",
    "register_class_rename",
    "unregister_class_rename",
    "class_renames",
    "load_pickle",
    "remap_pickle_module",
]

_LOCK = threading.Lock()
_RENAMES: dict[tuple[str, str], tuple[str, str] | type] = {}


def _split(path: str, argument: str) -> tuple[str, str]:
    module, _, name = path.rpartition(".")
    if not module or not name:
        raise CheckpointConfigError(
            f"{argument}={path!r} must be a dotted path 'package.module.ClassName'"
        )
    return module, name


def register_class_rename(old: str, new: str | type) -> None:
    """Makes pickles that name class ``old`` load as ``new``.

    Args:
        old: Dotted path the pickle names, such as ``"mypkg.ckpt.MCoreMetadata"``.
        new: The class to use instead, or its dotted path.

    Raises:
        CheckpointConfigError: If a path is not of the form ``package.module.ClassName``.
        CheckpointTypeError: If ``new`` is neither a string nor a class.
    """
    key = _split(old, "old")
    if isinstance(new, str):
        target: tuple[str, str] | type = _split(new, "new")
    elif isinstance(new, type):
        target = new
    else:
        raise CheckpointTypeError(f"new={new!r} must be a class or a dotted path string")
    with _LOCK:
        _RENAMES[key] = target


def unregister_class_rename(old: str) -> None:
    """Removes a rename registered with :func:`register_class_rename` (no-op if absent).

    Args:
        old: The dotted path given as ``old`` when registering.
    """
    with _LOCK:
        _RENAMES.pop(_split(old, "old"), None)


def class_renames() -> dict[str, str]:
    """Lists the registered renames.

    Returns:
        Old dotted path to new dotted path.
    """
    with _LOCK:
        items = list(_RENAMES.items())
    out = {}
    for (module, name), target in items:
        new = (
            f"{target.__module__}.{target.__qualname__}"
            if isinstance(target, type)
            else ".".join(target)
        )
        out[f"{module}.{name}"] = new
    return out


# dtype, layout, requires_grad, memory-format code and pin_memory: the state of every torch
# release this package supports, in this order; later releases only append fields.
_TENSOR_PROPERTIES_CORE_FIELDS = 5


@functools.cache
def _local_tensor_properties_state() -> tuple[Any, ...]:
    return tuple(TensorProperties().__getstate__())


def _fit_tensor_properties_state(state: Any) -> tuple[Any, ...]:
    """Cuts or pads a pickled ``TensorProperties`` state to the length this torch unpacks."""
    if not isinstance(state, tuple) or len(state) < _TENSOR_PROPERTIES_CORE_FIELDS:
        raise CheckpointCorruptError(
            f"state={state!r} of a pickled TensorProperties: expected a tuple of at least "
            f"{_TENSOR_PROPERTIES_CORE_FIELDS} fields (dtype, layout, requires_grad, memory "
            f"format, pin_memory)"
        )
    local = _local_tensor_properties_state()
    # Fields appended by a newer torch are dropped: this torch's DCP cannot use them, and the
    # only one so far (strides) adds nothing for the contiguous chunks that mcore-ckpt stores.
    # Fields this torch appended take their defaults, as for a checkpoint of an older torch.
    return state[: len(local)] + local[len(state) :]


class _TensorPropertiesOfAnyTorch(TensorProperties):
    """Unpickles into a plain ``TensorProperties`` from the state of any torch release."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        fitted = _fit_tensor_properties_state(state)
        # The object becomes the exact DCP class, so that type checks, comparisons and any
        # later pickling treat it as one that this torch wrote.
        self.__class__ = TensorProperties  # type: ignore[assignment]
        TensorProperties.__setstate__(self, fitted)


class RemapUnpickler(pickle.Unpickler):
    """An unpickler that resolves classes through the rename table.

    Args:
        file: Binary file to read the pickle from.
        **kwargs: Passed to :class:`pickle.Unpickler`.
    """

    def __init__(self, file: IO[bytes], **kwargs: Any) -> None:
        super().__init__(file, **kwargs)

    def find_class(self, module: str, name: str) -> Any:
        """Returns the class a pickle names, after applying registered renames.

        Args:
            module: Module path stored in the pickle.
            name: Qualified name stored in the pickle.

        Returns:
            The class (or function) to use; DCP's ``TensorProperties`` comes back as a
            stand-in that accepts the pickled state of any torch release and turns into a
            plain ``TensorProperties``.

        Raises:
            CheckpointVersionError: If the class cannot be found and no rename is registered.
        """
        with _LOCK:
            target = _RENAMES.get((module, name))
        if isinstance(target, type):
            found = target
        else:
            if target is not None:
                module, name = target
            try:
                found = super().find_class(module, name)
            except (ImportError, AttributeError) as error:
                raise CheckpointVersionError(
                    f"the checkpoint refers to class {module}.{name}, which this environment "
                    f"cannot import ({error}); it was renamed or removed since the checkpoint "
                    f"was written. Register its replacement before loading: "
                    f"mcore_ckpt.register_class_rename({f'{module}.{name}'!r}, NewClass)"
                ) from error
        return _TensorPropertiesOfAnyTorch if found is TensorProperties else found


def load_pickle(file: IO[bytes], **kwargs: Any) -> Any:
    """Unpickles one object through :class:`RemapUnpickler`.

    Args:
        file: Binary file positioned at the pickle.
        **kwargs: Passed to :class:`pickle.Unpickler` (``encoding`` ...).

    Returns:
        The unpickled object.
    """
    return RemapUnpickler(file, **kwargs).load()


class _RemapPickleModule:
    """Stands in for the ``pickle`` module in ``torch.load(pickle_module=...)``."""

    Unpickler = RemapUnpickler
    Pickler = pickle.Pickler
    UnpicklingError = pickle.UnpicklingError
    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL
    dump = staticmethod(pickle.dump)
    dumps = staticmethod(pickle.dumps)
    load = staticmethod(load_pickle)

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("pickle"), name)


remap_pickle_module = _RemapPickleModule()
"""A ``pickle``-like module whose unpickler applies the renames, for ``torch.load``."""
