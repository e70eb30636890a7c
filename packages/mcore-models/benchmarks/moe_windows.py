"""Rotated timing windows of ``bench_moe.py``: the order of the rounds, the per-round ratios
and a sampler of the GPU's SM clock.

The H200 runs the MoE benchmark's layers at its power limit, where the SM clock depends on what
ran during the last few hundred milliseconds (docs/benchmarks/moe.md, session 16). The layers
whose ratios the issue's targets read are therefore timed together: one settle of continuous
load, then rounds that visit every layer once (:func:`rotation`), each visit one window; the
reported time is the median of a layer's windows and :func:`round_ratios` gives the ratio of
each round's windows, whose spread shows how far one window pair can be from the medians.
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

NVML_CLOCK_SM = 1
"""``nvmlClockType_t`` of the SM clock."""
LEAD_STEPS = 2
"""Untimed steps queued without a synchronisation right before a steady-state window, so that
its first timed step starts with the host already ahead of the GPU."""
MIN_WINDOW_MS = 100.0
"""A steady-state window times at least this many milliseconds of steps (and at least the
case's step count), estimated from the window started on an idle GPU."""
SETTLE_SECONDS = 2.0
"""Seconds of continuous load (every layer's step in turn) before the first round: the power
average reaches the limit, and no layer is timed at the boost clocks of an idle moment
(DeepSeek-V3 8k, one H200: 1830 MHz in the first measurement after a build, 1390 MHz once
the power limit holds)."""


def rotation(count: int, rounds: int) -> list[list[int]]:
    """The order in which each round visits ``count`` layers.

    Round ``r`` starts at layer ``r % count`` and runs forward on even rounds, backward on odd
    ones: over ``count`` rounds every layer opens one round (right after the settle or after
    the previous round's last window), and every layer follows each of its two neighbours.

    Args:
        count: Number of layers.
        rounds: Number of rounds.

    Returns:
        One list of layer indices per round, each a permutation of ``range(count)``.

    Raises:
        ValueError: If ``count`` or ``rounds`` is below 1.
    """
    if count < 1:
        raise ValueError(f"count={count} must be at least 1")
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be at least 1")
    direction = (1, -1)
    return [
        [(start + direction[start % 2] * step) % count for step in range(count)]
        for start in range(rounds)
    ]


def spread(windows: list[float]) -> dict[str, float]:
    """Median, smallest and largest of a layer's windows.

    Args:
        windows: Milliseconds per step of each window.

    Returns:
        ``median``, ``min`` and ``max``.

    Raises:
        ValueError: If ``windows`` is empty.
    """
    if not windows:
        raise ValueError("windows is empty")
    return {"median": statistics.median(windows), "min": min(windows), "max": max(windows)}


def round_ratios(peers: list[list[float]], windows: list[float]) -> list[float]:
    """Each round's ratio of the fastest peer's window to the layer's window.

    Args:
        peers: Windows of each peer (ms per step, one per round), e.g. the two dense layers.
        windows: The layer's windows, one per round.

    Returns:
        ``min(peer[r] for peer in peers) / windows[r]`` for every round ``r``.

    Raises:
        ValueError: If ``peers`` is empty or a peer has another number of rounds.
    """
    if not peers:
        raise ValueError("peers is empty")
    for peer in peers:
        if len(peer) != len(windows):
            raise ValueError(f"a peer has {len(peer)} windows, the layer {len(windows)}")
    return [min(peer[r] for peer in peers) / window for r, window in enumerate(windows)]


class ClockSampler:
    """The SM clock of one GPU, read through NVML every ``interval`` seconds on a thread.

    NVML is the driver's library (``libnvidia-ml.so.1``), loaded with ctypes: no Python
    package is needed. Each read takes microseconds and releases the interpreter lock, so the
    thread does not slow the host's kernel launches measurably.
    """

    def __init__(self, library: ctypes.CDLL, handle: ctypes.c_void_p, interval: float) -> None:
        self._library = library
        self._handle = handle
        self._interval = interval
        self._samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sm-clock", daemon=True)

    @classmethod
    def open(cls, device: torch.device, interval: float = 0.01) -> ClockSampler | None:
        """A started sampler of ``device``'s SM clock, or None where NVML cannot read it.

        Args:
            device: A CUDA device (found in NVML by its PCI bus id, else its UUID).
            interval: Seconds between reads.

        Returns:
            The running sampler, or None (no NVML library, another kind of device).
        """
        if device.type != "cuda":
            return None
        try:
            library = ctypes.CDLL("libnvidia-ml.so.1")
            if library.nvmlInit_v2() != 0:
                return None
            props = torch.cuda.get_device_properties(device)
            handle = ctypes.c_void_p()
            if hasattr(props, "pci_bus_id"):
                bus_id = (
                    f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
                )
                failed = library.nvmlDeviceGetHandleByPciBusId_v2(
                    bus_id.encode(), ctypes.byref(handle)
                )
            else:
                uuid = f"GPU-{props.uuid}"
                failed = library.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle))
            if failed:
                return None
        except (OSError, AttributeError):
            return None
        sampler = cls(library, handle, interval)
        if sampler.read() is None:
            return None
        sampler.start()
        return sampler

    def start(self) -> None:
        """Start reading on the thread."""
        self._thread.start()

    def read(self) -> int | None:
        """The SM clock now, in MHz (None if NVML reports an error)."""
        clock = ctypes.c_uint()
        if self._library.nvmlDeviceGetClockInfo(self._handle, NVML_CLOCK_SM, ctypes.byref(clock)):
            return None
        return int(clock.value)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            clock = self.read()
            if clock is not None:
                self._samples.append((time.perf_counter(), clock))

    def mean(self, begin: float, end: float) -> float | None:
        """Mean SM clock (MHz) of the samples taken between two ``time.perf_counter()`` values.

        Args:
            begin: Start of the interval.
            end: End of the interval.

        Returns:
            The mean, or None if no sample fell inside.
        """
        inside = [clock for at, clock in list(self._samples) if begin <= at <= end]
        return statistics.fmean(inside) if inside else None

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join()


