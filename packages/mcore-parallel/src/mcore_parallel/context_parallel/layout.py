"""Which tokens each context-parallel rank holds: load-balanced causal chunking.

Every sequence of length ``L`` is cut into ``2 * cp`` equal chunks; rank ``r`` holds chunks
``r`` and ``2 * cp - 1 - r``, in that order. Under a causal mask the work of a query chunk grows
with its index, so pairing an early chunk with a late one gives every rank the same amount of
attention work (the zig-zag split of Megatron-Core and of the ring-attention literature). Packed
sequences (``cu_seqlens``) are split sequence by sequence: the rank's local tokens are, for each
sequence in order, its chunk ``r`` then its chunk ``2 * cp - 1 - r``, so the local packed
sequence has ``cu_seqlens // cp`` as its boundaries.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from mcore_parallel.errors import ParallelConfigError, ParallelTypeError

__all__ = ["ChunkLayout", "block_plan", "full_mask"]


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, cp_size: int) -> list[int]:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise ParallelTypeError(
            f"cu_seqlens must be a 1-D integer tensor, got {type(cu_seqlens).__name__}"
            + (
                f" of shape {tuple(cu_seqlens.shape)}"
                if isinstance(cu_seqlens, torch.Tensor)
                else ""
            )
        )
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total:
        raise ParallelConfigError(
            f"cu_seqlens={bounds} must start at 0 and end at the sequence length {total}"
        )
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    bad = [n for n in lengths if n < 0 or n % (2 * cp_size)]
    if bad:
        raise ParallelConfigError(
            f"cu_seqlens={bounds} has sequence lengths {bad} that are not multiples of "
            f"2 * cp = {2 * cp_size}; pad each sequence to a multiple of 2 * cp"
        )
    # Empty segments (padding of a fixed number of boundaries) hold no tokens.
    return [n for n in lengths if n > 0]


@dataclass
class ChunkLayout:
    """Token layout of one (packed) sequence split over ``cp_size`` ranks.

    Args:
        total_len: Length of the full (packed) sequence over all ranks.
        cp_size: Number of context-parallel ranks.
        cu_seqlens: Cumulative lengths of the packed sequences in the full sequence
            (``[0, L0, L0 + L1, ...]``), or None for one sequence.
        device: Device of the index tensors.

    Raises:
        ParallelConfigError: If a sequence length is not a multiple of ``2 * cp_size`` (empty
            sequences are allowed and hold no tokens).
        ParallelTypeError: If ``cu_seqlens`` is not a 1-D tensor.
    """

    total_len: int
    cp_size: int
    cu_seqlens: torch.Tensor | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if self.cu_seqlens is None:
            if self.total_len <= 0 or self.total_len % (2 * self.cp_size):
                raise ParallelConfigError(
                    f"sequence length {self.total_len} must be a positive multiple of 2 * cp = "
                    f"{2 * self.cp_size}; pad the sequence"
                )
            self.lengths = [self.total_len]
        else:
            self.lengths = _check_cu_seqlens(self.cu_seqlens, self.total_len, self.cp_size)
        self.packed = self.cu_seqlens is not None and len(self.lengths) > 1
        self.local_len = self.total_len // self.cp_size
        self._cache: dict[int, dict[str, torch.Tensor]] = {}

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """Returns the two chunk indices rank ``rank`` holds, in local order.

        Args:
            rank: Context-parallel rank.

        Returns:
            ``(rank, 2 * cp_size - 1 - rank)``.
        """
        return rank, 2 * self.cp_size - 1 - rank

    def tokens(self, rank: int) -> dict[str, torch.Tensor]:
        """Per local token of ``rank``: global index, sequence, position and chunk half.

        Args:
            rank: Context-parallel rank.

        Returns:
            1-D int64 tensors of ``local_len`` elements by name: ``index`` (global token
            index), ``seq`` (sequence id), ``pos`` (position in its sequence) and ``half`` (0
            for chunk ``rank``, 1 for chunk ``2 * cp - 1 - rank``).
        """
        if rank not in self._cache:
            index, seq, pos, half = [], [], [], []
            start = 0
            for seq_id, length in enumerate(self.lengths):
                chunk = length // (2 * self.cp_size)
                for which, c in enumerate(self.chunks_of(rank)):
                    positions = torch.arange(c * chunk, (c + 1) * chunk)
                    pos.append(positions)
                    index.append(positions + start)
                    seq.append(torch.full((chunk,), seq_id))
                    half.append(torch.full((chunk,), which))
                start += length
            self._cache[rank] = {
                name: torch.cat(values).to(self.device)
                for name, values in (("index", index), ("seq", seq), ("pos", pos), ("half", half))
            }
        return self._cache[rank]

    def half_index(self, rank: int, half: int) -> slice | torch.Tensor:
        """Local positions of one of the rank's two chunks (a slice for one sequence).

        Args:
            rank: Context-parallel rank.
            half: 0 for chunk ``rank``, 1 for chunk ``2 * cp - 1 - rank``.

        Returns:
            A slice, or an int64 index tensor for packed sequences.
        """
        if not self.packed:
            size = self.local_len // 2
            return slice(half * size, (half + 1) * size)
        return torch.nonzero(self.tokens(rank)["half"] == half).flatten()


def block_plan(
    layout: ChunkLayout, q_rank: int, kv_rank: int, causal: bool
) -> list[tuple[slice | torch.Tensor, slice | torch.Tensor, torch.Tensor | None, bool]]:
    """The non-empty sub-blocks of ``q_rank``'s queries against ``kv_rank``'s keys.

    Each rank's tokens form two chunk halves, so a pair of ranks has four sub-blocks. Under a
    causal mask a query chunk never sees a later key chunk (skipped), sees an earlier one whole
    (masked only by sequence boundaries when packed) and itself with a lower-triangular mask.

    Args:
        layout: The token layout.
        q_rank: Rank of the queries.
        kv_rank: Rank of the keys and values.
        causal: Whether the attention is causal.

    Returns:
        ``(query positions, key positions, mask, is_causal)`` per sub-block to compute; the
        positions are local to each rank (slices, or index tensors when packed). ``mask`` is
        ``[len(queries), len(keys)]``, True where attention is allowed, or None when the
        sub-block is either whole or (``is_causal``) exactly lower-triangular, the two shapes
        fused attention kernels take without a mask.
    """
    plan = []
    q_tokens, kv_tokens = layout.tokens(q_rank), layout.tokens(kv_rank)
    for q_half in (0, 1):
        for kv_half in (0, 1):
            q_chunk = layout.chunks_of(q_rank)[q_half]
            kv_chunk = layout.chunks_of(kv_rank)[kv_half]
            if causal and kv_chunk > q_chunk:
                continue
            q_index = layout.half_index(q_rank, q_half)
            kv_index = layout.half_index(kv_rank, kv_half)
            diagonal = causal and kv_chunk == q_chunk
            mask: torch.Tensor | None = None
            if layout.packed:
                q_pos, kv_pos = q_tokens["pos"][q_index], kv_tokens["pos"][kv_index]
                q_seq, kv_seq = q_tokens["seq"][q_index], kv_tokens["seq"][kv_index]
                mask = q_seq.unsqueeze(1) == kv_seq.unsqueeze(0)
                if diagonal:
                    mask &= kv_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
            plan.append((q_index, kv_index, mask, diagonal and mask is None))
    return plan


def full_mask(layout: ChunkLayout, q_rank: int, causal: bool) -> torch.Tensor | None:
    """Mask of ``q_rank``'s queries against every rank's keys, concatenated in rank order.

    Args:
        layout: The token layout.
        q_rank: Rank of the queries.
        causal: Whether the attention is causal.

    Returns:
        Boolean ``[local_len, total_len]``, True where attention is allowed; None when every
        key is allowed (one sequence, not causal).
    """
    if not causal and not layout.packed:
        return None
    q = layout.tokens(q_rank)
    keys = [layout.tokens(rank) for rank in range(layout.cp_size)]
    kv_seq = torch.cat([k["seq"] for k in keys])
    kv_pos = torch.cat([k["pos"] for k in keys])
    mask = q["seq"].unsqueeze(1) == kv_seq.unsqueeze(0)
    if causal:
        mask &= kv_pos.unsqueeze(0) <= q["pos"].unsqueeze(1)
    return mask
