"""Named GRPO presets: Python functions returning a :class:`GRPOConfig`."""

from __future__ import annotations

from collections.abc import Callable

from mcore_rl.config import GRPOConfig
from mcore_rl.errors import RLConfigError

__all__ = ["PRESETS", "preset"]


def tiny_arith() -> GRPOConfig:
    """The main job: a tiny GPT from scratch learns addition of single digits on the CPU.

    Returns:
        The config (the defaults of :class:`GRPOConfig`).
    """
    return GRPOConfig()


def countdown_0_5b() -> GRPOConfig:
    """A Qwen2.5-0.5B-shaped policy on countdown, for one GPU (bf16, CUDA graphs).

    The shapes are those of Qwen2.5-0.5B with the task vocabulary; the weights start from
    scratch (nothing is downloaded), so this preset exercises throughput and memory at scale.

    Returns:
        The config.
    """
    return GRPOConfig(
        model="qwen2.5-0.5b",
        device="cuda",
        dtype="bfloat16",
        task="countdown",
        num_prompts=64,
        group_size=8,
        max_new_tokens=16,
        lr=1e-4,
        target_reward=None,
        num_steps=50,
        checkpoint_every=25,
        max_tokens_per_microbatch=8192,
    )


PRESETS: dict[str, Callable[[], GRPOConfig]] = {
    "tiny-arith": tiny_arith,
    "countdown-0.5b": countdown_0_5b,
}
"""Preset name -> function building its config."""


def preset(name: str) -> GRPOConfig:
    """Builds a named preset.

    Args:
        name: One of :data:`PRESETS`.

    Returns:
        The config.

    Raises:
        RLConfigError: If the name is unknown.
    """
    if name not in PRESETS:
        raise RLConfigError(f"preset={name!r} is unknown, expected one of {sorted(PRESETS)}")
    return PRESETS[name]()
