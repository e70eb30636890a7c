"""Token ids to streamed text: incremental detokenization and stop strings.

Decoding each new token alone is wrong in two ways: a character may span several byte-level
tokens (the first decodes to U+FFFD), and SentencePiece-style tokenizers drop the leading space
of a word at the start of a sequence. :class:`IncrementalDetokenizer` decodes a short window of
recent tokens instead and emits the text that the newest tokens add to it, holding back while the
window ends in an incomplete character. :class:`TextStream` adds OpenAI's stop strings on top:
the text stops just before the first stop string, which is never emitted, and a tail of text
that could still grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalDetokenizer", "TextStream"]

Decode = Callable[[Sequence[int]], str]
"""Token ids to text, special tokens skipped."""

_CONTEXT_TOKENS = 5
"""Prompt tokens decoded before the first generated one, so its leading space survives."""

_REPLACEMENT = "\ufffd"


def _shared_prefix_length(first: str, second: str) -> int:
    for i, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return i
    return min(len(first), len(second))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Args:
        decode: Token ids to text.
        context: The last prompt tokens (only the last few are used as decoding context).
    """

    def __init__(self, decode: Decode, context: Sequence[int] = ()) -> None:
        self._decode = decode
        self._tokens = list(context[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._tokens)

    def push(self, token: int) -> str:
        """Add one token.

        Args:
            token: The next generated token id.

        Returns:
            The text it completes (empty while a character is still incomplete).
        """
        self._tokens.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (at the end of the sequence).

        Returns:
            The remaining text, replacement characters included.
        """
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        tokens = self._tokens
        if self._read == len(tokens):
            return ""
        before = self._decode(tokens[self._prefix : self._read])
        text = self._decode(tokens[self._prefix :])
        if not final and text.endswith(_REPLACEMENT):
            return ""
        # NOTE: the window's text usually extends its prefix's; when it does not (the prefix
        # ended in half a character, now completed), the text past their common part is new.
        if text.startswith(before):
            delta = text[len(before) :]
        else:
            delta = text[_shared_prefix_length(before, text) :]
        self._prefix, self._read = self._read, len(tokens)
        # Keep the decoded window short: drop tokens that are no longer context.
        if self._prefix > 64:
            del tokens[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta


class TextStream:
    """Detokenizes a choice's tokens and applies its stop strings.

    Args:
        decode: Token ids to text.
        context: The last prompt tokens (decoding context).
        stop: Stop strings; the text ends before the first one found.
    """

    def __init__(self, decode: Decode, context: Sequence[int], stop: Sequence[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(decode, context)
        self._stop = tuple(stop)
        self._pending = ""
        self.length = 0
        """Characters emitted or pending so far (the text offset of the next token)."""
        self.stopped = False
        """True once a stop string was found; nothing is emitted afterwards."""

    def push(self, token: int) -> str:
        """Add one generated token.

        Args:
            token: The token id.

        Returns:
            Text that may be sent now (possibly empty).
        """
        if self.stopped:
            return ""
        delta = self._detokenizer.push(token)
        self.length += len(delta)
        return self._release(delta, final=False)

    def finish(self) -> str:
        """End the choice: flush the detokenizer and release the held-back text.

        Returns:
            The rest of the text (up to a stop string found in it).
        """
        if self.stopped:
            return ""
        delta = self._detokenizer.flush()
        self.length += len(delta)
        return self._release(delta, final=True)

    def _release(self, delta: str, *, final: bool) -> str:
        if not self._stop:
            return delta
        pending = self._pending + delta
        # Held-back text never contains the start of a stop string that began earlier, so a
        # stop string can only begin inside ``pending``.
        found = [i for i in (pending.find(s) for s in self._stop) if i >= 0]
        if found:
            self.stopped = True
            self._pending = ""
            return pending[: min(found)]
        hold = 0 if final else self._partial_stop_length(pending)
        self._pending = pending[len(pending) - hold :] if hold else ""
        return pending[: len(pending) - hold]

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