def stepper(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of ``module`` on ``x`` with output gradient ``grad``, the
    parameter and input gradients cleared after it.

    Args:
        module: The layer (``wants_3d`` adds a batch dimension, ``kernel_backend`` sets
            ``MCORE_KERNELS_BACKEND`` during the step).
        x: Input ``[tokens, hidden]`` (made to require a gradient).
        grad: Output gradient.

    Returns:
        The step.
    """
    inputs = x.requires_grad_(True)
    shaped = inputs if not getattr(module, "wants_3d", False) else inputs[None]
    backend = getattr(module, "kernel_backend", None)
    previous = os.environ.get("MCORE_KERNELS_BACKEND")

    def step() -> None:
        if backend is not None:
            os.environ["MCORE_KERNELS_BACKEND"] = backend
        out = module(shaped)
        out = out.reshape(grad.shape)
        out.backward(grad)
        module.zero_grad(set_to_none=True)
        inputs.grad = None
        if backend is not None:
            if previous is None:
                os.environ.pop("MCORE_KERNELS_BACKEND", None)
            else:
                os.environ["MCORE_KERNELS_BACKEND"] = previous

    return step


def window(step: Callable[[], None], steps: int, cuda: bool = True) -> float:
    """Milliseconds per step of ``steps`` steps: between two CUDA events (no synchronisation
    before the start event: the caller decides what the GPU is doing then), or by the wall
    clock without ``cuda``.

    Args:
        step: One step.
        steps: Number of timed steps.
        cuda: Time on the current CUDA stream.

    Returns:
        Milliseconds per step.
    """
    if not cuda:
        begin = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - begin) * 1e3 / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def allocator_events() -> dict[str, int]:
    """Counters of the caching allocator whose growth means device allocations in the loop
    (each a potential synchronisation: cudaMalloc / cudaFree or segment map / unmap)."""
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free")
    return {key: int(stats.get(key, 0)) for key in keys}


def settle(steps: list[Callable[[], None]], seconds: float) -> None:
    """Continuous load on the GPU: every step in turn, repeated for ``seconds``, with at most
    two passes queued ahead of the GPU (no idle moment, no unbounded queue).

    Args:
        steps: One step per layer.
        seconds: Host seconds of load.
    """
    previous: torch.cuda.Event | None = None
    begin = time.perf_counter()
    while time.perf_counter() - begin < seconds:
        for step in steps:
            step()
        done = torch.cuda.Event()
        done.record()
        if previous is not None:
            previous.synchronize()
        previous = done
    torch.cuda.synchronize()


def _visit(
    step: Callable[[], None],
    log: dict[str, Any],
    iters: int,
    cuda: bool,
    clock: ClockSampler | None,
) -> None:
    """One round's two windows of one layer, appended to its ``log``: ``iters`` steps started
    right after a synchronisation, then :data:`LEAD_STEPS` queued steps and the steady-state
    window (its step count fixed at the first round)."""
    if cuda:
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        before = allocator_events()
    begin = time.perf_counter()
    from_idle = window(step, iters, cuda)
    end = time.perf_counter()
    if "steady_steps" not in log:
        least = math.ceil(MIN_WINDOW_MS / max(from_idle, 1e-3)) if cuda else 0
        log["steady_steps"] = max(iters, least)
    lead = 0
    if cuda:
        lead = LEAD_STEPS
        for _ in range(lead):
            step()
    # The clock is averaged over the host's interval, which also covers the queued steps.
    queued = time.perf_counter()
    steady = window(step, log["steady_steps"], cuda)
    done = time.perf_counter()
    log["windows_ms"].append(steady)
    log["windows_ms_from_idle"].append(from_idle)
    if clock is not None:
        log["windows_sm_mhz"].append(clock.mean(queued, done))
        log["windows_sm_mhz_from_idle"].append(clock.mean(begin, end))
    if cuda:
        log["transient_bytes"] = max(
            log.get("transient_bytes", 0), torch.cuda.max_memory_allocated() - resident
        )
        after = allocator_events()
        for key in after:
            log[key] = log.get(key, 0) + after[key] - before[key]
        log["counted_steps"] = log.get("counted_steps", 0) + iters + lead + log["steady_steps"]


def _summary(log: dict[str, Any], module: nn.Module, input_bytes: int) -> dict[str, Any]:
    """A layer's row fields from its windows (see :func:`rotate`)."""
    if "error" in log:
        return {"error": log["error"]}
    steady = spread(log["windows_ms"])
    fields: dict[str, Any] = {
        "ms": steady["median"],
        "ms_min": steady["min"],
        "ms_max": steady["max"],
        "ms_from_idle": statistics.median(log["windows_ms_from_idle"]),
        "steady_steps": log["steady_steps"],
        "rounds": len(log["windows_ms"]),
        "windows_ms": log["windows_ms"],
        "windows_ms_from_idle": log["windows_ms_from_idle"],
    }
    clocks = [mhz for mhz in log["windows_sm_mhz"] if mhz is not None]
    if clocks:
        fields.update(
            sm_mhz=statistics.median(clocks),
            windows_sm_mhz=log["windows_sm_mhz"],
            windows_sm_mhz_from_idle=log["windows_sm_mhz_from_idle"],
        )
    if "transient_bytes" in log:
        own = sum(param.numel() * param.element_size() for param in module.parameters())
        fields["peak_gib"] = (log["transient_bytes"] + own + input_bytes) / 2**30
        for key in ("num_alloc_retries", "num_device_alloc", "num_device_free"):
            fields[key] = log[key] / log["counted_steps"]
    return fields


def rotate(
    modules: dict[str, nn.Module],
    x: torch.Tensor,
    grad: torch.Tensor,
    warmup: int,
    iters: int,
    rounds: int,
    clock: ClockSampler | None = None,
    emit: Callable[[dict[str, dict[str, Any]]], None] | None = None,
    inputs: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Time layers together: one settle of continuous load, then rounds of windows.

    Every layer runs ``warmup`` steps (compilation, caches), then on a GPU all of them take
    turns for :data:`SETTLE_SECONDS` without an idle moment, then each of ``rounds`` rounds
    visits every layer once in the order of :func:`rotation`; a visit times two windows (as
    ``bench_moe._time`` does after its settle): ``iters`` steps started right after a
    synchronisation, and after :data:`LEAD_STEPS` queued steps the steady-state window of at
    least ``iters`` steps and :data:`MIN_WINDOW_MS`. On the CPU both windows are ``iters``
    steps of the wall clock, without settle. A layer whose step raises is reported with the
    error and left out of the later rounds.

    Args:
        modules: The layers, by row name.
        x: Input ``[tokens, hidden]`` (each layer gets a copy).
        grad: Output gradient.
        warmup: Untimed steps of each layer first.
        iters: Steps of the window started on an idle GPU (and the least of the steady one).
        rounds: Number of rounds.
        clock: Sampler whose mean SM clock is recorded per window.
        emit: Called with the row fields so far after every round.
        inputs: Input and output gradient of the layers that do not take ``x`` and ``grad``
            (used in place: the input is made to require a gradient).

    Returns:
        Per layer: ``ms`` (median of the steady-state windows), ``ms_min``, ``ms_max``,
        ``ms_from_idle`` (median), ``steady_steps``, ``rounds``, ``windows_ms`` and
        ``windows_ms_from_idle`` (one per round), with a clock ``sm_mhz`` (median of the
        steady windows' means), ``windows_sm_mhz`` and ``windows_sm_mhz_from_idle``, on a GPU
        ``peak_gib`` (the peak above the memory resident before its windows, plus its own
        parameters and the inputs: the other layers left out) and the allocator's events per
        step; or ``error``.
    """
    cuda = x.device.type == "cuda"
    names = list(modules)
    # Every layer gets its own copy of x; the given inputs are the caller's to use as they are.
    own = {name: (inputs or {}).get(name, (x.detach().clone(), grad)) for name in names}
    steps = {name: stepper(module, *own[name]) for name, module in modules.items()}
    logs: dict[str, dict[str, Any]] = {
        name: {
            "windows_ms": [],
            "windows_ms_from_idle": [],
            "windows_sm_mhz": [],
            "windows_sm_mhz_from_idle": [],
        }
        for name in names
    }
    for name in names:
        try:
            for _ in range(warmup):
                steps[name]()
        except Exception as exc:
            logs[name]["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    running = [name for name in names if "error" not in logs[name]]
    if cuda and running:
        settle([steps[name] for name in running], SETTLE_SECONDS)
    input_bytes = {name: 3 * own[name][0].numel() * own[name][0].element_size() for name in names}

    def summaries() -> dict[str, dict[str, Any]]:
        return {name: _summary(logs[name], modules[name], input_bytes[name]) for name in names}

    for order in rotation(len(names), rounds):
        for index in order:
            name = names[index]
            if "error" in logs[name]:
                continue
            try:
                _visit(steps[name], logs[name], iters, cuda, clock)
            except Exception as exc:
                logs[name]["error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
        if emit is not None:
            emit(summaries())
    return summaries()
