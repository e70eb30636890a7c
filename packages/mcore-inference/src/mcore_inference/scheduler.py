"""Admission and per-step scheduling: which requests hold KV blocks and which tokens run."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from mcore_inference.block_allocator import BlockAllocator
from mcore_inference.config import InferenceConfig
from mcore_inference.request import Request, RequestStatus
from mcore_inference.transfer import to_device

__all__ = ["GRAPH_BACKLOG_STEPS", "Scheduler"]

GRAPH_BACKLOG_STEPS = 8
"""When steps that prefill run in CUDA graphs, prompt tokens are prefilled at most a graph
bucket per step while the backlog of them fits in this many steps. An eager step costs about
as much host time as 15 graph steps (Qwen2.5-0.5B shape on an H100: 21 ms against 1.2 to
1.8 ms), so small backlogs, such as requests arriving while others decode, go through graphs;
a large one (hundreds of prompts submitted at once) is prefilled in whole-budget eager steps,
since a bucket at a time it would admit the last requests only after many steps, each of
which decodes a batch that is not yet full."""


class Scheduler:
    """Waiting queue, active set, KV blocks and block-table rows of the engine's requests.

    Admission is first come, first served and reserves a request's whole footprint (prompt plus
    the tokens it may generate), so an admitted request never runs out of cache and nothing is
    ever preempted; the head of the queue waits until it fits, so a long request is never
    starved by later short ones. Each step gives every decoding request one token, then fills
    the rest of the token budget with prefill chunks in admission order.

    Args:
        config: Engine configuration (batch size, block size, budgets).
        allocator: Allocator of the KV blocks.
        device: Device of the block table.
    """

    def __init__(
        self, config: InferenceConfig, allocator: BlockAllocator, device: torch.device
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.padding_row = config.max_batch_size
        """Block-table row holding only the scratch block, read by padded graph rows."""
        self.block_tables = torch.zeros(
            (config.max_batch_size + 1, config.max_blocks_per_sequence),
            dtype=torch.int32,
            device=device,
        )
        """int32 ``[max_batch_size + 1, max_blocks]``: one row per request slot, then padding."""
        self.waiting: deque[Request] = deque()
        """Requests queued for blocks, oldest first."""
        self.active: list[Request] = []
        """Requests holding blocks, in admission order."""
        self._free_slots = list(range(config.max_batch_size - 1, -1, -1))
        self.on_admit: list[Callable[[Request], None]] = []
        """Called with each request as it becomes active (per-request state such as the
        Mamba state slots is allocated here)."""
        self.on_free: list[Callable[[Request], None]] = []
        """Called with each request whose blocks are freed (its other state goes too)."""
        self.graph_step_tokens: int | None = None
        """Most tokens of a step that runs in a CUDA graph (the largest decode bucket), set by
        the engine when steps that prefill replay the decode graphs; None: every step may take
        the whole token budget."""
        self.share_prefixes = config.share_prompt_prefixes
        """Share the full KV blocks of identical prompt prefixes (the engine turns it off for
        hybrid models)."""
        self._prefix_holders: dict[tuple[int, ...], list[Request]] = {}
        self.graph_backlog_steps = GRAPH_BACKLOG_STEPS
        """Prompt tokens waiting to be prefilled are taken a graph step at a time while they
        fit in this many graph steps (see :data:`GRAPH_BACKLOG_STEPS`)."""

    def blocks_needed(self, prompt_len: int, new_tokens: int) -> int:
        """KV blocks of a request's whole footprint.

        Args:
            prompt_len: Prompt tokens.
            new_tokens: Tokens it may generate.

        Returns:
            The number of blocks; the last generated token is never fed back, so it needs no
            cache slot.
        """
        positions = prompt_len + max(new_tokens, 1) - 1
        return -(-positions // self.config.block_size)

    def admit(self) -> None:
        """Move waiting requests to the active set while slots and blocks allow."""
        admitted: list[Request] = []
        while self.waiting and self._free_slots:
            request = self.waiting[0]
            needed = self.blocks_needed(len(request.prompt), request.max_new_tokens)
            key, donor = self._prefix_donor(request) if self.share_prefixes else (None, None)
            shared = (
                donor.blocks[: len(key) // self.config.block_size]
                if donor is not None and key is not None
                else []
            )
            if needed - len(shared) > self.allocator.num_free:
                break
            self.waiting.popleft()
            request.blocks = shared + self.allocator.allocate(needed - len(shared))
            if key is not None:
                self._hold_prefix(request, key, donor, shared)
            request.slot = self._free_slots.pop()
            request.status = RequestStatus.ACTIVE
            self.active.append(request)
            admitted.append(request)
            for hook in self.on_admit:
                hook(request)
        if admitted:
            rows = torch.zeros(
                (len(admitted), self.config.max_blocks_per_sequence), dtype=torch.int32
            )
            for row, request in zip(rows, admitted):
                row[: len(request.blocks)] = torch.tensor(request.blocks, dtype=torch.int32)
            device = self.block_tables.device
            slots = to_device([r.slot for r in admitted], torch.long, device)
            self.block_tables.index_copy_(0, slots, to_device(rows, torch.int32, device))

    def _prefix_key(self, request: Request) -> tuple[int, ...] | None:
        # The tokens of the full blocks before the one holding the prompt's last token.
        size = self.config.block_size
        count = (len(request.prompt) - 1) // size
        return tuple(request.prompt[: count * size]) if count else None

    def _prefix_donor(self, request: Request) -> tuple[tuple[int, ...] | None, Request | None]:
        key = self._prefix_key(request)
        holders = self._prefix_holders.get(key) if key is not None else None
        return key, holders[0] if holders else None

    def _hold_prefix(
        self, request: Request, key: tuple[int, ...], donor: Request | None, shared: list[int]
    ) -> None:
        self._prefix_holders.setdefault(key, []).append(request)
        request.shared_tokens = len(key)
        if donor is None:
            return  # the first holder computes the blocks itself
        self.allocator.share(shared)
        source = donor.prefix_source or donor
        if source.num_computed < request.shared_tokens:
            request.prefix_source = source
        else:
            request.num_computed = request.shared_tokens

    def _drop_prefix_hold(self, request: Request) -> None:
        if request.shared_tokens == 0:
            return
        key = self._prefix_key(request)
        holders = self._prefix_holders.get(key) if key is not None else None
        if holders is None or request not in holders:
            return
        holders.remove(request)
        if not holders:
            del self._prefix_holders[key]  # type: ignore[arg-type]
        if request.prefix_source is None and request.num_computed < request.shared_tokens:
            # It was computing the shared blocks and stops early (aborted): the first request
            # waiting for them computes them instead, into the same blocks.
            waiting = [h for h in holders or [] if h.prefix_source is request]
            if waiting:
                heir = waiting[0]
                heir.prefix_source = None
                for other in waiting[1:]:
                    other.prefix_source = heir
        request.prefix_source = None

    def schedule(self, max_decode: int | None = None) -> list[tuple[Request, int]]:
        """Pick the tokens of the next step (or pipeline microbatch).

        Requests waiting for a token still in the pipeline are skipped.

        Args:
            max_decode: Most decoding requests to take (None: all); a pipeline splits the
                decoding requests into one group per stage with it.

        Returns:
            ``(request, number of tokens)`` pairs: decoding requests first (one token
            each), then prefill chunks within the remaining budget.
        """
        budget = self.config.max_tokens_per_step or self.config.max_batch_size
        batch: list[tuple[Request, int]] = []
        prefilling: list[tuple[Request, int]] = []
        for request in self.active:
            source = request.prefix_source
            if source is not None:
                # Its shared blocks are computed once the source's tokens up to them have been
                # scheduled in an earlier step (they run before this step's, on every stage).
                if source.num_computed < request.shared_tokens:
                    continue
                request.prefix_source = None
                request.num_computed = request.shared_tokens
            if request.awaiting_token:
                # Its sampled tokens are still on the device: it may decode the newest now when
                # they cannot end it by length (a stop token only ends it when read, and the
                # step it then wasted wrote inside its footprint).
                if (
                    request.deferred_index >= 0
                    and len(request.output) + request.unread < request.max_new_tokens
                    and (max_decode is None or len(batch) < max_decode)
                ):
                    batch.append((request, 1))
                continue
            remaining = len(request.prompt) + len(request.output) - request.num_computed
            if remaining == 1:
                if max_decode is None or len(batch) < max_decode:
                    batch.append((request, 1))
            elif remaining > 1:
                prefilling.append((request, remaining))
        graph = self.graph_step_tokens
        if graph is not None and len(batch) < graph:
            # A graph step while the backlog of prompt tokens fits in a few of them; a larger
            # backlog goes in whole-budget (eager) steps that admit it at once.
            pending = sum(remaining for _, remaining in prefilling)
            if pending <= self.graph_backlog_steps * (graph - len(batch)):
                budget = min(budget, graph)
        budget -= len(batch)
        chunk = self.config.prefill_chunk_size
        for request, remaining in prefilling:
            if budget <= 0:
                break
            count = min(remaining, chunk, budget)
            batch.append((request, count))
            budget -= count
        return batch

    def release(self, request: Request, *, keep_blocks: bool = False) -> None:
        """Remove a request from the queue or the active set, freeing its blocks and slot.

        Args:
            request: A waiting or active request (others are left alone).
            keep_blocks: Keep its blocks and slot (a pipeline stage still writes into them);
                free them later with :meth:`free_blocks`.
        """
        if request.status == RequestStatus.ACTIVE:
            self.active.remove(request)
            if keep_blocks:
                self._drop_prefix_hold(request)
            else:
                self.free_blocks(request)
        elif request.status == RequestStatus.WAITING and request in self.waiting:
            self.waiting.remove(request)

    def free_blocks(self, request: Request) -> None:
        """Return a request's blocks and block-table slot (once it left the active set).

        Args:
            request: A request removed with ``release(..., keep_blocks=True)``.
        """
        if request.slot >= 0:
            for hook in self.on_free:
                hook(request)
            self._drop_prefix_hold(request)
            self.allocator.free(request.blocks)
            self._free_slots.append(request.slot)
            request.blocks, request.slot = [], -1

    def find(self, request_id: int) -> Request | None:
        """Look up a waiting or active request.

        Args:
            request_id: Id from ``add_request``.

        Returns:
            The request, or None if it is neither waiting nor active.
        """
        for request in (*self.waiting, *self.active):
            if request.request_id == request_id:
                return request
        return None

    def clear(self) -> None:
        """Forget every request (on engine close)."""
        self.waiting.clear()
        self.active.clear()
        self._prefix_holders.clear()
