"""Which Triton kernel specialisations a piece of code launches, and which it compiles.

Triton compiles a kernel once per specialisation and looks the binary up under it at each launch:
each tensor argument's dtype and 16-byte alignment, each int argument's type, ``== 1`` and
``% 16 == 0`` (unless the kernel lists it in ``do_not_specialize``), the constexpr values and the
launch options (warps, stages, programmatic dependent launch). A launch under a key not seen
before compiles, 0.1 to 1 s during which the caller waits: a server must see none after its
warm-up. :class:`SpecializationLog` records

- on a GPU, every compile (Triton's JIT cache hook, which runs before each compile);
- under the interpreter (``TRITON_INTERPRET=1``, which compiles nothing), the key of every
  launch, computed with Triton's own argument binder, so a CPU test can assert that the keys
  after a warm-up are among those of the warm-up.
"""

from __future__ import annotations

from typing import Any

from mcore_kernels._triton_utils import triton

__all__ = ["SpecializationLog"]


def _hashable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return repr(value)


class SpecializationLog:
    """Context manager recording Triton launches' specialisation keys and compiles.

    Attributes:
        keys: ``(kernel name, argument specialisation, launch options)`` of every interpreted
            launch while active.
        launches: Number of interpreted launches while active.
        compiles: ``(kernel name, Triton's description of the specialisation)`` of every
            kernel compiled while active (GPU).

    Raises:
        KernelBackendError: On entry, if Triton is not installed.
    """

    def __init__(self) -> None:
        self.keys: set[tuple] = set()
        self.launches = 0
        self.compiles: list[tuple[str, str]] = []
        self._binders: dict[int, Any] = {}
        self._restore: list[tuple[Any, str, Any]] = []

    def key(self, function: Any, args: tuple, kwargs: dict[str, Any]) -> tuple:
        """The specialisation key of the interpreted launch ``function[grid](*args, **kwargs)``.

        Args:
            function: A kernel defined under ``TRITON_INTERPRET=1`` (an interpreted function).
            args: Its positional arguments.
            kwargs: Its keyword arguments (constexprs and launch options).

        Returns:
            ``(name, specialisation, options)``, hashable.
        """
        binder = self._binders.get(id(function))
        if binder is None:
            from triton.backends.compiler import BaseBackend
            from triton.runtime.jit import JITFunction, create_function_from_signature

            options = {
                name: function.kwargs[name]
                for name in ("do_not_specialize", "do_not_specialize_on_alignment")
                if function.kwargs.get(name)
            }
            # The compiled path's binder, over the same function and options.
            shadow = JITFunction(function.fn, **options)
            binder = create_function_from_signature(shadow.signature, shadow.params, BaseBackend)
            self._binders[id(function)] = binder
        _, specialization, options = binder(*args, **kwargs)
        return (
            function.fn.__qualname__,
            _hashable(specialization),
            tuple(sorted((name, _hashable(value)) for name, value in options.items())),
        )

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> SpecializationLog:
        if triton is None:
            from mcore_kernels.errors import KernelBackendError

            raise KernelBackendError("SpecializationLog needs triton, which is not installed")
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        try:
            from triton import knobs

            hooks, hook_name = knobs.runtime, "jit_cache_hook"
        except ImportError:  # Triton before 3.4: the hook is a class attribute
            hooks, hook_name = JITFunction, "cache_hook"

        log = self
        run = InterpretedFunction.run

        def interpreted_run(
            function: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any
        ) -> Any:
            log.keys.add(log.key(function, args, kwargs))
            log.launches += 1
            return run(function, *args, grid=grid, warmup=warmup, **kwargs)

        previous = getattr(hooks, hook_name)

        def compile_hook(**kwargs: Any) -> Any:
            fn = kwargs.get("fn")
            log.compiles.append((str(getattr(fn, "name", fn)), str(kwargs.get("repr", ""))))
            return previous(**kwargs) if previous is not None else False

        self._patch(InterpretedFunction, "run", interpreted_run)
        self._patch(hooks, hook_name, compile_hook)
        return self

    def __exit__(self, *exc_info: object) -> None:
        while self._restore:
            owner, name, value = self._restore.pop()
            setattr(owner, name, value)
