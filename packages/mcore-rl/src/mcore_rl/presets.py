"""Named GRPO presets: Python functions returning a :class:`GRPOConfig`."""

from __future__ import annotations

from collections.abc import Callable

from mcore_parallel import OptimizerConfig
from mcore_rl.config import (
    GRPOConfig,
    ModelConfig,
    MoEModelConfig,
    PackingConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
)
from mcore_rl.errors import RLConfigError

__all__ = ["PRESETS", "preset"]


def tiny_arith() -> GRPOConfig:
    """The main job: a tiny GPT from scratch learns addition of single digits on the CPU.

    Returns:
        The config (the defaults of :class:`GRPOConfig`).
    """
    return GRPOConfig()


def tiny_moe_arith() -> GRPOConfig:
    """The main job with a mixture-of-experts policy: 4 experts, top-2, dropless, on the CPU.

    Every MLP of the tiny GPT becomes 4 routed SwiGLU experts (top-2 routing, a softmax router
    with a load-balancing loss of coefficient 0.01 added to the GRPO loss). Under torchrun add
    ``--train-parallel.ep 2`` (and ``--infer-parallel.ep 2``) to split the experts.

    Returns:
        The config.
    """
    return GRPOConfig(
        model=ModelConfig(moe=MoEModelConfig(num_experts=4, top_k=2, aux_loss_coeff=0.01))
    )


def _gpu_optimizer(lr: float) -> OptimizerConfig:
    return OptimizerConfig(lr=lr, betas=(0.9, 0.99), weight_decay=0.0, clip_grad=1.0)


def countdown_0_5b() -> GRPOConfig:
    """A Qwen2.5-0.5B-shaped policy on countdown, for one GPU (bf16, CUDA graphs).

    The shapes are those of Qwen2.5-0.5B with the task vocabulary; the weights start from
    scratch (nothing is downloaded), so this preset exercises throughput and memory at scale.
    To post-train the real model, add ``--model.hf-path DIR`` with a prompt dataset (see the
    RL guide).

    Returns:
        The config.
    """
    return GRPOConfig(
        run=RunConfig(device="cuda", target_reward=None, num_steps=50, checkpoint_every=25),
        model=ModelConfig(name="qwen2.5-0.5b", dtype="bfloat16"),
        task=TaskConfig(name="countdown"),
        rollout=RolloutConfig(num_prompts=64, group_size=8, max_new_tokens=16),
        optimizer=_gpu_optimizer(1e-4),
        packing=PackingConfig(max_tokens_per_microbatch=8192),
    )


def gpt_583m() -> GRPOConfig:
    """The seed report's RL policy shape: a ~583M GPT (24 layers, hidden 1152, 16 heads).

    Multi-head attention, SwiGLU MLP of width 4608, untied input and output embeddings over a
    32,000-token vocabulary: 583.4M parameters. From scratch on countdown in bf16 on one GPU.

    Returns:
        The config.
    """
    return GRPOConfig(
        run=RunConfig(device="cuda", target_reward=None, num_steps=50, checkpoint_every=25),
        model=ModelConfig(
            name="tiny",
            hidden_size=1152,
            num_layers=24,
            num_attention_heads=16,
            num_query_groups=16,
            ffn_hidden_size=4608,
            vocab_size=32000,
            dtype="bfloat16",
        ),
        task=TaskConfig(name="countdown"),
        rollout=RolloutConfig(num_prompts=64, group_size=8, max_new_tokens=16),
        optimizer=_gpu_optimizer(1e-4),
        packing=PackingConfig(max_tokens_per_microbatch=8192),
    )


def qwen3_moe_30b_a3b() -> GRPOConfig:
    """A Qwen3-30B-A3B-shaped MoE policy from scratch on countdown, for several GPUs (bf16).

    Qwen3-30B-A3B's published shape (48 layers, hidden 2048, 32 query / 4 key-value heads of
    128, QK-norm, 128 experts of width 768, top-8, router load-balancing coefficient 0.001,
    151,936-token vocabulary), except that the input and output embeddings are tied (the
    ``qwen3-0.6b`` base shape ties them): about 30.2B parameters, 3.0B active per token. It
    needs its experts split: e.g. ``torchrun --nproc-per-node 8 ... --train-parallel.ep 8
    --infer-parallel.ep 8``. To post-train the real checkpoint, give ``--model.hf-path``.

    Returns:
        The config.
    """
    return GRPOConfig(
        run=RunConfig(device="cuda", target_reward=None, num_steps=50, checkpoint_every=25),
        model=ModelConfig(
            name="qwen3-0.6b",
            hidden_size=2048,
            num_layers=48,
            num_attention_heads=32,
            num_query_groups=4,
            ffn_hidden_size=6144,
            vocab_size=151936,
            dtype="bfloat16",
            moe=MoEModelConfig(
                num_experts=128, top_k=8, expert_ffn_hidden_size=768, aux_loss_coeff=0.001
            ),
        ),
        task=TaskConfig(name="countdown"),
        rollout=RolloutConfig(num_prompts=64, group_size=8, max_new_tokens=16),
        optimizer=_gpu_optimizer(1e-5),
        packing=PackingConfig(max_tokens_per_microbatch=8192),
    )


PRESETS: dict[str, Callable[[], GRPOConfig]] = {
    "tiny-arith": tiny_arith,
    "tiny-moe-arith": tiny_moe_arith,
    "countdown-0.5b": countdown_0_5b,
    "gpt-583m": gpt_583m,
    "qwen3-moe-30b-a3b": qwen3_moe_30b_a3b,
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
