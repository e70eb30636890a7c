"""Sampling a step's tokens on the device: the per-step plan, reused buffers, log-probs.

A :class:`SamplingPlan` holds, on the device, everything the sampler needs besides the logits
(the rows that draw, their temperatures, top-k/top-p, the uniform numbers of every step of a
multi-step run, the log-prob rows grouped by temperature), built once per microbatch: each
step then only launches kernels, with no host values to upload. One step of the engine
(:func:`sample_microbatch`) and every step of a multi-step decode run
(:mod:`mcore_inference.multi_step`) sample through the same plan, so both give the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_inference.batch import Microbatch
from mcore_inference.request import Request
from mcore_inference.sampling import sampling_uniforms, truncate_logits
from mcore_inference.transfer import to_device
from mcore_kernels import token_logprobs
from mcore_kernels.row_argmax import greedy_feed, row_argmax

__all__ = ["BINARY_SEARCH", "GREEDY_FEED", "SampleBuffers", "SamplingPlan", "sample_microbatch"]

BINARY_SEARCH = True
"""Find a drawing row's token by a binary search in its cumulative distribution; False counts
the entries below the target over the whole row (the same index, one more pass over the
vocabulary; kept for comparison)."""
GREEDY_FEED = True
"""A multi-step run whose rows are all greedy without log-probs samples each step and feeds the
next one in one launch (:func:`mcore_kernels.row_argmax.greedy_feed`: the argmax, the float64
sample, the next token and position) instead of four (argmax, sample copy, token copy, position
add). The same tokens either way. One H200, batch 1 of the Qwen2.5-0.5B shape with the packed
gate/up: 2161 against 2147 tok/s (4-row programs), 2136 / 2170 against 2129 (8-row)."""


class SamplingPlan:
    """Device-side sampling state of one microbatch's sampling rows for ``steps`` steps.

    Step ``j`` draws each request's token of index ``num_computed - len(prompt) + j`` (the
    request's ``num_computed`` as set for the microbatch's first step).

    Args:
        requests: The sampling requests, in row order.
        device: The logits' device.
        steps: Consecutive steps sampled with the plan.
    """

    def __init__(self, requests: Sequence[Request], device: torch.device, steps: int = 1) -> None:
        params = [r.params for r in requests]
        self.width = len(requests)
        self.steps = steps
        rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
        self._draw_rows: torch.Tensor | None = None
        self._temperatures: torch.Tensor | None = None
        self._top_k: torch.Tensor | None = None
        self._top_p: torch.Tensor | None = None
        self._uniforms: torch.Tensor | None = None
        self._every_row_draws = len(rows) == len(params)
        if rows:
            chosen = [params[i] for i in rows]
            self._draw_rows = to_device(rows, torch.long, device)
            self._temperatures = to_device([p.temperature for p in chosen], torch.float32, device)
            if any(p.top_k > 0 or p.top_p < 1.0 for p in chosen):
                self._top_k = to_device([p.top_k for p in chosen], torch.long, device)
                self._top_p = to_device([p.top_p for p in chosen], torch.float32, device)
            drawing = [requests[i] for i in rows]
            # float64 numbers rounded to float32 on the host, as single values would be.
            uniforms = sampling_uniforms(
                [r.seed for r in drawing],
                [r.num_computed - len(r.prompt) for r in drawing],
                steps,
            ).to(torch.float32)
            self._uniforms = to_device(uniforms, torch.float32, device)
        logprob_rows = [i for i, p in enumerate(params) if p.return_logprobs]
        self.logprobs = bool(logprob_rows)
        """Whether any row asks for log-probs."""
        self.every_logprob = len(logprob_rows) == len(params)
        """Whether every row asks for log-probs (no NaN row to fill)."""
        self._logprob_rows: torch.Tensor | None = None
        if logprob_rows and not self.every_logprob:
            self._logprob_rows = to_device(logprob_rows, torch.long, device)
        # log-probs of the sampling distribution at the request's temperature (greedy: 1).
        temperatures = [params[i].temperature or 1.0 for i in logprob_rows]
        distinct = sorted(set(temperatures))
        self._temperature_groups: list[tuple[float, torch.Tensor | None]] = (
            [(distinct[0], None)]
            if len(distinct) == 1
            else [
                (
                    temperature,
                    to_device(
                        [i for i, t in enumerate(temperatures) if t == temperature],
                        torch.long,
                        device,
                    ),
                )
                for temperature in distinct
            ]
        )

    def tokens(self, logits: torch.Tensor, step: int = 0) -> torch.Tensor:
        """Pick one token per row (greedy rows: the argmax; others: the inverted CDF).

        Args:
            logits: ``[N, V]`` logits of the sampling rows (any float dtype).
            step: Index of the step in the plan.

        Returns:
            int64 ``[N]`` token ids on the logits' device.
        """
        # One launch at any row count, the same indices as torch.argmax (one H200, 152k-token
        # vocabulary: 9.9 against 21 us at 64 rows, 63 against 95 us at 512).
        tokens = row_argmax(logits)
        index = self._draw_rows
        if index is None:
            return tokens
        assert self._temperatures is not None and self._uniforms is not None
        # Every row draws (a sampling batch): no gather copy of the logits.
        drawn = logits if self._every_row_draws else logits.index_select(0, index)
        # float32 temperatures promote bf16 logits: the upcast and the division in one pass.
        scaled = drawn / self._temperatures[:, None]
        if self._top_k is not None and self._top_p is not None:
            scaled = truncate_logits(scaled, self._top_k, self._top_p)
        cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
        targets = self._uniforms[step] * cdf[:, -1]
        # The first token whose cumulative probability reaches the target: it has probability
        # > 0 because targets > 0. A cumulative sum of non-negative numbers never decreases, so
        # a binary search finds the count of entries below the target (what a comparison over
        # the whole row counts) without another pass over the vocabulary.
        if BINARY_SEARCH:
            picked = torch.searchsorted(cdf, targets[:, None]).squeeze(1)
        else:
            picked = (cdf < targets[:, None]).sum(dim=-1)
        tokens[index] = picked.clamp_(max=logits.shape[-1] - 1)
        return tokens

    def row_logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, logits_dtype: torch.dtype | None
    ) -> torch.Tensor:
        """float32 log-probs of the log-prob rows (in their order), as a training forward's.

        The trainer calls ``token_logprobs(logits, targets, temperature=t)`` on the logits in
        the model's dtype; so does this, one call per distinct temperature, on the float32
        logits cast back to ``logits_dtype`` (exact: they were upcast from it). Feeding the
        same values in float32 instead would not do: the kernel's vector loads, and with them
        the order in which a row's exponentials are summed, follow the element size (8 bf16 or
        4 float32 per thread), a one-ulp difference in the log-prob for a large vocabulary.

        Args:
            logits: ``[N, V]`` logits of every sampling row.
            tokens: int64 ``[N]`` sampled tokens.
            logits_dtype: The dtype the model computed the logits in, or None.

        Returns:
            float32 ``[number of log-prob rows]``.
        """
        index = self._logprob_rows
        if index is not None:
            logits = logits.index_select(0, index)
            tokens = tokens.index_select(0, index)
        if logits_dtype is not None and logits_dtype != logits.dtype:
            logits = logits.to(logits_dtype)
        groups = self._temperature_groups
        if len(groups) == 1:
            values = token_logprobs(logits, tokens, temperature=groups[0][0])
            assert isinstance(values, torch.Tensor)
            return values
        values = torch.empty(tokens.shape[0], dtype=torch.float32, device=logits.device)
        for temperature, rows in groups:
            assert rows is not None
            part = token_logprobs(
                logits.index_select(0, rows), tokens.index_select(0, rows), temperature=temperature
            )
            assert isinstance(part, torch.Tensor)
            values.index_copy_(0, rows, part)
        return values

    def sample(
        self,
        logits: torch.Tensor,
        out: torch.Tensor,
        step: int = 0,
        *,
        logits_dtype: torch.dtype | None = None,
        feed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Sample step ``step`` into ``out`` (tokens, then log-probs of the rows that ask).

        Args:
            logits: ``[N, V]`` logits of the sampling rows.
            out: float64 ``[2, N]``; its second row must already hold NaN where no log-prob
                is asked (it is left alone there).
            step: Index of the step in the plan.
            logits_dtype: The dtype the model computed the logits in (see
                :meth:`row_logprobs`).
            feed: int64 ``[N]`` token and position rows of the next step's inputs (a
                multi-step run): the tokens are written there and the positions advanced by
                one (:data:`GREEDY_FEED`: in the argmax's launch where every row is greedy
                without log-probs).

        Returns:
            int64 ``[N]``: the sampled tokens.
        """
        if feed is not None and GREEDY_FEED and self._draw_rows is None and not self.logprobs:
            return greedy_feed(logits, out[0], feed[0], feed[1])
        new_tokens = self.tokens(logits, step)
        out[0].copy_(new_tokens)
        if self.logprobs:
            values = self.row_logprobs(logits, new_tokens, logits_dtype)
            if self._logprob_rows is None:
                out[1].copy_(values)
            else:
                out[1].index_copy_(0, self._logprob_rows, values.to(torch.float64))
        if feed is not None:
            feed[0].copy_(new_tokens)
            feed[1].add_(1)
        return new_tokens


