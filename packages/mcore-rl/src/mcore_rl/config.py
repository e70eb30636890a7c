"""``GRPOConfig``: a GRPO run in nested sections, the source of the ``mcore-rl grpo`` options.

Each section is a dataclass that validates its own fields; :class:`GRPOConfig` checks what
spans sections. The loss and optimiser sections are :class:`~mcore_rl.loss.LossConfig` and
:class:`mcore_parallel.OptimizerConfig` themselves, so their fields are declared once. On the
command line a field is ``--<section>.<field>`` (``--model.hf-path``, ``--optimizer.lr``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, get_type_hints

from mcore_parallel import OptimizerConfig
from mcore_rl._config_checks import check_choices, check_minimums
from mcore_rl.errors import RLConfigError
from mcore_rl.loss import LossConfig
from mcore_rl.moe_config import MoEModelConfig, as_moe_section, check_expert_layouts
from mcore_rl.parallel_config import ParallelConfig

__all__ = [
    "DataConfig",
    "EvalConfig",
    "GRPOConfig",
    "ModelConfig",
    "MoEModelConfig",
    "PackingConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
]


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Where and how long a run goes: run directory, seed, device, workers, stopping, outputs."""

    run_dir: str | None = None
    """Directory of metrics, plots and checkpoints; None makes ``runs/grpo-<time>``."""
    resume: bool = False
    """Continue the run in ``run_dir`` from its latest checkpoint."""
    seed: int = 1
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
    """Save a resumable checkpoint every this many steps (and at the end); 0: only at the end."""
    hf_checkpoint_every: int = 0
    """Export a Hugging Face checkpoint every this many steps and at the end; 0: only at the
    end of runs from ``model.hf_path``."""
    cpu_threads: int | None = 1
    """Intra-op threads of torch on the CPU (1 is fastest for the tiny default model), restored
    when an in-process run ends; None keeps torch's default."""
    progress: bool = True
    """Show rich progress bars for the phases of each step."""
    plot: bool = True
    """Write ``metrics.png`` (reward, KL, length, evaluation) at the end."""
    tensorboard: bool = False
    """Also log every metric to TensorBoard under ``<run_dir>/tensorboard`` (extra
    ``mcore-rl[tensorboard]``)."""

    def __post_init__(self) -> None:
        check_minimums(
            self,
            {
                "num_workers": 1,
                "num_steps": 1,
                "target_window": 1,
                "checkpoint_every": 0,
                "hf_checkpoint_every": 0,
                "cpu_threads": 1,
            },
        )
        check_choices(self)
        if self.target_reward is not None and not 0.0 < self.target_reward <= 1.0:
            raise RLConfigError(f"target_reward={self.target_reward} must be in (0, 1] or None")
        if self.resume and self.run_dir is None:
            raise RLConfigError("resume=True needs run_dir, the directory of the run to continue")


