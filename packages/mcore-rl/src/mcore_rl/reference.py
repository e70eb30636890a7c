"""Reference-policy weights kept aside and swapped into the live policy model.

The reference model is not a second model: its weights live in (pinned) host memory, or with
``on_device=True`` in device memory, and :meth:`ReferenceWeights.use_reference_weights` copies
them into the policy's parameters for the reference forward, then copies the policy back
bit-exactly. The policy copy goes to a buffer allocated once (next to the reference), so the
swap allocates nothing per step. On the device the swap is two device-to-device copies of the
parameters (milliseconds) instead of three host transfers (a large part of a second for a 1B
model over PCIe), for two more copies of the parameters in device memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from mcore_rl.errors import RLInputError, RLStateError

__all__ = ["ReferenceWeights", "unwrap_model"]


def unwrap_model(model: nn.Module) -> nn.Module:
    """Returns the module inside a data-parallel wrapper (or the module itself).

    Args:
        model: A module, possibly wrapped (a ``.module`` attribute).

    Returns:
        The innermost module.
    """
    inner = getattr(model, "module", None)
    while isinstance(inner, nn.Module):
        model, inner = inner, getattr(inner, "module", None)
    return model


def _copy_to(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    pinned = pin and device.type == "cpu"
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pinned)
    out.copy_(tensor.detach())
    return out


class ReferenceWeights:
    """Holds reference weights on the host and swaps them into a policy model on demand.

    Args:
        model: The policy model (a ``DistributedDataParallel`` wrapper or a plain module).
        reference_state: Parameter name -> reference tensor; None snapshots the model's
            current parameters (the usual start of GRPO: the reference is the initial policy).
        optimizer: The distributed optimizer whose parameter all-gather must be complete before
            the swap; None uses the model's own ``start_param_sync`` when it has one.
        on_device: Keep the reference weights and the policy's swap buffer on the parameters'
            device instead of in pinned host memory.

    Raises:
        RLInputError: If ``reference_state`` misses a parameter or a shape differs.
    """

    def __init__(
        self,
        model: nn.Module,
        reference_state: Mapping[str, torch.Tensor] | None = None,
        *,
        optimizer: Any = None,
        on_device: bool = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.on_device = on_device
        """Whether the reference and the swap buffer live in device memory."""
        self._params = dict(unwrap_model(model).named_parameters())
        pin = torch.cuda.is_available() and any(p.is_cuda for p in self._params.values())
        host = torch.device("cpu")
        source = reference_state if reference_state is not None else self._params
        missing = sorted(set(self._params) - set(source))
        if missing:
            raise RLInputError(f"reference_state misses parameters {missing[:5]}")
        self._reference: dict[str, torch.Tensor] = {}
        for name, param in self._params.items():
            if tuple(source[name].shape) != tuple(param.shape):
                raise RLInputError(
                    f"reference_state[{name!r}] has shape {tuple(source[name].shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            where = param.device if on_device else host
            self._reference[name] = _copy_to(source[name].to(param.dtype), where, pin)
        self._policy = {
            name: _copy_to(p, p.device if on_device else host, pin)
            for name, p in self._params.items()
        }
        self._active = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Returns the reference weights (the stored tensors, not copies).

        Returns:
            Parameter name -> reference tensor.
        """
        return dict(self._reference)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replaces the reference weights (e.g. from a checkpoint).

        Args:
            state_dict: Parameter name -> tensor, shaped like the model's parameters.

        Raises:
            RLInputError: If a name is missing or a shape differs.
        """
        for name, tensor in self._reference.items():
            if name not in state_dict or state_dict[name].shape != tensor.shape:
                raise RLInputError(
                    f"state_dict[{name!r}] is missing or not of shape {tuple(tensor.shape)}"
                )
        for name, tensor in self._reference.items():
            tensor.copy_(state_dict[name])

    def _synchronised(self) -> contextlib.AbstractContextManager[Any]:
        owner: Any = self.optimizer if self.optimizer is not None else self.model
        if hasattr(owner, "start_param_sync"):
            owner.start_param_sync(force_sync=True)
        if hasattr(owner, "param_sync_hooks_disabled"):
            return owner.param_sync_hooks_disabled()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def use_reference_weights(self) -> Iterator[None]:
        """Context in which the model's parameters hold the reference weights.

        On entry every pending parameter all-gather is finished and the forward pre-hooks are
        disabled (so no gather can overwrite the swapped weights), the policy parameters are
        copied to the host buffer and the reference copied in. On exit, also when the body
        raises, the policy parameters are copied back bit-exactly and the hooks restored.

        Yields:
            None.

        Raises:
            RLStateError: If the context is entered again while active.
        """
        if self._active:
            raise RLStateError("use_reference_weights() is already active; it does not nest")
        self._active = True
        try:
            with self._synchronised(), torch.no_grad():
                for name, param in self._params.items():
                    self._policy[name].copy_(param.detach(), non_blocking=True)
                try:
                    for name, param in self._params.items():
                        param.copy_(self._reference[name], non_blocking=True)
                    yield
                finally:
                    for name, param in self._params.items():
                        param.copy_(self._policy[name], non_blocking=True)
        finally:
            self._active = False
