"""Helpers shared by the Triton kernels: the optional import, devices, layouts, rounding.

Triton is a Linux-only dependency. The kernel modules define their kernels with :func:`jit`,
which is ``triton.jit`` where Triton is installed and leaves the function a plain (never called)
Python function elsewhere, so the package imports everywhere and the torch references run.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Hashable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a linux-only dependency
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover - no triton, or a release without host descriptors
    _TensorDescriptor = None

__all__ = [
    "CachedLauncher",
    "as_rows",
    "device_limits",
    "gdc_launch_dependents",
    "gdc_wait",
    "jit",
    "next_power_of_2",
    "on_device_of",
    "pdl_supported",
    "prefetch_l2",
    "rotate_half_rounded",
    "round_to",
    "tl",
    "triton",
]

_SAME_DEVICE = contextlib.nullcontext()


def jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Compile ``fn`` with ``triton.jit`` when Triton is installed, else return it unchanged.

    Args:
        fn: the kernel function (None to use ``jit(**options)`` as a decorator).
        **options: keyword arguments of ``triton.jit`` (``do_not_specialize`` ...).

    Returns:
        The Triton ``JITFunction``, or ``fn`` where Triton is missing.
    """
    if fn is None:
        return lambda inner: jit(inner, **options)
    return triton.jit(fn, **options) if triton is not None else fn


try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # pragma: no cover - no triton, or a release without grid dependency control
    _HAS_GDC = False

    @jit
    def gdc_wait():  # type: ignore[no-redef]
        """No-op stand-in: kernels call it only under programmatic dependent launch."""

    @jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        """No-op stand-in: kernels call it only under programmatic dependent launch."""


