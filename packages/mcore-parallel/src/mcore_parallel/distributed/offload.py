"""Moving buffers between device and host memory without aliasing the original storage."""

from __future__ import annotations

import torch

__all__ = ["move_tensor"]


def move_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Returns a copy of ``tensor`` on ``device`` in new storage, bit for bit.

    Unlike ``tensor.to(device)``, the result never shares storage with the input, even when the
    devices match, so dropping the input really frees its memory once nothing else refers to
    it. Host copies of CUDA tensors are pinned so that the way back is a fast DMA.

    Called under ``torch.inference_mode(False)`` by the offload methods: state moved while a
    caller is in inference mode must not become inference tensors, which training could no
    longer update.

    Args:
        tensor: The tensor to move.
        device: Destination device.

    Returns:
        The new tensor, same dtype, shape and values.
    """
    pin = device.type == "cpu" and tensor.device.type == "cuda"
    moved = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pin)
    moved.copy_(tensor)
    return moved
