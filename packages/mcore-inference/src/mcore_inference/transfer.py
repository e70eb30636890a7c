"""Host-to-device copies of small per-step values that never make the host wait for the GPU.

``torch.tensor(values, device="cuda")`` and ``cpu_tensor.to("cuda")`` copy from pageable
memory and then synchronise the stream: the host waits until every kernel queued before the
copy has run. In the engine's step that wait cancels the overlap of host work with GPU work
(see :mod:`mcore_inference.readback`). Staging the values in pinned memory and copying
asynchronously returns at once; PyTorch's pinned-memory cache keeps the staging block alive
until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["to_device"]


def to_device(
    values: Sequence[int] | Sequence[float] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Copy host values to ``device`` without synchronising with it.

    Args:
        values: Numbers, or a CPU tensor (staged through a pinned copy; a tensor already in
            pinned memory is uploaded as it is and must not change until the copy ran).
        dtype: Dtype of the result.
        device: Target device.

    Returns:
        A tensor of ``values`` on ``device`` (its copy is queued on the current stream).
    """
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    # A pinned staging copy (from the caching host allocator), then an asynchronous upload.
    return host.pin_memory().to(device, non_blocking=True)