@jit
def prefetch_l2(addresses):
    """Request the 128-byte lines holding ``addresses`` (a tensor of pointers) into L2.

    A hint (``prefetch.global.L2``): it returns no data and changes no value; L2 is coherent,
    so a line written afterwards by another kernel is read correctly later. Inline PTX: CUDA
    only (never reached by the interpreter).
    """
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [addresses],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched with programmatic dependent launch.

    Under programmatic dependent launch a kernel's programs may start while the previous kernel
    on the stream still runs; the kernel calls ``gdc_wait()`` before it reads anything that
    kernel wrote. It needs a Hopper or newer GPU and a Triton with grid dependency control.

    Args:
        device: The tensors' device (the CPU, i.e. the interpreter, never supports it).

    Returns:
        True on a CUDA device of compute capability 9.0 or more with such a Triton.
    """
    if not _HAS_GDC or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


_INT32 = range(-(2**31), 2**31)


class CachedLauncher:
    """Launch a Triton kernel, skipping ``JITFunction.run``'s per-call work after the first call.

    ``kernel[grid](...)`` binds the arguments, reads the runtime settings, computes the
    specialisation key and looks the compiled kernel up on every call: tens of microseconds of
    Python on the slower hosts of GPU machines, more than a small kernel runs. The first call
    of every distinct specialisation goes through that path and keeps the compiled kernel; later
    calls rebuild only the specialisation (each tensor's dtype and 16-byte alignment, each
    int's ``== 1``, ``% 16`` and 32-bit range, the constexpr values and warps) and launch the
    binary on the current stream. A host tensor descriptor (``TensorDescriptor``) counts by its
    base's dtype, block shape and padding (what Triton specialises it on) and reaches the
    compiled launcher as it is (its launcher encodes the TMA descriptor). Tensors reach the compiled launcher as their device
    addresses (the integers already read for the alignment), which spares it one Python method
    call and one CUDA driver query (``cuPointerGetAttribute``) per tensor; the public entry
    points only launch on CUDA tensors of the current device. Launch hooks (profilers such as
    Proton) see only the first call. Should the compiled kernel's calling convention not be the
    expected one (another Triton release), the first fast call raises, and this launcher falls
    back for good to ``kernel[grid](...)``. Under ``TRITON_INTERPRET=1`` every call is
    interpreted.

    Args:
        fn: the ``@triton.jit`` kernel; its constexpr parameters must come after the others.
        **launch_options: further compile options of every launch (``launch_pdl=True``: the
            kernel is launched with programmatic dependent launch).
    """

    __slots__ = ("_fast", "_fn", "_kernels", "_keyed", "_names", "_options")

    def __init__(self, fn: Any, **launch_options: Any) -> None:
        self._fn = fn
        self._options = launch_options
        self._kernels: dict[tuple, tuple[Any, Any, Any, tuple]] = {}
        self._keyed: dict[Hashable, tuple[Any, Any, Any, tuple]] = {}
        self._fast = True
        self._names = tuple(getattr(fn, "arg_names", ()))

    def entry(self, key: Hashable) -> tuple[Any, Any, Any, tuple] | None:
        """The compiled launch cached under a :meth:`keyed` key, for a caller's own fast path.

        Args:
            key: a key passed to :meth:`keyed` before.

        Returns:
            ``(run, function, packed_metadata, constexpr tail)``, called as
            ``run(grid_x, grid_y, grid_z, stream, function, packed_metadata, None, None, None,
            *addresses, *tail)``; None if the key has not launched yet or the fast launch is
            off (another Triton calling convention).
        """
        return self._keyed.get(key) if self._fast else None

    def keyed(
        self,
        key: Hashable,
        programs: int,
        args: tuple,
        addresses: tuple,
        constexprs: dict[str, Any],
        num_warps: int,
        device_index: int,
    ) -> None:
        """Launch ``fn[(programs,)](...)`` under a specialisation key computed by the caller.

        The hot paths know their launch better than this class can rebuild it from the
        arguments: the caller's ``key`` replaces the per-argument walk of :meth:`__call__`.

        Args:
            key: hashable; equal keys must mean the same compiled kernel, so it must determine
                every constexpr, the warps, the device, each tensor's dtype and 16-byte
                alignment and each int argument's ``== 1``, ``% 16 == 0`` and 32-bit range.
            programs: the one-dimensional grid.
            args: the runtime arguments in signature order (for the first launch of a key).
            addresses: ``args`` with every tensor replaced by its ``data_ptr()``.
            constexprs: every constexpr argument by name.
            num_warps: warps per program.
            device_index: the CUDA device of the tensors (the current device).
        """
        entry = self._keyed.get(key)
        if entry is not None and self._fast:
            run, function, metadata, tail = entry
            try:
                run(
                    programs,
                    1,
                    1,
                    torch._C._cuda_getCurrentRawStream(device_index),
                    function,
                    metadata,
                    None,
                    None,
                    None,
                    *addresses,
                    *tail,
                )
                return
            except Exception:
                self._fast = False
        found = self._kernels.get(self((programs,), args, constexprs, num_warps, device_index))
        if found is not None:
            self._keyed[key] = found

    def __call__(
        self,
        grid: tuple[int, ...],
        args: tuple,
        constexprs: dict[str, Any],
        num_warps: int,
        device_index: int,
        num_stages: int | None = None,
    ) -> tuple:
        """Launch ``fn[grid](*args, **constexprs, num_warps=num_warps)``.

        Args:
            grid: the launch grid (one to three program counts).
            args: the runtime arguments in signature order.
            constexprs: every constexpr argument by name.
            num_warps: warps per program.
            device_index: the CUDA device of the tensors (the current device).
            num_stages: software-pipelining depth (None: Triton's default).

        Returns:
            The specialisation key of the launch.
        """
        key: list = [num_warps, num_stages, device_index, *constexprs.values()]
        append = key.append
        launch_args = list(args)
        for index, arg in enumerate(args):
            cls = type(arg)
            if cls is int:
                # One int per argument: 1 (specialised away), else the low four bits (16-byte
                # divisibility) with a bit telling whether it fits in 32 bits.
                append(1 if arg == 1 else (arg & 15) | (16 if arg in _INT32 else 32))
            elif cls is float:
                append(cls)
            elif isinstance(arg, torch.Tensor):
                address = arg.data_ptr()
                append(arg.dtype)
                append(address & 15)
                launch_args[index] = address
            elif cls is _TensorDescriptor:
                append(cls)
                append(arg.base.dtype)
                append(tuple(arg.block_shape))
                append(arg.padding)
            else:
                append(cls)
        cache_key = tuple(key)
        entry = self._kernels.get(cache_key)
        if entry is not None and self._fast:
            run, function, metadata, tail = entry
            try:
                run(
                    grid[0],
                    grid[1] if len(grid) > 1 else 1,
                    grid[2] if len(grid) > 2 else 1,
                    torch._C._cuda_getCurrentRawStream(device_index),
                    function,
                    metadata,
                    None,
                    None,
                    None,
                    *launch_args,
                    *tail,
                )
                return cache_key
            except Exception:
                self._fast = False
        options = (
            self._options if num_stages is None else {**self._options, "num_stages": num_stages}
        )
        kernel = self._fn[grid](*args, **constexprs, num_warps=num_warps, **options)
        if all(hasattr(kernel, name) for name in ("run", "function", "packed_metadata")):
            tail = tuple(constexprs[name] for name in self._names[len(args) :])
            self._kernels[cache_key] = (kernel.run, kernel.function, kernel.packed_metadata, tail)
        return cache_key


class TicketPool:
    """Zeroed int32 counters per device for kernels whose last program of a group does the final work.

    A kernel takes a ticket with an atomic add per program of a group; the program that arrives
    last does the group's reduction and sets the counter back to zero, so the buffer is zeroed
    again after every launch and CUDA graph replays can reuse it. Each op keeps its own pool:
    under programmatic dependent launch two ops' kernels can overlap, and shared counters would
    mix their tickets. A buffer replaced by a larger one is kept alive, because graphs captured
    earlier still point at it.

    Args:
        minimum: the smallest buffer allocated (counters), so that small launches share one.
    """

    def __init__(self, minimum: int = 4096) -> None:
        self._minimum = minimum
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []

    def get(self, device: torch.device, count: int) -> torch.Tensor:
        """Return at least ``count`` zeroed int32 counters on ``device``.

        Args:
            device: the device of the launch.
            count: counters the launch uses (one per group of programs).

        Returns:
            A 1-D int32 tensor of ``>= count`` zeros (left zeroed by every complete launch).
        """
        tickets = self._buffers.get(device)
        if tickets is None or tickets.numel() < count:
            if tickets is not None:
                self._retired.append(tickets)
            tickets = torch.zeros(max(count, self._minimum), dtype=torch.int32, device=device)
            self._buffers[device] = tickets
        return tickets


def next_power_of_2(n: int) -> int:
    """Return the smallest power of two ``>= n`` (1 for ``n <= 1``).

    Args:
        n: a non-negative int.

    Returns:
        The power of two.
    """
    return 1 << max(n - 1, 0).bit_length()


def on_device_of(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Return a context making ``tensor``'s GPU current (Triton launches on the current device).

    Args:
        tensor: any tensor argument of the launch.

    Returns:
        ``torch.cuda.device(tensor.device)`` for a CUDA tensor on another GPU than the current
        one, else a shared no-op context (the common case costs no device switch).
    """
    # A CUDA tensor means CUDA is initialised: read the current device without the lazy-init
    # check of ``torch.cuda.current_device()``.
    if tensor.is_cuda and tensor.get_device() != torch._C._cuda_getDevice():
        return torch.cuda.device(tensor.device)
    return _SAME_DEVICE


@functools.cache
def device_limits(device: torch.device) -> tuple[int, int]:
    """Return ``(multiprocessors, shared memory bytes per block)`` of a device, cached.

    Args:
        device: a CUDA device, or the CPU (the interpreter: 4 "multiprocessors").

    Returns:
        The multiprocessor count and the opt-in shared-memory limit of one block.
    """
    if device.type != "cuda":
        return 4, 228 * 1024
    props = torch.cuda.get_device_properties(device)
    # torch < 2.5 lacks the opt-in limit; 48 KiB is what every CUDA GPU grants a block.
    return props.multi_processor_count, int(
        getattr(props, "shared_memory_per_block_optin", 48 * 1024)
    )


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` as ``[rows, last_dim]`` with a unit stride along the last dimension.

    Args:
        tensor: any tensor with at least one dimension.

    Returns:
        A view when the layout allows one, else a contiguous copy.
    """
    flat = tensor.reshape(-1, tensor.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


# Triton decides when a kernel is defined (at import) whether it is interpreted; so does this.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1") if tl else None


@jit
def round_to(x, dtype: tl.constexpr):
    """Cast float32 ``x`` to ``dtype`` rounding to nearest even.

    Under the Triton interpreter, which truncates in its own float32 to bfloat16 conversion,
    bfloat16 is rounded with integer arithmetic that gives bitwise what the GPU's conversion
    gives, so interpreter tests check the GPU numerics. Compiled kernels use the GPU's
    conversion itself (one instruction instead of eight integer operations per element, which
    lengthen the latency of small launches).

    Args:
        x: float32 tensor.
        dtype: destination dtype.

    Returns:
        ``x`` in ``dtype``.
    """
    if _INTERPRETED:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = bits + 0x7FFF + ((bits >> 16) & 1)
            # NaN payloads in the low half would otherwise round up into infinity.
            rounded = tl.where(x != x, bits | 0x400000, rounded)
            return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)
    else:
        return x.to(dtype)


@jit
def _mul_rn(x, y):
    """``x * y`` in float32, rounded to nearest even, never fused or flushed to zero."""
    if _INTERPRETED:
        return x * y
    else:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32, is_pure=True, pack=1
        )


@jit
def _sub_rn(x, y):
    """``x - y`` in float32, rounded to nearest even, never fused or flushed to zero."""
    if _INTERPRETED:
        return x - y
    else:
        return tl.inline_asm_elementwise(
            "sub.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32, is_pure=True, pack=1
        )


@jit
def _add_rn(x, y):
    """``x + y`` in float32, rounded to nearest even, never fused or flushed to zero."""
    if _INTERPRETED:
        return x + y
    else:
        return tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32, is_pure=True, pack=1
        )


@jit
def rotate_half_rounded(x1, x2, cos, sin, DTYPE: tl.constexpr):
    """RoPE of a pair of half-head tiles as the unfused ``DTYPE`` expression rounds.

    ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` with the tables, each of the four products
    and both sums rounded to ``DTYPE`` (to nearest even), as torch computes the expression on
    ``DTYPE`` tensors: bitwise the same in every kernel that calls this and as the torch
    reference. Compiled kernels compute in float32 with inline ``mul.rn``/``sub.rn``/``add.rn``
    (PTX the compiler never contracts, subnormals kept): with plain ``*`` and ``-`` LLVM turned
    each sum into one multiply-add of ``DTYPE`` that skips the rounding of one product, and
    which product depended on the kernel around it (the keys of two kernels differed by one
    ulp on an H200).

    Args:
        x1: float32 first halves (values of ``DTYPE``).
        x2: float32 second halves, shaped like ``x1``.
        cos: float32 cosines, broadcastable to ``x1`` (rounded to ``DTYPE`` here).
        sin: float32 sines, like ``cos``.
        DTYPE: The activation dtype.

    Returns:
        The rotated first and second halves in ``DTYPE``.
    """
    c = tl.broadcast_to(round_to(cos, DTYPE).to(tl.float32), x1.shape)
    s = tl.broadcast_to(round_to(sin, DTYPE).to(tl.float32), x1.shape)
    a = round_to(_mul_rn(x1, c), DTYPE).to(tl.float32)
    b = round_to(_mul_rn(x2, s), DTYPE).to(tl.float32)
    e = round_to(_mul_rn(x2, c), DTYPE).to(tl.float32)
    f = round_to(_mul_rn(x1, s), DTYPE).to(tl.float32)
    return round_to(_sub_rn(a, b), DTYPE), round_to(_add_rn(e, f), DTYPE)
