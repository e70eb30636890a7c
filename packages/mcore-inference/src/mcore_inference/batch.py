"""Microbatches: the tokens of one engine step, flattened into one row, and their metadata."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from mcore_inference.request import Request
from mcore_inference.transfer import to_device

__all__ = ["Microbatch", "build_microbatch"]


@dataclass(slots=True)
class Microbatch:
    """The tokens one step feeds through the model (through every pipeline stage in turn).

    Built once, when the scheduler picks the tokens; every rank of a model replica builds the
    same one. A request whose chunk ends at its last known token samples from this microbatch
    (``sampling``, with the row of its last token in ``sample_rows``).
    """

    entries: list[tuple[Request, int]]
    """``(request, number of tokens)`` in row order."""
    tokens: list[int] = field(default_factory=list)
    """Token ids (used by the first stage)."""
    positions: list[int] = field(default_factory=list)
    """Position of each token."""
    table_rows: list[int] = field(default_factory=list)
    """Block-table row of each token's request."""
    sample_rows: list[int] = field(default_factory=list)
    """Rows whose logits sample a token."""
    sampling: list[Request] = field(default_factory=list)
    """Requests that sample, in the order of ``sample_rows``."""
    deferred_rows: list[int] = field(default_factory=list)
    """Rows whose token is a sample still on the device (``token_source``)."""
    deferred_columns: list[int] = field(default_factory=list)
    """Column of ``token_source`` holding each of those rows' token."""
    token_source: torch.Tensor | None = None
    """float64 ``[2, n]`` samples of the previous step on the device, when rows read them."""
    steps: int = 1
    """Decode steps run back to back from it (multi-step decode, see
    :mod:`mcore_inference.multi_step`): step ``j`` feeds every row the token step ``j - 1``
    sampled, one position further; 1 for an ordinary step."""

    @property
    def num_tokens(self) -> int:
        """Tokens of the microbatch."""
        return len(self.positions)

    @property
    def is_decode(self) -> bool:
        """Whether every request feeds exactly one token (a CUDA-graph step)."""
        return bool(self.entries) and self.num_tokens == len(self.entries)

    def pad(self, count: int, padding_row: int) -> None:
        """Append ``count`` padding rows: token 0 at position 0 through the scratch-block row.

        Args:
            count: Rows to append.
            padding_row: Block-table row that holds only the scratch block.
        """
        self.tokens.extend([0] * count)
        self.positions.extend([0] * count)
        self.table_rows.extend([padding_row] * count)

    def inputs(self, device: torch.device) -> torch.Tensor:
        """The int64 ``[3, T]`` tensor of token ids, positions and block-table rows.

        Rows in ``deferred_rows`` take their token from ``token_source`` on the device.

        Args:
            device: Target device.

        Returns:
            The step's input tensor.
        """
        # array('q') converts the lists in C; torch.tensor over nested lists is several times slower.
        packed = array("q", self.tokens)
        packed.extend(self.positions)
        packed.extend(self.table_rows)
        count = self.num_tokens
        deferred = len(self.deferred_rows)
        # The common decode step: every row takes the previous step's sample of its column, in
        # order (the same requests as the step before): one copy instead of a gather.
        in_order = (
            deferred == count
            and self.token_source is not None
            and self.token_source.shape[1] >= count
            and self.deferred_rows == self.deferred_columns == list(range(count))
        )
        if deferred and not in_order:
            packed.extend(self.deferred_rows)
            packed.extend(self.deferred_columns)
        # One host-to-device copy for the inputs and the deferred-token indices.
        moved = to_device(torch.frombuffer(packed, dtype=torch.long), torch.long, device)
        inputs = moved[: 3 * count].view(3, count)
        if in_order:
            assert self.token_source is not None
            inputs[0].copy_(self.token_source[0, :count])
        elif deferred:
            assert self.token_source is not None
            rows, columns = moved[3 * count :].view(2, deferred)
            tokens = self.token_source[0].index_select(0, columns).long()
            inputs[0].index_copy_(0, rows, tokens)
        return inputs


def build_microbatch(batch: list[tuple[Request, int]]) -> Microbatch:
    """Flatten the scheduled tokens and commit them to the requests.

    Each request's ``num_computed`` advances by its token count at once (the tokens are on
    their way), a request that will sample is marked ``awaiting_token`` until the sampled token
    comes back, and ``in_flight`` counts the microbatches that still write its cache.

    Args:
        batch: ``(request, number of tokens)`` pairs from the scheduler.

    Returns:
        The microbatch.
    """
    microbatch = Microbatch(entries=batch)
    tokens, positions, rows = microbatch.tokens, microbatch.positions, microbatch.table_rows
    # Bound methods: this loop runs once per request and step (hundreds per step at large
    # batch), so attribute lookups are a visible share of the host's time.
    add_token, add_position, add_row = tokens.append, positions.append, rows.append
    add_deferred_row = microbatch.deferred_rows.append
    add_deferred_column = microbatch.deferred_columns.append
    add_sample_row, add_sampling = microbatch.sample_rows.append, microbatch.sampling.append
    for request, count in batch:
        start = request.num_computed
        column = request.deferred_index
        unread = request.unread
        if (
            count == 1
            and column >= 0
            and start == len(request.prompt) + len(request.output) + unread - 1
        ):
            # The steady decode row (most rows of a decode step): the token sampled in the
            # previous step and not read yet, fed from the device (see mcore_inference.readback),
            # and the row samples the next one. The general branch below does the same.
            row = len(tokens)
            add_deferred_row(row)
            add_deferred_column(column)
            add_token(0)
            add_position(start)
            add_row(request.slot)
            add_sample_row(row)
            add_sampling(request)
            request.awaiting_token = True
            request.num_computed = start + 1
            request.in_flight += 1
            continue
        end = start + count
        prompt, output = request.prompt, request.output
        num_tokens = len(prompt) + len(output)
        if count == 1 and column >= 0 and end == num_tokens + unread:
            # Decode of the newest token sampled in the previous step and not read yet: the
            # device feeds it (see mcore_inference.readback).
            add_deferred_row(len(tokens))
            add_deferred_column(column)
            add_token(0)
            add_position(start)
            add_row(request.slot)
            num_tokens += unread
        elif count == 1 and end == num_tokens:  # decode: feed the newest token
            add_token(output[-1] if output else prompt[-1])
            add_position(start)
            add_row(request.slot)
        else:
            tokens.extend((prompt + output)[start:end])
            positions.extend(range(start, end))
            rows.extend([request.slot] * count)
        if end == num_tokens:
            add_sample_row(len(tokens) - 1)
            add_sampling(request)
            request.awaiting_token = True
        request.num_computed = end
        request.in_flight += 1
    return microbatch
