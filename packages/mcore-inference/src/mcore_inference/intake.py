"""Intake of new requests: prompt normalisation and validation (with messages for people)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mcore_inference.config import SamplingParams
from mcore_inference.errors import InvalidRequestError

__all__ = ["normalize_prompt", "params_per_prompt", "validate_request"]


def normalize_prompt(prompt: Any) -> Any:
    """A list of token ids from a list, tuple or 1-D integer tensor (anything else unchanged).

    Args:
        prompt: The prompt as given.

    Returns:
        A list, or the original object (which validation then rejects).
    """
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
        prompt = prompt.tolist()
    return list(prompt) if isinstance(prompt, (list, tuple)) else prompt


def params_per_prompt(
    count: int, params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams | None]:
    """One SamplingParams (or None for the defaults) per prompt.

    Args:
        count: Number of prompts.
        params: One SamplingParams for all, one per prompt, or None.

    Returns:
        ``count`` entries.

    Raises:
        InvalidRequestError: If ``params`` is a list whose length differs from ``count``.
    """
    if params is None or isinstance(params, SamplingParams):
        return [params] * count
    params_list: list[SamplingParams | None] = list(params)
    if len(params_list) != count:
        raise InvalidRequestError(
            f"params has {len(params_list)} entries; expected one per prompt ({count})"
        )
    return params_list


def validate_request(
    prompt: Any,
    params: Any,
    *,
    vocab_size: int,
    max_sequence_length: int,
    has_tokenizer: bool,
    blocks_needed: Callable[[int, int], int],
    cache_blocks: int,
) -> None:
    """Check a new request against the engine's limits.

    Args:
        prompt: The normalised prompt.
        params: Its sampling parameters.
        vocab_size: Vocabulary size of the model.
        max_sequence_length: Most tokens of one request.
        has_tokenizer: Whether string stop words can be matched.
        blocks_needed: ``(prompt length, new tokens) -> KV blocks`` of the scheduler.
        cache_blocks: Blocks of the whole cache.

    Raises:
        InvalidRequestError: Naming the value and what was expected.
    """
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params={params!r}; expected a SamplingParams")
    params.validate()
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError(f"prompt={prompt!r}; expected a non-empty list of token ids")
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)]
    bad += [t for t in prompt if isinstance(t, int) and not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token {bad[0]!r}; expected integer ids in [0, {vocab_size})"
        )
    if len(prompt) > max_sequence_length:
        raise InvalidRequestError(
            f"prompt length {len(prompt)}; expected at most "
            f"max_sequence_length={max_sequence_length}"
        )
    if not has_tokenizer and any(isinstance(w, str) for w in params.stop_words):
        raise InvalidRequestError(
            f"stop_words={params.stop_words!r} holds strings; expected token sequences or "
            "an engine with tokenizer_path"
        )
    new_tokens = min(params.max_tokens, max_sequence_length - len(prompt))
    needed = blocks_needed(len(prompt), new_tokens)
    if needed > cache_blocks:
        raise InvalidRequestError(
            f"prompt length {len(prompt)} + max_tokens {new_tokens} needs {needed} KV blocks; "
            f"expected at most the cache's {cache_blocks}"
        )
