"""Sequence packing: the packed tensors of a batch of bins.

Packing puts several sequences in one fixed-size row (a bin) so that training forwards no
padding. :func:`~mcore_rl.bin_packing.pack_sequences` chooses the bins,
:class:`PackingContext` builds the packed tensors (positions restart per sequence,
``cu_seqlens`` padded to a fixed length so the shapes do not change between steps, which CUDA
graphs need), :func:`~mcore_rl.bin_packing.distribute_bins` gives every data-parallel rank the
same number of bins with balanced token work. The bin-packing names are importable from here
too.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.bin_packing import (
    PackingAlgorithm,
    PackingInfo,
    distribute_bins,
    pack_sequences,
)
from mcore_rl.errors import PackingError

__all__ = [
    "PackingAlgorithm",
    "PackingInfo",
    "PackingContext",
    "pack_sequences",
    "distribute_bins",
]


def _as_tensors(
    sequences: Sequence[Sequence[Any]], typecode: str = "q", dtype: torch.dtype = torch.int64
) -> Iterator[torch.Tensor]:
    # One conversion of all the lists (per-list tensor construction dominates packing).
    flat = array.array(typecode, itertools.chain.from_iterable(sequences))
    lengths = [len(seq) for seq in sequences]
    if not flat:
        return iter([torch.zeros(0, dtype=dtype) for _ in lengths])
    return iter(torch.frombuffer(flat, dtype=dtype).split(lengths))


@dataclass(kw_only=True, slots=True)
class PackingContext:
    """Packed tensors of some bins, ready for a training forward.

    Positions ``q`` of a packed row are prediction positions: ``target_ids[q]`` is the token
    that follows ``input_ids[q]`` in the same sequence, and ``loss_mask[q]`` is 1 when that
    token is a completion token. Padding forms a final segment of every row (and, with
    ``info.slot_multiple > 1``, the end of every sequence's slot).
    """

    input_ids: torch.Tensor
    """Packed tokens, int64 ``[num_bins, bin_size]``."""
    position_ids: torch.Tensor
    """Positions restarting at 0 for every sequence, int64 ``[num_bins, bin_size]``."""
    target_ids: torch.Tensor
    """Next token within the sequence (pad elsewhere), int64 ``[num_bins, bin_size]``."""
    loss_mask: torch.Tensor
    """1.0 where the target is a completion token, float32 ``[num_bins, bin_size]``."""
    advantages: torch.Tensor
    """Advantage of the target's sequence on loss positions, float32 ``[num_bins, bin_size]``."""
    cu_seqlens: torch.Tensor
    """Cumulative sequence starts per row, padding included as the last segment and repeated
    to a fixed length ``max_sequences_per_bin + 2``, int32 ``[num_bins, max_sequences_per_bin + 2]``."""
    max_seqlen: int
    """Upper bound of a segment length (the bin size), fixed so shapes never change."""
    bin_indices: list[int]
    """The bins of the :class:`PackingInfo` these rows hold (``-1`` for an empty bin)."""
    info: PackingInfo
    """The packing the rows come from."""
    prompt_lengths: list[int]
    """Prompt length of every sequence of the packing (indexed like ``info.lengths``)."""
    prefix_of: torch.Tensor | None = None
    """With shared prompts (:mod:`mcore_rl.shared_prompts`): int64 ``[num_bins,
    max_sequences_per_bin + 1]``, per segment of a row the index (in the row) of the prefix
    segment it also attends to, or -1; None when every sequence is packed whole."""
    context_parallel_size: int = 1
    """1 for full rows; ``cp`` when the per-token tensors hold one context-parallel rank's
    ``bin_size / cp`` tokens of every row (``cu_seqlens`` and ``max_seqlen`` stay those of the
    full rows); see :func:`mcore_rl.context_parallel.split_packing_context`."""

    @classmethod
    def build(
        cls,
        sequences: Sequence[Sequence[int]],
        prompt_lengths: Sequence[int],
        advantages: Sequence[float] | torch.Tensor,
        info: PackingInfo,
        *,
        bin_indices: Sequence[int] | None = None,
        max_sequences_per_bin: int | None = None,
        pad_id: int = 0,
        position_offsets: Sequence[int] | None = None,
        prefix_of: Sequence[int] | None = None,
    ) -> PackingContext:
        """Builds the packed rows of some bins.

        Args:
            sequences: Every sequence (prompt followed by completion), indexed like
                ``info.lengths``.
            prompt_lengths: Prompt tokens of every sequence, at least 1.
            advantages: One advantage per sequence.
            info: The packing.
            bin_indices: Which bins to build (``-1`` for an empty bin); None for all.
            max_sequences_per_bin: Fixed ``cu_seqlens`` width; None uses the fullest bin.
            pad_id: Token id of padding.
            position_offsets: Position of every sequence's first token (None: all 0); a
                shared prompt's child segment continues its prompt's positions.
            prefix_of: Per sequence, the sequence (in the same bin, earlier) whose tokens it
                also attends to, or -1; None for no shared prefixes.

        Returns:
            The context.

        Raises:
            PackingError: If the inputs do not match ``info``, a bin index is out of range or
                a bin holds more sequences than ``max_sequences_per_bin``.
        """
        if len(sequences) != len(info.lengths) or len(prompt_lengths) != len(info.lengths):
            raise PackingError(
                f"got {len(sequences)} sequences and {len(prompt_lengths)} prompt lengths, "
                f"expected {len(info.lengths)} (the packing's sequence count)"
            )
        if len(advantages) != len(info.lengths):
            raise PackingError(
                f"got {len(advantages)} advantages, expected {len(info.lengths)} (one per sequence)"
            )
        for i, seq in enumerate(sequences):
            if len(seq) != info.lengths[i] or not 1 <= prompt_lengths[i] <= len(seq):
                raise PackingError(
                    f"sequence {i} has {len(seq)} tokens and prompt length {prompt_lengths[i]}, "
                    f"expected {info.lengths[i]} tokens and 1 <= prompt length <= that"
                )
        chosen = list(range(info.num_bins)) if bin_indices is None else list(bin_indices)
        bad = [b for b in chosen if not -1 <= b < info.num_bins]
        if bad:
            raise PackingError(
                f"bin_indices holds {bad[0]}, expected -1 (an empty bin) or a bin index in "
                f"[0, {info.num_bins})"
            )
        if position_offsets is not None and len(position_offsets) != len(info.lengths):
            raise PackingError(
                f"got {len(position_offsets)} position offsets, expected {len(info.lengths)}"
            )
        if prefix_of is not None and len(prefix_of) != len(info.lengths):
            raise PackingError(
                f"got {len(prefix_of)} prefix_of entries, expected {len(info.lengths)}"
            )
        fullest = max((len(info.bins[b]) for b in chosen if b >= 0), default=1)
        width = max_sequences_per_bin or fullest
        if fullest > width:
            raise PackingError(
                f"a bin holds {fullest} sequences, more than max_sequences_per_bin={width}"
            )
        rows, size = len(chosen), info.bin_size
        input_ids = torch.full((rows, size), pad_id, dtype=torch.long)
        target_ids = torch.full((rows, size), pad_id, dtype=torch.long)
        position_ids = torch.zeros((rows, size), dtype=torch.long)
        loss_mask = torch.zeros((rows, size))
        packed_advantages = torch.zeros((rows, size))
        cu_seqlens = torch.full((rows, width + 2), size, dtype=torch.int32)
        parents = None if prefix_of is None else torch.full((rows, width + 1), -1)
        members_of = [info.bins[b] if b >= 0 else () for b in chosen]
        tokens_of = _as_tensors([sequences[i] for members in members_of for i in members])
        for row, members in enumerate(members_of):
            offset = 0
            cu_seqlens[row, 0] = 0
            for k, i in enumerate(members):
                tokens = next(tokens_of)
                n, p = len(tokens), int(prompt_lengths[i])
                # A slot's padding (context parallelism) continues the sequence's positions.
                slot = info.slot_length(i)
                input_ids[row, offset : offset + n] = tokens
                target_ids[row, offset : offset + n - 1] = tokens[1:]
                first = 0 if position_offsets is None else int(position_offsets[i])
                position_ids[row, offset : offset + slot] = torch.arange(first, first + slot)
                if parents is not None and prefix_of is not None and prefix_of[i] >= 0:
                    if prefix_of[i] not in members[:k]:
                        raise PackingError(
                            f"sequence {i}'s prefix {prefix_of[i]} is not earlier in its bin"
                        )
                    parents[row, k] = members.index(prefix_of[i])
                loss_mask[row, offset + p - 1 : offset + n - 1] = 1.0
                packed_advantages[row, offset + p - 1 : offset + n - 1] = float(advantages[i])
                offset += slot
                cu_seqlens[row, k + 1] = offset
            position_ids[row, offset:] = torch.arange(size - offset)
        return cls(
            input_ids=input_ids,
            position_ids=position_ids,
            target_ids=target_ids,
            loss_mask=loss_mask,
            advantages=packed_advantages,
            cu_seqlens=cu_seqlens,
            max_seqlen=size,
            bin_indices=chosen,
            info=info,
            prompt_lengths=[int(p) for p in prompt_lengths],
            prefix_of=parents,
        )

    def scatter(self, values: Sequence[torch.Tensor | Sequence[float]]) -> torch.Tensor:
        """Places per-completion-token values (e.g. inference log-probs) on the packed rows.

        Args:
            values: For every sequence of the packing, one value per completion token (tensors,
                or lists of floats, converted all at once).

        Returns:
            Float32 ``[num_bins, bin_size]``, zero outside loss positions.
        """
        out = torch.zeros(self.loss_mask.shape)
        segments = list(self._segments())
        lists = [values[i] for *_, i in segments]
        if all(isinstance(v, torch.Tensor) for v in lists):
            tensors = iter([torch.as_tensor(v) for v in lists])
        else:
            tensors = _as_tensors(lists, "d", torch.float64)
        for row, _b, offset, i in segments:
            p, n = self.prompt_lengths[i], self.info.lengths[i]
            out[row, offset + p - 1 : offset + n - 1] = next(tensors).float()
        return out

    def gather(self, packed: torch.Tensor) -> dict[int, torch.Tensor]:
        """Reads per-completion-token values back from packed rows.

        Args:
            packed: ``[num_bins, bin_size]`` values at prediction positions.

        Returns:
            Sequence index -> its completion-token values, for the sequences of these rows.
        """
        out = {}
        for row, _b, offset, i in self._segments():
            p, n = self.prompt_lengths[i], self.info.lengths[i]
            out[i] = packed[row, offset + p - 1 : offset + n - 1]
        return out

    def _segments(self):
        if self.context_parallel_size > 1:
            raise PackingError(
                f"context_parallel_size={self.context_parallel_size}: these rows hold one "
                "context-parallel rank's tokens; scatter and gather work on full rows"
            )
        for row, b in enumerate(self.bin_indices):
            if b < 0:
                continue
            offset = 0
            for i in self.info.bins[b]:
                yield row, b, offset, i
                offset += self.info.slot_length(i)

    @property
    def num_tokens(self) -> int:
        """Loss tokens in these rows.

        Returns:
            The count.
        """
        return int(self.loss_mask.sum().item())
