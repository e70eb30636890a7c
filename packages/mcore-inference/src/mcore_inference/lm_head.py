"""The LM head of large decode steps in vocabulary slices, each slice's argmax overlapping the
next slice's GEMM.

At hundreds of rows the LM head is a compute-bound GEMM (one H200, 512 rows of the
Qwen2.5-0.5B shape: 196 us) and the greedy argmax of its logits (155 MB of bf16 at 512 rows)
reads them back from HBM afterwards (62 us). :class:`SlicedLMHead` runs the GEMM as one
``torch.mm`` per vocabulary slice into the columns of one logits matrix, and, when the step
wants its greedy tokens, reduces each slice with
:class:`mcore_kernels.row_argmax_slices.SlicedRowArgmax` on a second stream as soon as the
slice is written: the reduction reads the slice while it is still in L2 and runs beside the
next slice's GEMM. The logits are the same matrix as before (every row's every column), so
sampling and log-probs read them unchanged; the tokens are ``torch.argmax``'s (first index of
the largest value).
"""

from __future__ import annotations

import itertools

import torch

from mcore_kernels.row_argmax_slices import SlicedRowArgmax

__all__ = ["LM_HEAD_SLICES", "SlicedLMHead", "slice_bounds"]

LM_HEAD_SLICES = (0, 256)
"""``(slices, min rows)``: decode steps of at least ``min rows`` rows run the LM head in this
many vocabulary slices (0: one GEMM)."""
SLICE_ALIGN = 256
"""Slice widths are multiples of this many columns (whole GEMM tiles; the last slice takes the
rest)."""
PROGRAMS_PER_SLICE = 8
"""Argmax programs per row and slice (:class:`SlicedRowArgmax`)."""


def slice_bounds(columns: int, slices: int, align: int = 256) -> tuple[int, ...]:
    """Column bounds of ``slices`` near-equal slices of ``columns`` (widths a multiple of
    ``align`` but the last).

    Args:
        columns: Columns to cover (at least 1).
        slices: Slices wanted (at least 1; fewer when ``columns`` is narrow).
        align: Width granularity (at least 1).

    Returns:
        Increasing bounds from 0 to ``columns``.

    Raises:
        ValueError: If an argument is below 1.
    """
    if columns < 1 or slices < 1 or align < 1:
        raise ValueError(f"columns={columns}, slices={slices}, align={align}; expected >= 1")
    width = -(-columns // slices)
    width = -(-width // align) * align
    return (*range(0, columns, width), columns)


class SlicedLMHead:
    """``hidden @ weight.T`` in vocabulary slices, with the greedy argmax per slice on demand.

    Fixed-shape launches into buffers allocated per call (the logits) or kept per row count
    (the argmax's result and workspace): the calls may be captured in CUDA graphs.

    Args:
        slices: Vocabulary slices (at least 1).
        programs_per_slice: Argmax programs per row and slice.
    """

    def __init__(self, slices: int, programs_per_slice: int = PROGRAMS_PER_SLICE) -> None:
        if slices < 1:
            raise ValueError(f"slices={slices}; expected >= 1")
        self.slices = slices
        self.programs_per_slice = programs_per_slice
        self._reducers: dict[tuple[int, int, torch.device], SlicedRowArgmax] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _reducer(self, rows: int, bounds: tuple[int, ...], device: torch.device) -> SlicedRowArgmax:
        key = (rows, bounds[-1], device)
        reducer = self._reducers.get(key)
        if reducer is None:
            reducer = SlicedRowArgmax(
                rows, bounds, device, programs_per_slice=self.programs_per_slice
            )
            self._reducers[key] = reducer
        return reducer

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, *, argmax: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits of ``hidden`` and, when asked, each row's argmax.

        Args:
            hidden: ``[rows, hidden]`` final-normed states (contiguous).
            weight: ``[vocab, hidden]`` output weight (contiguous).
            argmax: Also return the greedy tokens (reduced slice by slice; on a CUDA device
                on a second stream, joined before returning).

        Returns:
            ``[rows, vocab]`` logits in ``hidden``'s dtype, and int64 ``[rows]`` tokens (a
            buffer this head reuses for every call of the same row count) or None.
        """
        rows, vocab = hidden.shape[0], weight.shape[0]
        bounds = slice_bounds(vocab, self.slices, SLICE_ALIGN)
        hidden = hidden.contiguous()
        logits = hidden.new_empty((rows, vocab))
        spans = list(itertools.pairwise(bounds))
        if not argmax or rows == 0:
            for start, end in spans:
                torch.mm(hidden, weight[start:end].t(), out=logits[:, start:end])
            return logits, None
        reducer = self._reducer(rows, bounds, hidden.device)
        if hidden.device.type != "cuda":
            for index, (start, end) in enumerate(spans):
                torch.mm(hidden, weight[start:end].t(), out=logits[:, start:end])
                reducer.reduce(logits, index)
            return logits, reducer.out
        main = torch.cuda.current_stream(hidden.device)
        side = self._side_stream(hidden.device)
        side.wait_stream(main)
        for index, (start, end) in enumerate(spans):
            torch.mm(hidden, weight[start:end].t(), out=logits[:, start:end])
            written = torch.cuda.Event()
            written.record(main)
            side.wait_event(written)
            with torch.cuda.stream(side):
                reducer.reduce(logits, index)
        # The logits and the result are used (and freed) on the main stream after this.
        main.wait_stream(side)
        return logits, reducer.out
