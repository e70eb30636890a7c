"""Bin packing of variable-length sequences into fixed-size rows, and the split of the bins over
the data-parallel ranks.

:func:`pack_sequences` chooses the bins (first-fit-decreasing, a modified FFD, or next-fit for
comparison) and :func:`distribute_bins` gives every data-parallel rank the same number of bins
with balanced token work; :class:`~mcore_rl.packing.PackingContext` builds the packed tensors.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from mcore_rl.errors import PackingError

__all__ = [
    "DEFAULT_TOKEN_BUDGET",
    "PackingAlgorithm",
    "PackingInfo",
    "distribute_bins",
    "pack_sequences",
]

PackingAlgorithm = Literal["ffd", "mffd", "next_fit"]
"""Bin-packing algorithms: first-fit-decreasing, modified FFD, and next-fit for comparison."""

DEFAULT_TOKEN_BUDGET = 4096
"""Tokens per bin when neither ``bin_size`` nor ``token_budget`` is given."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PackingInfo:
    """Which sequences share which bin."""

    bins: tuple[tuple[int, ...], ...]
    """For every bin, the indices of its sequences (into ``lengths``), in packed order."""
    bin_size: int
    """Capacity of every bin in tokens."""
    lengths: tuple[int, ...]
    """Length of every sequence."""
    algorithm: str
    """The algorithm that produced the bins."""
    slot_multiple: int = 1
    """Every sequence occupies a slot of its length rounded up to a multiple of this (context
    parallelism splits every packed sequence into ``2 cp`` equal chunks); the padding at the end
    of a slot is never a loss position."""

    def slot_length(self, index: int) -> int:
        """Tokens sequence ``index`` occupies in its bin: its length rounded up to the slot.

        Args:
            index: Sequence index (into ``lengths``).

        Returns:
            The slot length.
        """
        return -(-self.lengths[index] // self.slot_multiple) * self.slot_multiple

    @property
    def num_bins(self) -> int:
        """Number of bins.

        Returns:
            The count.
        """
        return len(self.bins)

    @property
    def bin_tokens(self) -> list[int]:
        """Tokens used in every bin.

        Returns:
            One count per bin.
        """
        return [sum(self.lengths[i] for i in b) for b in self.bins]

    @property
    def efficiency(self) -> float:
        """Fraction of bin capacity holding real tokens.

        Returns:
            ``sum(lengths) / (num_bins * bin_size)``, 1.0 for no bins.
        """
        if not self.bins:
            return 1.0
        return sum(self.lengths) / (self.num_bins * self.bin_size)


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    values = [int(n) for n in lengths]
    bad = [n for n in values if n <= 0]
    if bad:
        raise PackingError(f"lengths hold {bad[0]}, expected every length > 0")
    return values


def pack_sequences(
    lengths: Sequence[int],
    bin_size: int | None = None,
    max_sequences_per_bin: int | None = None,
    algorithm: PackingAlgorithm = "ffd",
    *,
    token_budget: int | None = None,
    pad_multiple: int = 8,
    slot_multiple: int = 1,
) -> PackingInfo:
    """Packs sequences into bins of ``bin_size`` tokens.

    Without ``bin_size``, the bin size is the token budget (default 4096, but no more than
    all tokens together), raised to the longest sequence and rounded up to ``pad_multiple``
    (and ``slot_multiple``).

    - ``"ffd"``: first-fit-decreasing, at most ``11/9 OPT + 6/9`` bins (Dósa, 2007).
    - ``"mffd"``: modified FFD (Johnson and Garey, 1985): items above half a bin open bins,
      then items in (1/3, 1/2] and pairs of items in (1/6, 1/3] are matched into them from
      the emptiest bin, then FFD places the rest (bound ``71/60 OPT + 1``).
    - ``"next_fit"``: next-fit in the given order, kept as a baseline.

    Args:
        lengths: Length of every sequence in tokens, each > 0.
        bin_size: Capacity of a bin; None derives it.
        max_sequences_per_bin: Most sequences in one bin; None for no limit.
        algorithm: Which algorithm.
        token_budget: Tokens per bin wanted when ``bin_size`` is None.
        pad_multiple: The derived bin size is a multiple of this.
        slot_multiple: Every sequence takes its length rounded up to a multiple of this
            (``2 * cp`` under context parallelism); bins hold slots.

    Returns:
        The packing.

    Raises:
        PackingError: If a length is not positive, a sequence (slot) is longer than
            ``bin_size``, a limit is not positive or ``algorithm`` is unknown.
    """
    real = _check_lengths(lengths)
    if slot_multiple < 1:
        raise PackingError(f"slot_multiple={slot_multiple} must be >= 1")
    sizes = [-(-n // slot_multiple) * slot_multiple for n in real]
    if max_sequences_per_bin is not None and max_sequences_per_bin < 1:
        raise PackingError(f"max_sequences_per_bin={max_sequences_per_bin} must be >= 1")
    if pad_multiple < 1:
        raise PackingError(f"pad_multiple={pad_multiple} must be >= 1")
    longest = max(sizes, default=1)
    if bin_size is None:
        if token_budget is not None and token_budget < 1:
            raise PackingError(f"token_budget={token_budget} must be >= 1")
        budget = min(token_budget or DEFAULT_TOKEN_BUDGET, max(sum(sizes), 1))
        multiple = math.lcm(pad_multiple, slot_multiple)
        bin_size = math.ceil(max(budget, longest) / multiple) * multiple
    elif bin_size < longest:
        raise PackingError(
            f"bin_size={bin_size} is smaller than the longest sequence ({longest} tokens)"
        )
    limit = max_sequences_per_bin or len(sizes) or 1
    if algorithm == "ffd":
        bins = _first_fit_decreasing(sizes, range(len(sizes)), bin_size, limit, [])
    elif algorithm == "mffd":
        bins = _modified_first_fit_decreasing(sizes, bin_size, limit)
    elif algorithm == "next_fit":
        bins = _next_fit(sizes, bin_size, limit)
    else:
        raise PackingError(
            f"algorithm={algorithm!r} is unknown, expected 'ffd', 'mffd' or 'next_fit'"
        )
    return PackingInfo(
        bins=tuple(tuple(b) for b in bins),
        bin_size=bin_size,
        lengths=tuple(real),
        algorithm=algorithm,
        slot_multiple=slot_multiple,
    )


def _first_fit_decreasing(
    sizes: list[int],
    items: Sequence[int] | range,
    capacity: int,
    limit: int,
    bins: list[list[int]],
) -> list[list[int]]:
    free = [capacity - sum(sizes[i] for i in b) for b in bins]
    for item in sorted(items, key=lambda i: (-sizes[i], i)):
        for b, room in enumerate(free):
            if sizes[item] <= room and len(bins[b]) < limit:
                bins[b].append(item)
                free[b] -= sizes[item]
                break
        else:
            bins.append([item])
            free.append(capacity - sizes[item])
    return bins


def _modified_first_fit_decreasing(sizes: list[int], capacity: int, limit: int) -> list[list[int]]:
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    large = [i for i in order if sizes[i] * 2 > capacity]
    medium = [i for i in order if capacity < sizes[i] * 3 and sizes[i] * 2 <= capacity]
    small = [i for i in order if capacity < sizes[i] * 6 and sizes[i] * 3 <= capacity]
    bins = [[i] for i in large]
    free = [capacity - sizes[i] for i in large]
    placed: set[int] = set()
    # From the emptiest large bin backwards: the largest medium item that fits.
    for b in reversed(range(len(bins))):
        for i in medium:
            if i not in placed and sizes[i] <= free[b] and len(bins[b]) < limit:
                bins[b].append(i)
                free[b] -= sizes[i]
                placed.add(i)
                break
    # Then pairs of small items: the smallest one plus the largest one that still fits.
    for b in reversed(range(len(bins))):
        remaining = [i for i in small if i not in placed]
        if len(remaining) < 2 or len(bins[b]) + 2 > limit:
            continue
        smallest, second = remaining[-1], remaining[-2]
        if sizes[smallest] + sizes[second] > free[b]:
            continue
        bins[b].append(smallest)
        free[b] -= sizes[smallest]
        placed.add(smallest)
        partner = next(i for i in remaining if i not in placed and sizes[i] <= free[b])
        bins[b].append(partner)
        free[b] -= sizes[partner]
        placed.add(partner)
    rest = [i for i in order if i not in placed and i not in set(large)]
    return _first_fit_decreasing(sizes, rest, capacity, limit, bins)


def _next_fit(sizes: list[int], capacity: int, limit: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room = 0
    for i, size in enumerate(sizes):
        if not bins or size > room or len(bins[-1]) >= limit:
            bins.append([])
            room = capacity
        bins[-1].append(i)
        room -= size
    return bins


def distribute_bins(info: PackingInfo, dp_size: int) -> list[list[int]]:
    """Assigns bins to data-parallel ranks: equal bin counts, balanced token work.

    Bins are taken in decreasing token count and each goes to the rank with the least work
    that still has room (longest-processing-time first). When the bin count is not a multiple
    of ``dp_size`` the missing places hold ``-1``: an empty bin, all padding, no loss, so every
    rank runs the same number of microbatches and the gradient collectives stay matched.

    Args:
        info: The packing.
        dp_size: Number of data-parallel ranks.

    Returns:
        For every rank, its bin indices (``-1`` for an empty bin), the same count per rank.

    Raises:
        PackingError: If ``dp_size`` is not positive.
    """
    if dp_size < 1:
        raise PackingError(f"dp_size={dp_size} must be >= 1")
    per_rank = max(1, math.ceil(info.num_bins / dp_size))
    tokens = info.bin_tokens
    heap = [(0, rank) for rank in range(dp_size)]
    assignment: list[list[int]] = [[] for _ in range(dp_size)]
    for b in sorted(range(info.num_bins), key=lambda b: (-tokens[b], b)):
        full = []
        while True:
            work, rank = heapq.heappop(heap)
            if len(assignment[rank]) < per_rank:
                break
            full.append((work, rank))
        assignment[rank].append(b)
        heapq.heappush(heap, (work + tokens[b], rank))
        for entry in full:
            heapq.heappush(heap, entry)
    for bins in assignment:
        bins.sort()
        bins.extend([-1] * (per_rank - len(bins)))
    return assignment
