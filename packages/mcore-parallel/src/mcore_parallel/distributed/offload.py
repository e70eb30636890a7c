"""Moving buffers between device and host memory without aliasing the original storage."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_parallel.distributed.buffers import Bucket, ParamAndGradBuffer

__all__ = ["move_tensor", "move_buffers"]


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


@torch.inference_mode(False)
def move_buffers(
    buffers: Sequence[ParamAndGradBuffer],
    buckets: Sequence[Bucket],
    device: torch.device,
    *,
    params: bool,
    grads: bool,
) -> None:
    """Moves the parameter and/or gradient storage of ``buffers`` to ``device``.

    In-flight gradient reductions are waited for before their memory moves. Parameters and
    ``main_grad`` are re-pointed at the new storage afterwards.

    Args:
        buffers: The buffers.
        buckets: Their buckets (for the in-flight reductions).
        device: Destination device.
        params: Move the parameter storage.
        grads: Move the gradient storage.
    """
    if grads:
        for bucket in buckets:
            if bucket.grad_work is not None:
                bucket.grad_work.wait()
                bucket.grad_work = None
    for buffer in buffers:
        if grads:
            buffer.grad_data = move_tensor(buffer.grad_data, device)
        if params:
            buffer.param_data = move_tensor(buffer.param_data, device)
        buffer.bind_views()
