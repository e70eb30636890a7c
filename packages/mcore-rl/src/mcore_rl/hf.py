"""Policies from Hugging Face checkpoints: the tokenizer adapter and the checkpoint export."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from mcore_inference import HFTokenizer

__all__ = ["TOKENIZER_FILES", "ChatTokenizer", "PromptTokenizer", "copy_tokenizer_files"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
"""Files of a checkpoint directory that belong to its tokenizer and generation defaults."""


class PromptTokenizer(Protocol):
    """What rollouts need from a tokenizer (the character tokenizer and :class:`ChatTokenizer`)."""

    pad_id: int
    """Padding id."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a completion."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of ids."""
        ...

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a generation prompt.

        Args:
            prompt: The prompt text.

        Returns:
            Its token ids, as the policy is prompted.
        """
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of a completion, up to its first eos.

        Args:
            ids: The completion's token ids.

        Returns:
            Its text.
        """
        ...


class ChatTokenizer:
    """A checkpoint's tokenizer as rollouts use it: prompts through the chat template.

    Args:
        tokenizer: The checkpoint's tokenizer.
        system_prompt: System message put before every prompt.
        chat_template: Render prompts with the chat template when the checkpoint has one
            (else the system prompt and the prompt are joined by a blank line).
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        system_prompt: str | None = None,
        chat_template: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.use_chat_template = chat_template and tokenizer.chat_template is not None
        self.pad_id = tokenizer.pad_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a completion (the checkpoint's eos ids).

        Returns:
            The ids.
        """
        return self.tokenizer.eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids of the tokenizer.

        Returns:
            The size.
        """
        return self.tokenizer.vocab_size

    def render(self, prompt: str) -> str:
        """The text of a generation prompt.

        Args:
            prompt: The dataset prompt.

        Returns:
            The rendered prompt.
        """
        if self.use_chat_template:
            return self.tokenizer.render_prompt(prompt, system_prompt=self.system_prompt)
        return prompt if self.system_prompt is None else f"{self.system_prompt}\n\n{prompt}"

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a generation prompt (a rendered template holds its special tokens).

        Args:
            prompt: The dataset prompt.

        Returns:
            The ids.
        """
        return self.tokenizer.encode(
            self.render(prompt), add_special_tokens=not self.use_chat_template
        )

    def decode(self, ids: Sequence[int]) -> str:
        """Text of a completion up to its first eos, special tokens left out.

        Args:
            ids: Completion ids.

        Returns:
            The text.
        """
        stops = set(self.eos_token_ids)
        end = next((i for i, t in enumerate(ids) if int(t) in stops), len(ids))
        return self.tokenizer.decode(list(ids[:end]))


def copy_tokenizer_files(source: str | Path, destination: str | Path) -> list[str]:
    """Copies a checkpoint's tokenizer and generation files into an exported checkpoint.

    Args:
        source: The original checkpoint directory.
        destination: The exported checkpoint directory.

    Returns:
        The names copied.
    """
    copied = []
    for name in TOKENIZER_FILES:
        file = Path(source) / name
        if file.is_file():
            shutil.copyfile(file, Path(destination) / name)
            copied.append(name)
    return copied
