"""A character tokenizer for the procedural tasks: one token per character, three specials.

Tiny models trained from scratch learn fastest with a tiny vocabulary, so the default alphabet
holds only digits, the arithmetic symbols and the few letters the task prompts use.
"""

from __future__ import annotations

from collections.abc import Sequence

from mcore_rl.errors import TokenizerError

__all__ = ["DEFAULT_ALPHABET", "CharTokenizer"]

DEFAULT_ALPHABET = "0123456789+-*=(),:> SRC"
"""Characters known to the default tokenizer: digits, operators and the task prefixes."""


class CharTokenizer:
    """Maps every character of an alphabet to one id; ids 0, 1, 2 are pad, bos and eos.

    Args:
        alphabet: The characters to encode, each once.

    Raises:
        TokenizerError: If ``alphabet`` is empty or repeats a character.
    """

    pad_id = 0
    """Id of the padding token."""
    bos_id = 1
    """Id of the beginning-of-sequence token prepended to every prompt."""
    eos_id = 2
    """Id of the end-of-sequence token that ends a completion."""

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise TokenizerError(
                f"alphabet={alphabet!r} must be a non-empty string of distinct characters"
            )
        self.alphabet = alphabet
        self._ids = {ch: i + 3 for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        """Number of ids: the three specials plus one per character.

        Returns:
            The vocabulary size.
        """
        return len(self.alphabet) + 3

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Encodes text, one id per character.

        Args:
            text: The text; every character must be in the alphabet.
            add_bos: Whether to prepend the bos id.

        Returns:
            The token ids.

        Raises:
            TokenizerError: If ``text`` holds a character outside the alphabet.
        """
        ids = [self.bos_id] if add_bos else []
        for ch in text:
            if ch not in self._ids:
                raise TokenizerError(
                    f"text={text!r} holds {ch!r}, expected only characters of {self.alphabet!r}"
                )
            ids.append(self._ids[ch])
        return ids

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a completion.

        Returns:
            ``(eos_id,)``.
        """
        return (self.eos_id,)

    def encode_prompt(self, prompt: str) -> list[int]:
        """Encodes a prompt for generation: bos, then one id per character.

        Args:
            prompt: The prompt text.

        Returns:
            The token ids.

        Raises:
            TokenizerError: If ``prompt`` holds a character outside the alphabet.
        """
        return self.encode(prompt)

    def decode(self, ids: Sequence[int]) -> str:
        """Decodes ids up to the first eos; bos and pad are skipped.

        Args:
            ids: Token ids.

        Returns:
            The text.

        Raises:
            TokenizerError: If an id is outside ``[0, vocab_size)``.
        """
        chars = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.bos_id, self.pad_id):
                continue
            if not 3 <= i < self.vocab_size:
                raise TokenizerError(f"id={i} is outside [0, {self.vocab_size})")
            chars.append(self.alphabet[i - 3])
        return "".join(chars)
