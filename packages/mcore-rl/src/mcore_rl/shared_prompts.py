"""Packing with shared prompts: every group's prompt once per row, its completions attending to it.

The completions of a GRPO group continue one prompt. Packed one copy per sequence, a row
recomputes that prompt for every completion (``group_size`` times); here a row holds the
prompt's first ``p - 1`` tokens once, as a *prefix* segment, and every completion as a *child*
segment ``[last prompt token, completion...]`` whose positions continue the prompt's and whose
attention also reads the whole prefix (``mcore_models.PackedSeqParams.prefix_of``). Every
child's tokens see exactly the context they see in their own copy, so the log-probs (and the
gradients, the prefix's summed over its children) are those of the unshared packing up to
rounding, for about half the tokens at 256-token prompts and completions.

A group that does not fit the rest of a row continues in the next one with a new copy of its
prefix. The rows are as short as they can be while their number stays that of the token budget
(less padding computed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mcore_rl.errors import PackingError
from mcore_rl.packing import PackingContext, PackingInfo, distribute_bins

__all__ = ["SharedPromptPacking", "build_shared_prompt_rows", "pack_shared_prompts"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedPromptPacking:
    """Segments (prefixes and children) of sequences that share prompts, and their bins."""

    segments: list[list[int]]
    """Tokens of every segment (the packing's "sequences")."""
    prompt_lengths: list[int]
    """Per segment, the tokens before its first loss position plus one: a prefix's whole
    length (no loss position), 1 for a child (its first token predicts the completion)."""
    position_offsets: list[int]
    """Position of every segment's first token (a child continues its prompt)."""
    prefix_of: list[int]
    """Per segment, the index of its prefix segment (in the same bin, earlier), or -1."""
    owner: list[int]
    """Per segment, the sequence whose completion it holds, or -1 for a prefix."""
    info: PackingInfo
    """The bins of the segments."""

    def child_of(self) -> dict[int, int]:
        """Sequence index -> the segment holding its completion.

        Returns:
            The mapping.
        """
        return {i: s for s, i in enumerate(self.owner) if i >= 0}


def _next_fit(
    groups: list[tuple[int, list[int]]], capacity: int, limit: int
) -> list[list[tuple[int, list[int]]]] | None:
    """Bins of ``(prefix length, child lengths)`` pieces; None if a piece cannot fit."""
    bins: list[list[tuple[int, list[int]]]] = [[]]
    room, count = capacity, 0
    for prefix, children in groups:
        pending = list(children)
        while pending:
            # The prefix plus at least one child must fit; else open a new bin.
            if prefix + pending[0] > room or count + (2 if prefix else 1) > limit:
                if not bins[-1]:
                    return None
                bins.append([])
                room, count = capacity, 0
                continue
            room -= prefix
            count += 1 if prefix else 0
            taken: list[int] = []
            while pending and pending[0] <= room and count < limit:
                room -= pending[0]
                count += 1
                taken.append(pending.pop(0))
            bins[-1].append((prefix, taken))
    return bins


def pack_shared_prompts(
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    *,
    token_budget: int,
    pad_multiple: int = 8,
    max_sequences_per_bin: int | None = None,
) -> SharedPromptPacking:
    """Packs sequences so that those with identical prompts share one copy per row.

    Sequences whose prompt has a single token, or whose prompt no other sequence shares, are
    packed whole (a prefix of one child saves nothing).

    Args:
        sequences: Every sequence (prompt followed by completion).
        prompt_lengths: Prompt tokens of every sequence.
        token_budget: Most tokens of a row.
        pad_multiple: Row lengths are multiples of this.
        max_sequences_per_bin: Most segments in one row; None for no limit.

    Returns:
        The segments and their bins.

    Raises:
        PackingError: If the inputs disagree, a prompt length is not in ``[1, tokens]``, a
            budget or limit is not positive. Rows are at least as long as the longest prefix
            plus child.
    """
    if len(sequences) != len(prompt_lengths):
        raise PackingError(
            f"got {len(sequences)} sequences and {len(prompt_lengths)} prompt lengths; expected "
            "one prompt length per sequence"
        )
    if token_budget < 1 or pad_multiple < 1:
        raise PackingError(
            f"token_budget={token_budget} and pad_multiple={pad_multiple} must be >= 1"
        )
    if max_sequences_per_bin is not None and max_sequences_per_bin < 2:
        raise PackingError(f"max_sequences_per_bin={max_sequences_per_bin} must be >= 2")
    order: dict[tuple[int, ...], list[int]] = {}
    for i, (sequence, p) in enumerate(zip(sequences, prompt_lengths)):
        if not 1 <= p <= len(sequence):
            raise PackingError(
                f"sequence {i} has {len(sequence)} tokens and prompt length {p}; expected "
                "1 <= prompt length <= tokens"
            )
        order.setdefault(tuple(sequence[:p]), []).append(i)
    # (prefix length, members): a prefix of 0 tokens packs its member whole.
    units: list[tuple[int, list[int]]] = []
    for prompt, group in order.items():
        if len(prompt) > 1 and len(group) > 1:
            units.append((len(prompt) - 1, group))
        else:
            units.extend((0, [i]) for i in group)
    lengths = [len(s) for s in sequences]

    def child_length(unit: tuple[int, list[int]], i: int) -> int:
        return lengths[i] - unit[0]

    pieces = [(prefix, [child_length((prefix, m), i) for i in m]) for prefix, m in units]
    longest = max(prefix + max(children) for prefix, children in pieces)
    multiple = pad_multiple
    capacity = -(-max(token_budget, longest) // multiple) * multiple
    limit = max_sequences_per_bin or sum(len(m) * 2 for _, m in units) + 1
    bins = _next_fit(pieces, capacity, limit)
    if bins is None:
        raise PackingError(
            f"a sequence needs more than max_sequences_per_bin={max_sequences_per_bin} segments "
            "or the token budget"
        )
    # The shortest rows that keep the number of rows: less padding computed.
    low, high = -(-longest // multiple), capacity // multiple
    while low < high:
        middle = (low + high) // 2
        trial = _next_fit(pieces, middle * multiple, limit)
        if trial is not None and len(trial) <= len(bins):
            high = middle
        else:
            low = middle + 1
    capacity = high * multiple
    bins = _next_fit(pieces, capacity, limit)
    assert bins is not None
    segments: list[list[int]] = []
    prompts: list[int] = []
    offsets: list[int] = []
    parents: list[int] = []
    owners: list[int] = []
    bin_members: list[tuple[int, ...]] = []
    unit_of_piece = iter(units)
    current = next(unit_of_piece)
    taken_of_unit = 0
    for row in bins:
        members: list[int] = []
        for prefix, children in row:
            while taken_of_unit == len(current[1]):
                current = next(unit_of_piece)
                taken_of_unit = 0
            chosen = current[1][taken_of_unit : taken_of_unit + len(children)]
            taken_of_unit += len(children)
            parent = -1
            if prefix > 0:
                first = sequences[chosen[0]]
                parent = len(segments)
                members.append(parent)
                segments.append(list(first[:prefix]))
                prompts.append(prefix)
                offsets.append(0)
                parents.append(-1)
                owners.append(-1)
            for i in chosen:
                members.append(len(segments))
                segments.append(list(sequences[i][prefix:]))
                prompts.append(int(prompt_lengths[i]) - prefix)
                offsets.append(prefix)
                parents.append(parent)
                owners.append(i)
        bin_members.append(tuple(members))
    info = PackingInfo(
        bins=tuple(bin_members),
        bin_size=capacity,
        lengths=tuple(len(s) for s in segments),
        algorithm="shared_prompts",
    )
    return SharedPromptPacking(
        segments=segments,
        prompt_lengths=prompts,
        position_offsets=offsets,
        prefix_of=parents,
        owner=owners,
        info=info,
    )


def build_shared_prompt_rows(
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    advantages: Sequence[float],
    inference_logprobs: Sequence[Sequence[float]],
    *,
    token_budget: int,
    pad_multiple: int = 8,
    max_sequences_per_bin: int | None = None,
    dp_size: int = 1,
    dp_rank: int = 0,
    bin_multiple: int = 1,
    pad_id: int = 0,
) -> tuple[PackingContext, torch.Tensor, float]:
    """This data-parallel rank's packed rows of sequences with shared prompts.

    Args:
        sequences: Every sequence (prompt followed by completion).
        prompt_lengths: Prompt tokens of every sequence.
        advantages: One advantage per sequence.
        inference_logprobs: Per sequence, the inference engine's log-prob of every completion
            token.
        token_budget: Most tokens of a row.
        pad_multiple: Row lengths are multiples of this.
        max_sequences_per_bin: Most segments in one row; None for no limit.
        dp_size: Data-parallel ranks the rows are shared over.
        dp_rank: This rank.
        bin_multiple: This rank's row count is padded (with empty rows) to a multiple of this.
        pad_id: Token id of padding.

    Returns:
        ``(context, inference log-probs on its rows, efficiency)``; the efficiency counts the
        unshared tokens against the capacity of all rows (above 1 when prompts are shared).

    Raises:
        PackingError: If the inputs disagree (see :func:`pack_shared_prompts`).
    """
    if len(advantages) != len(sequences) or len(inference_logprobs) != len(sequences):
        raise PackingError(
            f"got {len(advantages)} advantages and {len(inference_logprobs)} log-prob lists for "
            f"{len(sequences)} sequences; expected one of each per sequence"
        )
    shared = pack_shared_prompts(
        sequences,
        prompt_lengths,
        token_budget=token_budget,
        pad_multiple=pad_multiple,
        max_sequences_per_bin=max_sequences_per_bin,
    )
    info = shared.info
    mine = distribute_bins(info, dp_size)[dp_rank]
    mine = mine + [-1] * (-len(mine) % bin_multiple)
    context = PackingContext.build(
        shared.segments,
        shared.prompt_lengths,
        [float(advantages[i]) if i >= 0 else 0.0 for i in shared.owner],
        info,
        bin_indices=mine,
        max_sequences_per_bin=max_sequences_per_bin,
        pad_id=pad_id,
        position_offsets=shared.position_offsets,
        prefix_of=shared.prefix_of,
    )
    logprobs = context.scatter([inference_logprobs[i] if i >= 0 else [] for i in shared.owner])
    efficiency = sum(len(s) for s in sequences) / (info.num_bins * info.bin_size)
    return context, logprobs, efficiency