_SHAPE_FIELDS = (
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
)
"""ModelConfig fields that override the shape of a model trained from scratch."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The policy: a named shape trained from scratch, or a Hugging Face checkpoint."""

    hf_path: str | None = None
    """Hugging Face checkpoint directory (``config.json``, safetensors, ``tokenizer.json``):
    the policy and the reference start from its weights and it brings its tokenizer, chat
    template and eos/pad ids. None trains ``name`` from scratch with the task's characters."""
    name: str = "tiny"
    """``mcore_models.GPTConfig.from_name`` shape trained from scratch (without ``hf_path``)."""
    hidden_size: int | None = None
    """Override of the shape's hidden size (from scratch only)."""
    num_layers: int | None = None
    """Override of the shape's layer count (from scratch only)."""
    num_attention_heads: int | None = None
    """Override of the shape's query heads (from scratch only)."""
    num_query_groups: int | None = None
    """Override of the shape's key/value heads (from scratch only)."""
    ffn_hidden_size: int | None = None
    """Override of the shape's MLP width (from scratch only)."""
    vocab_size: int | None = None
    """Model vocabulary from scratch; None uses the task tokenizer's (a larger one only costs
    time, which benchmarks want to measure)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype (a checkpoint is converted on load)."""
    batch_invariant: bool = False
    """Batch-invariant numerics in the policy's training forward and in the rollout engine
    (``mcore_models.GPTConfig.batch_invariant``): their log-probs are bitwise equal, so
    ``token_prob_error`` is 0 and the importance ratio is exactly 1 on-policy. Slower."""
    moe: MoEModelConfig = field(default_factory=MoEModelConfig)
    """Mixture-of-experts MLP (``--model.moe.num-experts``) and its router losses."""

    def __post_init__(self) -> None:
        self.moe = as_moe_section(self.moe)
        check_minimums(self, {name: 1 for name in _SHAPE_FIELDS})
        check_choices(self)
        if not isinstance(self.batch_invariant, bool):
            raise RLConfigError(f"batch_invariant={self.batch_invariant!r} must be True or False")
        if self.hf_path is not None:
            shaped = [n for n in _SHAPE_FIELDS if getattr(self, n) is not None]
            if shaped:
                raise RLConfigError(
                    f"{shaped[0]}={getattr(self, shaped[0])} cannot change the shape of the "
                    f"checkpoint hf_path={self.hf_path!r}; drop it or drop hf_path"
                )


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """A procedural, verifiable task (used when no prompt dataset is given)."""

    name: str = "arithmetic"
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

    def __post_init__(self) -> None:
        # The minimums of the task classes, checked here so that a bad value fails before the
        # workers are built.
        check_minimums(
            self, {"max_operand": 0, "num_numbers": 2, "max_number": 1, "max_list_length": 2}
        )


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompts with reference answers from a file (instead of a procedural task).

    Prompts that do not fit the context (prompt tokens + ``rollout.max_new_tokens`` beyond the
    model's ``max_position_embeddings`` or ``max_prompt_tokens``) are skipped and counted (in
    ``summary.md`` and the first step's metrics); a set left empty is an error.
    """

    path: str | None = None
    """A ``.jsonl``/``.json`` (one object per line) or ``.parquet`` file, or ``hf:NAME`` (with
    ``split``) loaded with the ``datasets`` package when installed. None: use ``task``."""
    prompt_field: str = "prompt"
    """Field holding the prompt text."""
    answer_field: str = "answer"
    """Field holding the reference answer (GSM8K's ``... #### 72`` is understood)."""
    system_prompt: str | None = None
    """System message put before every prompt (through the chat template)."""
    chat_template: bool = True
    """Render prompts with the checkpoint's chat template when it has one."""
    split: str = "train"
    """Split of an ``hf:`` dataset."""
    eval_path: str | None = None
    """Held-out prompts in their own file; None holds out ``eval_size`` prompts of ``path``."""
    eval_size: int = 0
    """Prompts of ``path`` held out for evaluation (after the seeded shuffle)."""
    epochs: int | None = None
    """Passes over the training prompts (reshuffled every epoch) before the run stops; None
    cycles until ``run.num_steps``."""
    max_prompt_tokens: int | None = None
    """Skip prompts longer than this many tokens; None: only the context bounds them."""

    def __post_init__(self) -> None:
        check_minimums(self, {"eval_size": 0, "epochs": 1, "max_prompt_tokens": 1})
        if not self.prompt_field or not self.answer_field:
            raise RLConfigError(
                f"prompt_field={self.prompt_field!r} and answer_field={self.answer_field!r} "
                "must be non-empty"
            )


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Rewards of dataset prompts: registered names and ``module:function`` user rewards."""

    functions: tuple[str, ...] = ("math",)
    """Reward names (``math``, ``format``) or ``module:function`` callables
    ``f(completion, answer, prompt) -> float``; the reward is their weighted mean."""
    weights: tuple[float, ...] | None = None
    """Weight of each function; None weighs them equally."""
    num_workers: int = 0
    """Processes scoring completions in parallel (for slow rewards); 0 scores in the worker."""
    timeout: float = 10.0
    """Seconds a sample may take in the process pool before it fails with reward 0."""

    def __post_init__(self) -> None:
        self.functions = tuple(self.functions)
        if self.weights is not None:
            self.weights = tuple(float(w) for w in self.weights)
        if not self.functions:
            raise RLConfigError("functions=() must name at least one reward")
        if self.weights is not None:
            if len(self.weights) != len(self.functions):
                raise RLConfigError(
                    f"weights={self.weights} must give one weight per function {self.functions}"
                )
            if not all(math.isfinite(w) and w >= 0.0 for w in self.weights) or not any(
                self.weights
            ):
                raise RLConfigError(f"weights={self.weights} must be finite, >= 0 and not all zero")
        check_minimums(self, {"num_workers": 0})
        if not (math.isfinite(self.timeout) and self.timeout > 0.0):
            raise RLConfigError(f"timeout={self.timeout} must be a positive number of seconds")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Sampling of the completions of each step."""

    num_prompts: int = 16
    """Prompts per step (split over the data-parallel ranks)."""
    group_size: int = 16
    """Completions sampled per prompt (G); at least 2 for a group advantage."""
    max_new_tokens: int = 3
    """Most tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are computed at the same temperature)."""
    parallel_generation_tasks: int = 512
    """Most requests handed to the inference engine at once."""
    use_cuda_graphs: bool = True
    """Let the inference engine capture CUDA graphs (ignored on the CPU)."""
    keep_engine: bool = True
    """Keep one inference engine for the whole run when it runs the training model itself
    (same layout): its KV cache and CUDA graphs are made once. False builds an engine every
    step and frees it before training (the KV cache's memory is back for training, and the
    graphs are captured again every step). A separate generation model always keeps its engine."""
    share_prompt_prefixes: bool = True
    """Let the long-lived inference engine (``keep_engine``) compute each group's prompt once:
    its samples share the KV blocks of the prompt
    (``mcore_inference.InferenceConfig.share_prompt_prefixes``; 2.29 -> 1.88 s for the 512 x
    (256 + 256) benchmark's generation on one H200). Tokens are those of the unshared engine
    on the CPU and in the batch-invariant mode; elsewhere they differ only by the rounding that
    any change of batch composition brings."""
    reward_requires_stop: bool = True
    """Completions cut at ``max_new_tokens`` without eos earn reward 0 (no credit for rambling)."""
    offload_optimizer: bool = False
    """Move the optimizer state and gradients to host memory during generation."""
    advantage_estimator: Literal["grpo", "leave_one_out", "dr_grpo"] = "grpo"
    """Group baseline: mean/std (GRPO), leave-one-out, or mean only (Dr. GRPO)."""

    def __post_init__(self) -> None:
        check_minimums(
            self,
            {
                "num_prompts": 1,
                "group_size": 2,
                "max_new_tokens": 1,
                "parallel_generation_tasks": 1,
            },
        )
        check_choices(self)
        if not (math.isfinite(self.temperature) and self.temperature > 0.0):
            raise RLConfigError(f"temperature={self.temperature} must be > 0 and finite")


@dataclass(kw_only=True, slots=True)
class PackingConfig:
    """How rollouts become microbatches and optimizer steps."""

    minibatches_per_step: int = 1
    """Optimizer steps per rollout batch (more than 1 makes the ratio leave 1 and clip)."""
    max_tokens_per_microbatch: int = 4096
    """Token budget of one packed microbatch (the bin size)."""
    max_sequences_per_bin: int | None = None
    """Fixed ``cu_seqlens`` width of a bin; None takes the fullest bin of each step."""
    algorithm: Literal["ffd", "mffd", "next_fit"] = "ffd"
    """Bin-packing algorithm."""
    share_prompts: bool = False
    """Pack each group's prompt once per row, its completions attending to it
    (:mod:`mcore_rl.shared_prompts`): the same log-probs and gradients up to rounding for
    about half the tokens at prompts as long as the completions. Rows are then filled group
    by group (``algorithm`` is not used). Needs ``train_parallel.cp == 1`` and
    ``model.batch_invariant=False``."""

    def __post_init__(self) -> None:
        check_minimums(
            self,
            {"minibatches_per_step": 1, "max_tokens_per_microbatch": 1, "max_sequences_per_bin": 1},
        )
        check_choices(self)


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Greedy evaluation on held-out prompts: pass@1 and mean reward."""

    every: int = 0
    """Evaluate every this many steps (and after the last); 0 never."""
    num_prompts: int = 64
    """Most held-out prompts evaluated (procedural tasks draw this many with a fixed seed)."""

    def __post_init__(self) -> None:
        check_minimums(self, {"every": 0, "num_prompts": 1})


def _optimizer_defaults() -> OptimizerConfig:
    return OptimizerConfig(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0, clip_grad=1.0)


def _loss_defaults() -> LossConfig:
    return LossConfig(entropy_coef=0.1)


_SECTIONS: dict[str, type] = {}
"""Section name -> its dataclass (filled below from GRPOConfig's annotations)."""


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    """A GRPO run: model, prompts, rewards, rollouts, loss, optimiser, packing, layouts, outputs.

    The defaults are the main job: a tiny GPT trained from scratch on the addition of digits
    0 to 3 on the CPU, which reaches a mean reward of 0.9 within minutes. The entropy bonus
    keeps every prompt's group diverse until its answer is found: without it the policy
    collapses onto wrong answers for some prompts, whose groups then give no signal.
    """

    run: RunConfig = field(default_factory=RunConfig)
    """Run directory, seed, device, workers, stopping, outputs."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy: a shape from scratch or a Hugging Face checkpoint."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The procedural task (when ``data.path`` is not set)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts from a file or a Hugging Face dataset."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards of dataset prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    loss: LossConfig = field(default_factory=_loss_defaults)
    """Clipped objective, KL, entropy bonus, importance-sampling cap."""
    optimizer: OptimizerConfig = field(default_factory=_optimizer_defaults)
    """AdamW of the distributed optimizer."""
    packing: PackingConfig = field(default_factory=PackingConfig)
    """Microbatches and optimizer steps per rollout batch."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Greedy evaluation on held-out prompts."""
    train_parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Layout of training (tp, pp with virtual stages, cp, ep, sequence parallelism, dp)."""
    infer_parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Layout of generation on the same ranks (tp, pp, ep, dp); weights are resharded from
    the training layout in memory after every optimizer step."""

    def __post_init__(self) -> None:
        for name, kind in _SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise RLConfigError(
                    f"{name}={value!r} must be a {kind.__name__}, got {type(value).__name__}"
                )
        optimizer = self.optimizer
        for name in ("lr", "weight_decay", "clip_grad", "eps"):
            value = getattr(optimizer, name)
            if not math.isfinite(value):
                raise RLConfigError(f"optimizer.{name}={value} must be a finite number")
        for name in ("clip_low", "clip_high", "kl_beta", "entropy_coef"):
            value = getattr(self.loss, name)
            if not math.isfinite(value):
                raise RLConfigError(f"loss.{name}={value} must be a finite number")
        inference = self.infer_parallel
        for size in ("vp", "cp"):
            if getattr(inference, size) != 1:
                raise RLConfigError(
                    f"infer_parallel.{size}={getattr(inference, size)} is not supported: the "
                    "inference engine serves tp x pp x ep x dp layouts (vp = cp = 1)"
                )
        if inference.cp_method != "ring":
            raise RLConfigError(
                f"infer_parallel.cp_method={inference.cp_method!r} is not supported: the "
                "inference engine runs without context parallelism"
            )
        if inference.sequence_parallel:
            raise RLConfigError(
                "infer_parallel.sequence_parallel=True is not supported: the inference engine "
                "runs without sequence parallelism"
            )
        if self.train_parallel.cp > 1 and self.model.batch_invariant:
            raise RLConfigError(
                f"model.batch_invariant=True with train_parallel.cp={self.train_parallel.cp} "
                "is not supported: ring attention over the context-parallel ranks is not "
                "batch-invariant; expected train_parallel.cp=1"
            )
        if self.packing.share_prompts and (
            self.train_parallel.cp > 1 or self.model.batch_invariant
        ):
            raise RLConfigError(
                f"packing.share_prompts=True with train_parallel.cp={self.train_parallel.cp} "
                f"and model.batch_invariant={self.model.batch_invariant} is not supported: "
                "context-parallel and batch-invariant attention take no shared prefixes; "
                "expected cp=1 and batch_invariant=False"
            )
        if self.data.path is not None and self.model.hf_path is None:
            raise RLConfigError(
                f"data.path={self.data.path!r} needs model.hf_path: prompt datasets are "
                "tokenized with the checkpoint's tokenizer (the character tokenizer only "
                "knows the procedural tasks)"
            )
        if self.data.path is None and (self.data.eval_path is not None or self.data.eval_size):
            raise RLConfigError("data.eval_path and data.eval_size need data.path")
        check_expert_layouts(self)

    def replace(self, **sections: Any) -> GRPOConfig:
        """Returns a copy with some sections changed (validated again).

        Args:
            **sections: Per section name either a new section object or a dict of the fields
                to change in it, e.g. ``replace(run={"num_steps": 2}, optimizer={"lr": 3e-4})``.

        Returns:
            The new config.

        Raises:
            RLConfigError: If a name is not a section or field, or a value is invalid.
        """
        changed: dict[str, Any] = {}
        for name, value in sections.items():
            if name not in _SECTIONS:
                raise RLConfigError(f"{name!r} is not a GRPOConfig section ({sorted(_SECTIONS)})")
            if isinstance(value, dict):
                current = getattr(self, name)
                known = {f.name for f in fields(current)}
                unknown = sorted(set(value) - known)
                if unknown:
                    raise RLConfigError(f"{unknown} are not fields of section {name!r}")
                value = replace(current, **value)
            changed[name] = value
        return replace(self, **changed)

    def to_dict(self) -> dict[str, Any]:
        """Returns the sections as a JSON-friendly nested dict.

        Returns:
            Section name -> field name -> value.
        """
        return {name: asdict(getattr(self, name)) for name in _SECTIONS}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GRPOConfig:
        """Builds a config from :meth:`to_dict`'s form (missing sections take their defaults).

        Args:
            values: Section name -> field name -> value.

        Returns:
            The config.

        Raises:
            RLConfigError: If a name is not a section or field, or a value is invalid.
        """
        return cls().replace(**{name: dict(section) for name, section in values.items()})


_SECTIONS.update({f.name: get_type_hints(GRPOConfig)[f.name] for f in fields(GRPOConfig)})
