"""Routing counts read on the host without draining the stream first."""

from __future__ import annotations

import torch

__all__ = ["EARLY", "HostCounts"]

EARLY = True
"""Where the MoE layer reads routing counts on the host (the cuBLAS loops over experts, the
padding to the largest expert), queue their copy right after the router and wait for it only
when needed (:class:`HostCounts`), so that the wait overlaps the kernels queued after the
copy; False reads them when needed (the GPU idles from the read to the next launch)."""


class HostCounts:
    """Assignments per expert on their way to the host: the copy is queued on the current stream
    when this is built, and the host waits for it only when a value is first read.

    Reading a device tensor on the host (``tolist``) waits for every kernel queued so far and
    leaves the GPU idle until the host launches the next one. Built right after the router,
    the copy completes before the permutation kernels that follow it on the stream, so the host
    wakes while those still run and the GPU has work until the next launch.

    Args:
        counts: ``[E]`` int64 assignments per expert (any device).
    """

    def __init__(self, counts: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if counts.device.type == "cuda":
            self._host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self._host.copy_(counts, non_blocking=True)
            # The copy runs on the counts' device's current stream: the event goes there too.
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(counts.device))
        else:
            self._host = counts
        self._values: list[int] | None = None

    def values(self) -> list[int]:
        """The counts as host integers (waits for the copy once).

        Returns:
            ``[E]`` assignments per expert.
        """
        if self._values is None:
            if self._event is not None:
                # NOTE: a host wait, for the copy queued in __init__ only.
                self._event.synchronize()
            self._values = [int(value) for value in self._host.tolist()]
        return self._values

    def ends(self, capacity: int | None = None) -> list[int]:
        """End row of every expert's rows packed expert after expert.

        Args:
            capacity: Rows each expert keeps at most (capacity routing), or None (all).

        Returns:
            ``[E]`` running sum of the (kept) counts.
        """
        ends, total = [], 0
        for value in self.values():
            total += value if capacity is None else min(value, capacity)
            ends.append(total)
        return ends

    def largest(self) -> int:
        """The largest count (0 without experts).

        Returns:
            The most assignments of any expert.
        """
        return max(self.values(), default=0)
