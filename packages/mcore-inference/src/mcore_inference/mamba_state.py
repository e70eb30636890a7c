"""Per-request Mamba state slots of the inference engine, next to the paged KV cache.

A Mamba layer's memory of a request is fixed-size: the last ``K - 1`` convolution inputs
``[conv_dim, K - 1]`` and the SSM state ``[H, P, N]`` (float32). :class:`MambaStateCache`
preallocates, for every Mamba layer of this rank's stage, one tensor of each kind with
``max_batch_size + 1`` slots; :class:`StateSlotAllocator` hands a slot to each admitted request
(zeroed: a fresh request starts from the zero state) and takes it back when the request's KV
blocks are freed. The last slot is a scratch slot that the padding rows of CUDA-graph buckets
read and write, never handed out.

For each step the engine asks :meth:`MambaStateCache.step_state` for the
:class:`mcore_models.MambaStepState` of the step's requests; the model reads each request's slot
at its first token and writes it back after its last, so a prompt prefilled over several
chunks, interleaved with other requests' decodes, carries its state across steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from mcore_inference.errors import BlockAllocatorError, KVCacheExhaustedError
from mcore_models.mamba import Mamba2Mixer, MambaStepState

__all__ = ["MambaStateCache", "StateSlotAllocator", "has_mamba_layers"]


def has_mamba_layers(model: Any) -> bool:
    """Whether a model (or pipeline stage) holds Mamba-2 mixers.

    Args:
        model: The served model.

    Returns:
        True if any module is a :class:`mcore_models.mamba.Mamba2Mixer`.
    """
    return any(isinstance(module, Mamba2Mixer) for module in model.modules())


class StateSlotAllocator:
    """Free list of state slots ``0 .. num_slots - 1`` (one per live request).

    Args:
        num_slots: Slots that can be handed out (at least 1).

    Raises:
        BlockAllocatorError: If ``num_slots`` is below 1.
    """

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise BlockAllocatorError(f"num_slots={num_slots!r}; expected an integer >= 1")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._owner: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Slots free right now."""
        return len(self._free)

    def slot_of(self, request_id: int) -> int | None:
        """The slot held by a request.

        Args:
            request_id: The request.

        Returns:
            Its slot, or None if it holds none.
        """
        return self._owner.get(request_id)

    def allocate(self, request_id: int) -> int:
        """Give a slot to a request.

        Args:
            request_id: A request that holds no slot.

        Returns:
            The slot.

        Raises:
            BlockAllocatorError: If the request already holds one.
            KVCacheExhaustedError: If every slot is taken.
        """
        if request_id in self._owner:
            raise BlockAllocatorError(
                f"request_id={request_id} already holds state slot {self._owner[request_id]}"
            )
        if not self._free:
            raise KVCacheExhaustedError(f"all {self.num_slots} Mamba state slots are taken")
        slot = self._free.popleft()
        self._owner[request_id] = slot
        return slot

    def free(self, request_id: int) -> int | None:
        """Take a request's slot back (no-op for a request that holds none).

        Args:
            request_id: The request.

        Returns:
            The freed slot, or None.
        """
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        return slot


class MambaStateCache:
    """Convolution and SSM state slots of this rank's Mamba layers.

    Args:
        model: The served model or pipeline stage (its Mamba mixers give the shapes, with
            this rank's heads under tensor parallelism).
        max_requests: Most live requests (the engine's ``max_batch_size``).
        device: Device of the buffers.
    """

    def __init__(self, model: Any, max_requests: int, device: torch.device) -> None:
        mixers = [m for m in model.modules() if isinstance(m, Mamba2Mixer)]
        self.allocator = StateSlotAllocator(max_requests)
        self.scratch_slot = max_requests
        """Slot never handed out, read and written by padding rows."""
        slots = max_requests + 1
        self.conv_states: dict[int, torch.Tensor] = {}
        """Global layer index -> ``[slots, conv_dim, K - 1]`` (parameter dtype)."""
        self.ssm_states: dict[int, torch.Tensor] = {}
        """Global layer index -> float32 ``[slots, H, P, N]``."""
        for mixer in mixers:
            taps = mixer.conv_weight.shape[1]
            self.conv_states[mixer.layer_idx] = torch.zeros(
                (slots, mixer.conv_dim, taps - 1), dtype=mixer.conv_weight.dtype, device=device
            )
            self.ssm_states[mixer.layer_idx] = torch.zeros(
                (slots, mixer.num_heads, mixer.head_dim, mixer.state_size),
                dtype=torch.float32,
                device=device,
            )
        self.device = device

    @property
    def nbytes(self) -> int:
        """Bytes held by the state buffers."""
        tensors = [*self.conv_states.values(), *self.ssm_states.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def admit(self, request_id: int) -> int:
        """Give a newly admitted request a zeroed slot.

        Args:
            request_id: The request.

        Returns:
            Its slot.
        """
        slot = self.allocator.allocate(request_id)
        self._zero(slot)
        return slot

    def release(self, request_id: int) -> None:
        """Return a request's slot (when its KV blocks are freed).

        Args:
            request_id: The request.
        """
        self.allocator.free(request_id)

    def _zero(self, slot: int) -> None:
        for tensor in (*self.conv_states.values(), *self.ssm_states.values()):
            tensor[slot].zero_()

    def step_state(
        self, entries: Sequence[tuple[int, int]], *, decode: bool, padding: int = 0
    ) -> MambaStepState:
        """The Mamba view of one step.

        Args:
            entries: ``(request_id, number of new tokens)`` in row order.
            decode: Every request feeds one token.
            padding: Padding rows after the requests' tokens (graph buckets, expert-parallel
                lockstep): each is a one-token sequence on the scratch slot.

        Returns:
            The step state (``cu_seqlens`` int32 and ``slot_indices`` on the device).

        Raises:
            BlockAllocatorError: If a request holds no slot.
        """
        slots: list[int] = []
        offsets = [0]
        for request_id, count in entries:
            slot = self.allocator.slot_of(request_id)
            if slot is None:
                raise BlockAllocatorError(f"request_id={request_id} holds no Mamba state slot")
            slots.append(slot)
            offsets.append(offsets[-1] + count)
        for _ in range(padding):
            slots.append(self.scratch_slot)
            offsets.append(offsets[-1] + 1)
        return MambaStepState(
            conv_states=self.conv_states,
            ssm_states=self.ssm_states,
            cu_seqlens=torch.tensor(offsets, dtype=torch.int32).to(self.device, non_blocking=True),
            slot_indices=torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True),
            decode=decode,
        )

    def close(self) -> None:
        """Drop the buffers."""
        self.conv_states = {}
        self.ssm_states = {}