class SampleBuffers:
    """Reused device buffers for the float64 ``[2, n]`` samples of consecutive steps.

    A step's samples are read by the copy to the host (in the same step) and by the next step,
    which feeds them to the model; every use is ordered on the one stream, so a buffer is free
    again two steps later. Reusing them saves an allocation and a fill per step: the
    log-probability row is refilled with NaN only when the buffer's last use had another width
    or wrote log-probs into it. Each view is contiguous (collectives broadcast it as is).

    Args:
        device: The engine's device.
        count: Buffers in turn (at least 3).
    """

    def __init__(self, device: torch.device, count: int = 3) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._clean_width: list[int] = []
        """Per buffer, the width whose second row holds NaN (-1: none known)."""
        self._count = max(3, count)
        self._next = 0

    def take(self, columns: int) -> tuple[torch.Tensor, bool]:
        """The next buffer, as a contiguous ``[2, columns]`` view.

        Args:
            columns: Sampled rows of the step.

        Returns:
            ``(samples, clean)``: the view, and whether its second row already holds NaN.
        """
        index = self._next
        self._next = (index + 1) % self._count
        capacity = self._buffers[0].numel() // 2 if self._buffers else 0
        if capacity < columns:
            # All buffers at once, of one size: the engine's memory does not change again
            # until a wider step comes.
            size = 2 * max(columns, 64)
            self._buffers = [
                torch.empty(size, dtype=torch.float64, device=self.device)
                for _ in range(self._count)
            ]
            self._clean_width = [-1] * self._count
        view = self._buffers[index][: 2 * columns].view(2, columns)
        return view, self._clean_width[index] == columns

    def mark(self, samples: torch.Tensor, clean: bool) -> None:
        """Record whether the second row of ``samples`` (a view from :meth:`take`) is NaN.

        Args:
            samples: A view returned by :meth:`take`.
            clean: Whether its second row holds NaN in every column.
        """
        for index, buffer in enumerate(self._buffers):
            if buffer.data_ptr() == samples.data_ptr():
                self._clean_width[index] = samples.shape[1] if clean else -1


