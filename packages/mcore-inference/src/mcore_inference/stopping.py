"""Stop conditions of a request: stop token ids, multi-token stop words and stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mcore_inference.config import SamplingParams
from mcore_inference.request import FinishReason

__all__ = ["StopCriteria"]


class StopCriteria:
    """Checks, after each new token, whether a request must stop.

    Args:
        params: The request's sampling parameters.
        decode: Tokenizer decode function (token ids to text), needed for string stop words.
    """

    def __init__(
        self, params: SamplingParams, decode: Callable[[Sequence[int]], str] | None = None
    ) -> None:
        self._stop_ids = frozenset(params.stop_token_ids)
        self._sequences = [w for w in params.stop_words if not isinstance(w, str)]
        self._strings = [w for w in params.stop_words if isinstance(w, str)]
        self._decode = decode
        # NOTE: one character can take several byte-level tokens (up to 4 in UTF-8), so the
        # decoded tail must span 4 tokens per character of the longest stop string.
        self._tail_tokens = 4 * max((len(s) for s in self._strings), default=0) + 4
        self.active = bool(self._stop_ids or self._sequences or self._strings)
        """False when the request has no stop token, stop word or stop string."""

    def check(self, output: Sequence[int]) -> FinishReason | None:
        """Decide whether the generated tokens end the request.

        Only generated tokens are matched: a stop word never straddles the prompt.

        Args:
            output: The generated tokens so far, the newest last.

        Returns:
            STOP_TOKEN or STOP_WORD when the newest token completes one, else None.
        """
        if not output:
            return None
        if output[-1] in self._stop_ids:
            return FinishReason.STOP_TOKEN
        for sequence in self._sequences:
            n = len(sequence)
            if len(output) >= n and tuple(output[-n:]) == sequence:
                return FinishReason.STOP_WORD
        if self._strings and self._decode is not None:
            text = self._decode(output[-self._tail_tokens :])
            if any(s in text for s in self._strings):
                return FinishReason.STOP_WORD
        return None
