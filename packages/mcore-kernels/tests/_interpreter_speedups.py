"""Take two repeated, result-free costs out of the Triton interpreter (``TRITON_INTERPRET=1``).

The kernels run their programs one by one in Python on CPU, and two pieces of bookkeeping ran
again on every step (measured with cProfile over ``test_kernels_rms_norm.py``: a fifth and an
eighth of the file's time):

* each call of a ``@triton.jit`` helper from inside a kernel program re-patched the whole
  ``triton.language`` namespace (``inspect.getmembers`` over it, 70 000 times in that file),
  although the launch that runs the program has already patched the same modules and only
  restores them when the launch ends. Here such a nested call skips that no-op re-patching;
  a helper that sees a language module the launch did not patch still patches it.
* the Triton-to-numpy dtype lookup built its table on every call; here it is memoised.

Nothing a kernel computes changes: the helper runs the same rewritten function under the same
patches. If the interpreter's internals differ from what this expects, nothing is installed.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


def install() -> bool:
    """Installs both shortcuts into ``triton.runtime.interpreter``.

    Returns:
        Whether they were installed (False when the interpreter lacks the expected internals).
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    needed = ("_get_np_dtype", "GridExecutor", "InterpretedFunction", "InterpreterError")
    if not all(hasattr(interpreter, name) for name in needed):
        return False
    if getattr(interpreter, "_mcore_speedups", False):
        return True

    def languages(fn: Any) -> frozenset[int]:
        # The modules _patch_lang(fn) patches: triton.language or triton.language.core.
        return frozenset(
            id(value)
            for value in fn.__globals__.values()
            if inspect.ismodule(value) and value in (tl, tl.core)
        )

    patched: list[frozenset[int]] = []  # the languages of the launch now running, if any
    grid_call = interpreter.GridExecutor.__call__
    device_call = interpreter.InterpretedFunction.__call__

    @functools.wraps(grid_call)
    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched.append(languages(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    @functools.wraps(device_call)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        helper = languages(self.fn)
        if not patched or not helper or not helper <= patched[-1]:
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as error:
            raise interpreter.InterpreterError(repr(error)) from error

    lookup = interpreter._get_np_dtype
    cached = functools.lru_cache(maxsize=None)(lookup)

    @functools.wraps(lookup)
    def np_dtype(tt_dtype: Any) -> Any:
        try:
            return cached(tt_dtype)
        except TypeError:  # an unhashable dtype: look it up as before
            return lookup(tt_dtype)

    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = call
    interpreter._get_np_dtype = np_dtype
    interpreter._mcore_speedups = True
    return True
