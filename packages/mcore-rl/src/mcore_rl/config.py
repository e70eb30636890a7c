"""``GRPOConfig``: every knob of a GRPO run, the source of the ``mcore-rl grpo`` options."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from mcore_rl.errors import RLConfigError
from mcore_rl.loss import LossConfig

__all__ = ["GRPOConfig"]


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    """A GRPO run: model, task, rollouts, loss, optimiser, packing, workers, run directory.

    The defaults are the main job: a tiny GPT trained from scratch on the addition of digits
    0 to 3 on the CPU, which reaches a mean reward of 0.9 within minutes. The entropy bonus
    keeps every prompt's group diverse until its answer is found: without it the policy
    collapses onto wrong answers for some prompts, whose groups then give no signal.
    """

    # ---------------------------------------------------------------- run
    run_dir: str | None = None
    """Directory of metrics, plots and checkpoints; None makes ``runs/grpo-<time>``."""
    resume: bool = False
    """Continue the run in ``run_dir`` from its latest checkpoint."""
    seed: int = 0
    """Seed of initialisation, prompts and sampling; a run is reproducible on the CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run; ``auto`` picks CUDA when available."""
    mode: Literal["in-process", "ray"] = "in-process"
    """``in-process`` runs the workers in this process (or under torchrun); ``ray`` starts one
    Ray actor per rank in a placement group."""
    num_workers: int = 1
    """Ranks of the Ray worker group (in-process mode takes the torchrun world size)."""
    num_steps: int = 300
    """Most GRPO steps to run."""
    target_reward: float | None = 0.9
    """Stop once the mean reward over the last ``target_window`` steps reaches this; None runs
    all ``num_steps``."""
    target_window: int = 3
    """Steps averaged for ``target_reward``."""
    checkpoint_every: int = 50
    """Save a checkpoint every this many steps (and at the end); 0 saves only at the end."""
    cpu_threads: int | None = 1
    """Intra-op threads of torch on the CPU (1 is fastest for the tiny default model), restored
    when an in-process run ends; None keeps torch's default."""
    progress: bool = True
    """Show rich progress bars for the phases of each step."""
    plot: bool = True
    """Write ``metrics.png`` (reward, KL, length) at the end."""

    # ---------------------------------------------------------------- model
    model: str = "tiny"
    """``mcore_models.GPTConfig.from_name`` preset, trained from scratch with the task vocabulary."""
    hidden_size: int | None = None
    """Override of the preset's hidden size."""
    num_layers: int | None = None
    """Override of the preset's layer count."""
    vocab_size: int | None = None
    """Model vocabulary; None uses the task tokenizer's (a larger one only costs time, which
    benchmarks want to measure)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype."""

    # ---------------------------------------------------------------- task
    task: str = "arithmetic"
    """Registered task name (``arithmetic``, ``countdown``, ``sort``, ``reverse`` or a user task)."""
    max_operand: int = 3
    """Arithmetic: operands are drawn from ``[0, max_operand]``."""
    ops: str = "+"
    """Arithmetic: operators to draw from."""
    num_numbers: int = 3
    """Countdown: numbers offered per prompt (at least 2)."""
    max_number: int = 9
    """Countdown: largest number offered."""
    max_list_length: int = 4
    """Sort and reverse: longest list (at least 2, the shortest list drawn)."""

    # ---------------------------------------------------------------- rollouts
    num_prompts: int = 16
    """Prompts per step (split over the data-parallel ranks)."""
    group_size: int = 16
    """Completions sampled per prompt (G)."""
    max_new_tokens: int = 3
    """Most tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are computed at the same temperature)."""
    parallel_generation_tasks: int = 512
    """Most requests handed to the inference engine at once."""
    use_cuda_graphs: bool = True
    """Let the inference engine capture CUDA graphs (ignored on the CPU)."""
    reward_requires_stop: bool = True
    """Completions cut at ``max_new_tokens`` without eos earn reward 0 (no credit for rambling)."""
    offload_optimizer: bool = False
    """Move the optimizer state and gradients to host memory during generation."""

    # ---------------------------------------------------------------- loss
    advantage_estimator: Literal["grpo", "leave_one_out", "dr_grpo"] = "grpo"
    """Group baseline: mean/std (GRPO), leave-one-out, or mean only (Dr. GRPO)."""
    clip_low: float = 0.2
    """Lower clip of the ratio: ``1 - clip_low``."""
    clip_high: float = 0.28
    """Upper clip of the ratio: ``1 + clip_high``."""
    kl_beta: float = 0.0
    """Weight of the k3 KL to the reference (the initial weights); 0 skips reference log-probs."""
    entropy_coef: float = 0.1
    """Weight of the entropy bonus in the loss."""
    importance_sampling_cap: float | None = 2.0
    """Cap of the truncated importance weight against inference log-probs; None turns it off."""

    # ---------------------------------------------------------------- optimiser and packing
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 turns it off."""
    minibatches_per_step: int = 1
    """Optimizer steps per rollout batch (more than 1 makes the ratio leave 1 and clip)."""
    max_tokens_per_microbatch: int = 4096
    """Token budget of one packed microbatch (the bin size)."""
    max_sequences_per_bin: int | None = None
    """Fixed ``cu_seqlens`` width of a bin; None takes the fullest bin of each step."""
    packing_algorithm: Literal["ffd", "mffd", "next_fit"] = "ffd"
    """Bin-packing algorithm."""

    def __post_init__(self) -> None:
        # The task minimums are those of the task classes, checked here so that a bad value
        # fails before the workers are built.
        minimums = {
            "num_workers": 1,
            "num_steps": 1,
            "target_window": 1,
            "num_prompts": 1,
            "group_size": 1,
            "max_new_tokens": 1,
            "parallel_generation_tasks": 1,
            "minibatches_per_step": 1,
            "max_tokens_per_microbatch": 1,
            "max_operand": 0,
            "num_numbers": 2,
            "max_number": 1,
            "max_list_length": 2,
        }
        for name, low in minimums.items():
            value = getattr(self, name)
            if value < low:
                raise RLConfigError(f"{name}={value} must be >= {low}")
        if self.group_size < 2:
            raise RLConfigError(f"group_size={self.group_size} must be >= 2 for group advantages")
        if self.checkpoint_every < 0:
            raise RLConfigError(f"checkpoint_every={self.checkpoint_every} must be >= 0")
        if self.target_reward is not None and not 0.0 < self.target_reward <= 1.0:
            raise RLConfigError(f"target_reward={self.target_reward} must be in (0, 1] or None")
        if not self.temperature > 0.0:
            raise RLConfigError(f"temperature={self.temperature} must be > 0")
        if self.resume and self.run_dir is None:
            raise RLConfigError("resume=True needs run_dir, the directory of the run to continue")
        if self.max_sequences_per_bin is not None and self.max_sequences_per_bin < 1:
            raise RLConfigError(f"max_sequences_per_bin={self.max_sequences_per_bin} must be >= 1")
        if self.lr < 0.0 or self.weight_decay < 0.0 or self.clip_grad < 0.0:
            raise RLConfigError(
                f"lr={self.lr}, weight_decay={self.weight_decay}, clip_grad={self.clip_grad} "
                "must all be >= 0"
            )
        for name in ("hidden_size", "num_layers", "vocab_size", "cpu_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise RLConfigError(f"{name}={value} must be >= 1 or None")
        # tyro checks these choices on the command line; the Python API needs the same check.
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise RLConfigError(f"{name}={value!r} is unknown, expected one of {choices}")
        # The loss settings fail here rather than after the workers and the model are built.
        self.loss_config()

    def loss_config(self) -> LossConfig:
        """Returns the loss hyper-parameters of this run.

        Returns:
            The :class:`~mcore_rl.loss.LossConfig` of the clip, KL, entropy and importance
            sampling fields.

        Raises:
            RLConfigError: If one of those fields is invalid.
        """
        return LossConfig(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            kl_beta=self.kl_beta,
            entropy_coef=self.entropy_coef,
            importance_sampling_cap=self.importance_sampling_cap,
        )

    def replace(self, **changes: Any) -> GRPOConfig:
        """Returns a copy with some fields changed (validated again).

        Args:
            **changes: Field values.

        Returns:
            The new config.

        Raises:
            RLConfigError: If a name is not a field or a value is invalid.
        """
        names = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise RLConfigError(f"{unknown} are not GRPOConfig fields")
        values = {name: getattr(self, name) for name in names}
        values.update(changes)
        return GRPOConfig(**values)

    def to_dict(self) -> dict[str, Any]:
        """Returns the fields as a JSON-friendly dict.

        Returns:
            Field name -> value.
        """
        return {f.name: getattr(self, f.name) for f in fields(self)}


_CHOICES: dict[str, tuple[Any, ...]] = {
    name: get_args(hint)
    for name, hint in get_type_hints(GRPOConfig).items()
    if get_origin(hint) is Literal
}
"""Field name -> the values its ``Literal`` annotation allows."""
