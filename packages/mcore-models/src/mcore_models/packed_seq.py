"""Description of several sequences packed into one row of tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_models.errors import PackedSeqError

__all__ = ["PackedSeqParams"]


@dataclass(slots=True)
class PackedSeqParams:
    """Boundaries of the sequences packed into one row ``input_ids[0]``.

    Sequence ``i`` occupies tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``. Attention never crosses
    a boundary, and when no ``position_ids`` are given positions restart at 0 in each sequence.

    **Shared prefixes.** With ``prefix_of``, a sequence may also attend to every token of one
    earlier sequence of the row, its prefix: several completions of one prompt then hold the
    prompt once (``[prompt, completion 1, completion 2, ...]``, each completion with
    ``prefix_of`` pointing at the prompt) and each sees exactly what it would see after its
    own copy of the prompt. The positions of such a sequence continue those of its prefix;
    pass them as ``position_ids``.
    """

    cu_seqlens: torch.Tensor
    """int32 (or int64) ``[n + 1]`` cumulative sequence lengths, starting at 0."""
    max_seqlen: int
    """Length of the longest packed sequence."""
    prefix_of: torch.Tensor | None = None
    """Optional int ``[n]`` on the host: for every sequence, the index of the earlier sequence
    of the row whose tokens it also attends to in full (its shared prefix), or -1 for none."""

    def __post_init__(self) -> None:
        cu = self.cu_seqlens
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
            raise PackedSeqError(
                f"cu_seqlens={cu!r} must be a 1-D integer tensor with at least 2 entries"
            )
        if cu.dtype not in (torch.int32, torch.int64):
            raise PackedSeqError(f"cu_seqlens.dtype={cu.dtype} must be torch.int32 or torch.int64")
        lengths = (cu[1:] - cu[:-1]).tolist()
        if int(cu[0]) != 0 or min(lengths) < 0:
            raise PackedSeqError(f"cu_seqlens={cu.tolist()} must start at 0 and never decrease")
        if int(self.max_seqlen) < max(lengths):
            raise PackedSeqError(
                f"max_seqlen={self.max_seqlen} is smaller than the longest sequence "
                f"({max(lengths)})"
            )
        prefix = self.prefix_of
        if prefix is not None:
            if (
                not isinstance(prefix, torch.Tensor)
                or prefix.dim() != 1
                or prefix.device.type != "cpu"
            ):
                raise PackedSeqError(
                    f"prefix_of={prefix!r} must be a 1-D integer tensor on the host "
                    f"with {len(lengths)} entries (one per sequence)"
                )
            parents = prefix.tolist()
            if len(parents) != len(lengths) or any(
                not isinstance(p, int) or not -1 <= p < i for i, p in enumerate(parents)
            ):
                raise PackedSeqError(
                    f"prefix_of={parents} must hold, for each of the {len(lengths)} sequences, "
                    "-1 or the index of an earlier sequence"
                )

    @property
    def total_tokens(self) -> int:
        """Number of tokens covered by the packed sequences (``cu_seqlens[-1]``)."""
        return int(self.cu_seqlens[-1])

    def segment_ids(self, device: torch.device | None = None) -> torch.Tensor:
        """Give every token the index of its sequence.

        Args:
            device: Device of the result (default: that of ``cu_seqlens``).

        Returns:
            int64 tensor ``[total_tokens]``.
        """
        # Computed where the boundaries live (no device synchronisation for host boundaries:
        # the output size of repeat_interleave is read on the host), then moved.
        cu = self.cu_seqlens.to(dtype=torch.int64)
        lengths = cu[1:] - cu[:-1]
        ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
        return ids if device is None else ids.to(device, non_blocking=True)

    def position_ids(self, device: torch.device | None = None) -> torch.Tensor:
        """Positions that restart at 0 at the start of every sequence.

        Args:
            device: Device of the result (default: that of ``cu_seqlens``).

        Returns:
            int64 tensor ``[1, total_tokens]``.
        """
        cu = self.cu_seqlens.to(device=device, dtype=torch.int64)
        segments = self.segment_ids(device)
        return (torch.arange(segments.numel(), device=cu.device) - cu[segments])[None]
