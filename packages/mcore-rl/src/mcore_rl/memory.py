"""Memory accounting at step boundaries: device allocator bytes, or live tensors on the CPU."""

from __future__ import annotations

import gc

import torch

__all__ = ["allocated_bytes", "live_tensor_bytes"]


def allocated_bytes(device: torch.device) -> int:
    """Bytes the CUDA caching allocator has handed out on ``device`` (0 on the CPU).

    Args:
        device: The device.

    Returns:
        Allocated bytes.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.memory_allocated(device))
    return 0


def live_tensor_bytes() -> tuple[int, int]:
    """Counts the tensors reachable by the garbage collector and their distinct storage bytes.

    The CPU has no allocator counter like CUDA's; a leak of tensors between steps (an engine
    kept alive, a growing list of results) still shows up here after ``gc.collect()``.

    Returns:
        ``(number of tensors, bytes of their distinct storages)``.
    """
    gc.collect()
    count, seen, total = 0, set(), 0
    for obj in gc.get_objects():
        # type() rather than isinstance(): some tracked objects warn when __class__ is read.
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            count += 1
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return count, total