def sample_microbatch(
    logits: torch.Tensor,
    microbatch: Microbatch,
    *,
    logits_dtype: torch.dtype | None = None,
    buffers: SampleBuffers | None = None,
) -> torch.Tensor:
    """Sample the next token of every sampling request of a microbatch.

    Args:
        logits: ``[n, vocab]`` logits of the sampling rows (float32, or already in
            ``logits_dtype``).
        microbatch: The microbatch (its ``sampling`` requests, in row order).
        logits_dtype: The dtype the model computed the logits in before the float32 upcast
            (its parameter dtype); the log-probs are computed from the logits in that dtype, as
            a training forward's ``token_logprobs`` reads them (see
            :meth:`SamplingPlan.row_logprobs`).
        buffers: Reused buffers for the result (None: a new tensor).

    Returns:
        float64 ``[2, n]``: token ids and their log-probabilities (NaN where not asked), in a
        form one broadcast carries to the other ranks.
    """
    requests = microbatch.sampling
    # The index of the token being sampled is the number of tokens fed after the prompt: also
    # right for a request whose previous token is still deferred (not in ``output`` yet).
    plan = SamplingPlan(requests, logits.device)
    if buffers is None:
        samples = torch.full(
            (2, len(requests)), float("nan"), dtype=torch.float64, device=logits.device
        )
    else:
        samples, clean = buffers.take(len(requests))
        if not clean and not plan.every_logprob:
            samples[1].fill_(float("nan"))
        buffers.mark(samples, not plan.logprobs)
    plan.sample(logits, samples, logits_dtype=logits_dtype)
    return samples


def _row_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperatures: list[float],
    logits_dtype: torch.dtype | None,
) -> torch.Tensor:
    """float32 ``log_softmax(logits / t)[token]`` of every row, bitwise as a training forward.

    The trainer calls ``token_logprobs(logits, targets, temperature=t)`` on the logits in the
    model's dtype; so does this, one call per distinct temperature, on the float32 logits cast
    back to ``logits_dtype`` (exact: they were upcast from it). Feeding the same values in
    float32 instead would not do: the kernel's vector loads, and with them the order in which
    a row's exponentials are summed, follow the element size (8 bf16 or 4 float32 per thread),
    a one-ulp difference in the log-prob for a large vocabulary.
    """
    if logits_dtype is not None and logits_dtype != logits.dtype:
        logits = logits.to(logits_dtype)
    distinct = sorted(set(temperatures))
    if len(distinct) == 1:
        values = token_logprobs(logits, tokens, temperature=distinct[0])
        assert isinstance(values, torch.Tensor)
        return values
    values = torch.empty(tokens.shape[0], dtype=torch.float32, device=logits.device)
    for temperature in distinct:
        rows = [i for i, t in enumerate(temperatures) if t == temperature]
        index = to_device(rows, torch.long, logits.device)
        part = token_logprobs(
            logits.index_select(0, index), tokens.index_select(0, index), temperature=temperature
        )
        assert isinstance(part, torch.Tensor)
        values.index_copy_(0, index, part)
    return values
