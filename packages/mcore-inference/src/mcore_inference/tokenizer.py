"""Lazy loading of a Hugging Face ``tokenizer.json`` through the optional ``tokenizers`` package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mcore_inference.errors import TokenizerUnavailableError

__all__ = ["load_tokenizer"]


def load_tokenizer(path: str | Path) -> Any:
    """Load a fast tokenizer from a ``tokenizer.json`` file or a directory that holds one.

    Args:
        path: File or checkpoint directory.

    Returns:
        A ``tokenizers.Tokenizer``.

    Raises:
        TokenizerUnavailableError: If ``tokenizers`` is not installed (extra ``hf``) or no file is found.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise TokenizerUnavailableError(
            "tokenizer_path is set but the tokenizers package is missing; install "
            "mcore-inference[hf]"
        ) from exc
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise TokenizerUnavailableError(
            f"tokenizer_path={str(path)!r}; expected a tokenizer.json file"
        )
    return Tokenizer.from_file(str(file))
