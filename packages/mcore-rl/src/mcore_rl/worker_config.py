"""What a GRPO worker derives from the run config: the task, the model shape, the context
length of a checkpoint and the configuration of its long-lived inference engine."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from mcore_inference import InferenceConfig
from mcore_models import GPTConfig
from mcore_rl.config import GRPOConfig
from mcore_rl.moe_config import moe_config_for
from mcore_rl.rewards import RewardScorer
from mcore_rl.tasks import DatasetTask, Task, get_task

__all__ = ["build_task", "checkpoint_context_length", "engine_config", "model_config"]


def build_task(config: GRPOConfig) -> Task:
    """Builds the config's task with the options that belong to it.

    Args:
        config: The run config.

    Returns:
        The task.
    """
    if config.data.path is not None:
        reward = config.reward
        scorer = RewardScorer(
            reward.functions, reward.weights, num_workers=reward.num_workers, timeout=reward.timeout
        )
        return DatasetTask(scorer)
    task = config.task
    options: dict[str, dict[str, Any]] = {
        "arithmetic": {"max_operand": task.max_operand, "ops": task.ops},
        "countdown": {"num_numbers": task.num_numbers, "max_number": task.max_number},
        "sort": {"max_length": task.max_list_length},
        "reverse": {"max_length": task.max_list_length},
    }
    return get_task(task.name, **options.get(task.name, {}))


def model_config(config: GRPOConfig, vocab_size: int) -> GPTConfig:
    """The shape of a policy built from scratch (no ``model.hf_path``).

    Args:
        config: The run config.
        vocab_size: The tokenizer's vocabulary size.

    Returns:
        The model config: the preset ``model.name`` with the run's overrides, its vocabulary
        padded to split evenly over the tensor-parallel ranks of both layouts.
    """
    model = config.model
    # The vocabulary splits evenly over the tensor-parallel ranks of both layouts (padding
    # ids are never in the tokenizer: a completion sampling one scores 0).
    multiple = math.lcm(config.train_parallel.tp, config.infer_parallel.tp)
    vocab_size = -(-vocab_size // multiple) * multiple
    overrides: dict[str, Any] = {"vocab_size": vocab_size, "seed": config.run.seed}
    overrides["dtype"] = model.dtype
    overrides["batch_invariant"] = model.batch_invariant
    for name in (
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "num_query_groups",
        "ffn_hidden_size",
    ):
        if getattr(model, name) is not None:
            overrides[name] = getattr(model, name)
    moe = moe_config_for(model.moe)
    if moe is not None:
        overrides["moe"] = moe
    return GPTConfig.from_name(model.name, **overrides)


def checkpoint_context_length(directory: str | Path) -> int:
    """The context length of a Hugging Face checkpoint.

    Args:
        directory: The checkpoint directory.

    Returns:
        ``max_position_embeddings`` of its ``config.json`` (GPTConfig's default without it).
    """
    file = Path(directory) / "config.json"
    values = json.loads(file.read_text()) if file.is_file() else {}
    found = values.get("max_position_embeddings")
    return int(found) if isinstance(found, int) else GPTConfig().max_position_embeddings


def engine_config(
    config: GRPOConfig, context_length: int, device: torch.device, world_size: int
) -> InferenceConfig:
    """The long-lived engine's config: every rollout of a step fits one batch (up to
    ``rollout.parallel_generation_tasks``), contexts up to the prompt budget.

    Args:
        config: The run config.
        context_length: Longest prompt plus completion.
        device: The rank's device.
        world_size: Ranks of the run.

    Returns:
        The engine config.
    """
    rollout = config.rollout
    replicas = config.infer_parallel.data_parallel_size(world_size)
    per_replica = -(-rollout.num_prompts // replicas) * rollout.group_size
    batch = max(1, min(rollout.parallel_generation_tasks, per_replica))
    # On a GPU a step takes up to 16384 tokens: the prompts of a large rollout batch are in
    # after a few prefill steps (2048 admits 8 prompts of 256 tokens a step), so fewer
    # mixed prefill/decode steps run without CUDA graphs (2.76 -> 2.60 s for the 1B
    # benchmark's 512 x 256 new tokens on an H100). The CPU keeps the small budget.
    budget = 16384 if device.type == "cuda" else 2048
    return InferenceConfig(
        max_batch_size=batch,
        max_sequence_length=context_length,
        block_size=16,
        attention_split_size=256,
        max_tokens_per_step=max(budget, batch),
        use_cuda_graphs=rollout.use_cuda_graphs,
        seed=config.run.seed,
        share_prompt_prefixes=rollout.share_prompt_prefixes,
    )
