"""The GRPO policy worker: one per rank, the same code in-process, under torchrun or in Ray.

A step is collective over the data-parallel group: generate this rank's share of rollouts,
gather them, compute advantages, pack every sequence and give each rank its bins, compute old
(and reference) log-probs with the training forward, then one or more optimizer steps with the
token-normalised GRPO loss.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_ckpt import load, save
from mcore_models import GPTConfig, GPTModel, parallelize
from mcore_parallel import ParallelState, forward_backward
from mcore_parallel.distributed.config import DDPConfig, OptimizerConfig
from mcore_parallel.distributed.ddp import DistributedDataParallel
from mcore_parallel.distributed.optimizer import DistributedOptimizer
from mcore_rl.advantages import compute_advantages
from mcore_rl.config import GRPOConfig
from mcore_rl.logprobs import row_logprobs
from mcore_rl.loss import grpo_loss
from mcore_rl.memory import allocated_bytes, live_tensor_bytes
from mcore_rl.packing import PackingContext, distribute_bins, pack_sequences
from mcore_rl.reference import ReferenceWeights, unwrap_model
from mcore_rl.rollout import Rollout, generate_rollouts
from mcore_rl.tasks import Task, get_task, sample_problems
from mcore_rl.tokenizer import CharTokenizer

__all__ = ["GRPOWorker", "build_task", "derive_seed"]

PhaseCallback = Callable[[str], None]
"""Called with the name of each phase as it starts (drives progress bars)."""


def derive_seed(*parts: int | str) -> int:
    """Derives a 31-bit seed from parts, so every step and rank samples independently.

    Args:
        *parts: Seed, step, rank, purpose ...

    Returns:
        A non-negative seed.
    """
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def build_task(config: GRPOConfig) -> Task:
    """Builds the config's task with the options that belong to it.

    Args:
        config: The run config.

    Returns:
        The task.
    """
    options: dict[str, dict[str, Any]] = {
        "arithmetic": {"max_operand": config.max_operand, "ops": config.ops},
        "countdown": {"num_numbers": config.num_numbers, "max_number": config.max_number},
        "sort": {"max_length": config.max_list_length},
        "reverse": {"max_length": config.max_list_length},
    }
    return get_task(config.task, **options.get(config.task, {}))


def _model_config(config: GRPOConfig, vocab_size: int) -> GPTConfig:
    overrides: dict[str, Any] = {"vocab_size": vocab_size, "seed": config.seed}
    overrides["dtype"] = config.dtype
    if config.hidden_size is not None:
        overrides["hidden_size"] = config.hidden_size
    if config.num_layers is not None:
        overrides["num_layers"] = config.num_layers
    return GPTConfig.from_name(config.model, **overrides)


class GRPOWorker:
    """One rank of a GRPO run: the policy, its optimizer, the reference weights.

    Args:
        config: The run config.
        state: This rank's parallel state (its ``dp_group`` splits the prompts).

    Raises:
        RLConfigError: If the config is invalid.
    """

    def __init__(self, config: GRPOConfig, state: ParallelState) -> None:
        self.config = config
        self.state = state
        self.device = torch.device(state.device)
        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self.task = build_task(config)
        self.tokenizer = CharTokenizer(self.task.alphabet)
        torch.manual_seed(config.seed)
        vocab_size = max(config.vocab_size or 0, self.tokenizer.vocab_size)
        model = GPTModel(_model_config(config, vocab_size), device=self.device)
        parallelize(model, state)
        ddp_config = DDPConfig(use_distributed_optimizer=True, overlap_param_gather=True)
        self.model = DistributedDataParallel(model, ddp_config, state)
        self.optimizer = DistributedOptimizer(
            self.model,
            OptimizerConfig(
                lr=config.lr,
                betas=(0.9, 0.99),
                weight_decay=config.weight_decay,
                clip_grad=config.clip_grad,
            ),
        )
        self.reference = ReferenceWeights(self.model, optimizer=self.optimizer)
        self.loss_config = config.loss_config()
        self.dp_size = state.dp_size
        self.dp_rank = state.dp_rank
        self.track_live_tensors = False
        """Count live tensors at every step start (slow; used by tests on the CPU)."""

    # ------------------------------------------------------------------ one step

    def step(self, step: int, on_phase: PhaseCallback | None = None) -> dict[str, float]:
        """Runs one GRPO step.

        Args:
            step: The step number (0-based); prompts and sampling derive from it.
            on_phase: Called with each phase's name as it starts.

        Returns:
            The step's metrics (identical on every rank).
        """
        cfg = self.config
        phase = on_phase or (lambda name: None)
        times: dict[str, float] = {}
        metrics: dict[str, float] = {"step": float(step)}
        metrics["memory/allocated_bytes"] = float(allocated_bytes(self.device))
        if self.track_live_tensors:
            count, nbytes = live_tensor_bytes()
            metrics["memory/live_tensors"], metrics["memory/live_tensor_bytes"] = count, nbytes

        phase("generate")
        start = time.perf_counter()
        problems = sample_problems(
            self.task, cfg.num_prompts, derive_seed(cfg.seed, step, "prompts")
        )
        with self.generation_mode():
            rollouts = generate_rollouts(
                self.model,
                problems,
                task=self.task,
                tokenizer=self.tokenizer,
                group_size=cfg.group_size,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                seed=derive_seed(cfg.seed, step, self.dp_rank, "sampling"),
                parallel_generation_tasks=cfg.parallel_generation_tasks,
                use_cuda_graphs=cfg.use_cuda_graphs,
                dp_group=self.state.dp_group if self.dp_size > 1 else None,
                require_stop=cfg.reward_requires_stop,
            )
        times["generate"] = time.perf_counter() - start

        metrics.update(self.train_on_rollouts(rollouts, times, phase))
        for name, seconds in times.items():
            metrics[f"time/{name}"] = seconds
        return metrics

    def train_on_rollouts(
        self,
        rollouts: list[Rollout],
        times: dict[str, float] | None = None,
        on_phase: PhaseCallback | None = None,
    ) -> dict[str, float]:
        """Trains on gathered rollouts: advantages, packing, log-probs, optimizer steps.

        Args:
            rollouts: The rollouts of every rank, ``group_size`` per prompt, identical on
                every rank.
            times: Filled with the seconds of each phase.
            on_phase: Called with each phase's name as it starts.

        Returns:
            Reward, loss, KL, entropy, mismatch and packing metrics (identical on every rank).
        """
        cfg = self.config
        phase = on_phase or (lambda name: None)
        times = {} if times is None else times
        metrics: dict[str, float] = {}
        rewards = torch.tensor([r.reward for r in rollouts])
        advantages = compute_advantages(rewards, cfg.group_size, cfg.advantage_estimator)
        metrics.update(_rollout_metrics(rollouts, rewards))

        phase("logprobs")
        start = time.perf_counter()
        minibatches = self._pack(rollouts, advantages, metrics)
        for minibatch in minibatches:
            self._old_logprobs(minibatch)
        times["logprobs"] = time.perf_counter() - start
        if cfg.kl_beta > 0.0:
            phase("reference")
            start = time.perf_counter()
            with self.reference.use_reference_weights():
                for minibatch in minibatches:
                    minibatch["ref"] = self._forward_rows(minibatch["context"])
            times["reference"] = time.perf_counter() - start

        phase("train")
        start = time.perf_counter()
        sums: dict[str, torch.Tensor] = {}
        grad_norms = []
        for minibatch in minibatches:
            grad_norms.append(self._train_minibatch(minibatch, sums))
        times["train"] = time.perf_counter() - start
        totals = self._reduce_sums(sums, len(minibatches))
        metrics.update(totals)
        metrics["grad_norm"] = float(sum(grad_norms) / len(grad_norms))
        return metrics

    # ------------------------------------------------------------------ phases

    @contextlib.contextmanager
    def generation_mode(self) -> Iterator[None]:
        """Context for generation: parameters synchronised, hooks off, optionally offloaded.

        Generation must see complete parameters, and no forward pre-hook may run inside the
        engine (a hook waiting on a collective cannot be captured in a CUDA graph). With
        ``offload_optimizer`` the optimizer state and gradients live in host memory inside.
        Everything is restored on exit, also on exceptions.

        Yields:
            None.
        """
        with contextlib.ExitStack() as stack:
            self.optimizer.start_param_sync(force_sync=True)
            stack.enter_context(self.optimizer.param_sync_hooks_disabled())
            if self.config.offload_optimizer:
                stack.enter_context(self.optimizer.offloaded(optimizer_state=True, grads=True))
            yield

    def _pack(
        self, rollouts: list[Rollout], advantages: torch.Tensor, metrics: dict[str, float]
    ) -> list[dict[str, Any]]:
        cfg = self.config
        groups = len(rollouts) // cfg.group_size
        per_minibatch = -(-groups // cfg.minibatches_per_step)
        minibatches: list[dict[str, Any]] = []
        efficiencies = []
        for first in range(0, groups, per_minibatch):
            chosen = list(
                range(first * cfg.group_size, min(groups, first + per_minibatch) * cfg.group_size)
            )
            sequences = [rollouts[i].prompt_ids + rollouts[i].completion_ids for i in chosen]
            info = pack_sequences(
                [len(s) for s in sequences],
                max_sequences_per_bin=cfg.max_sequences_per_bin,
                algorithm=cfg.packing_algorithm,
                token_budget=cfg.max_tokens_per_microbatch,
            )
            efficiencies.append(info.efficiency)
            mine = distribute_bins(info, self.dp_size)[self.dp_rank]
            context = PackingContext.build(
                sequences,
                [len(rollouts[i].prompt_ids) for i in chosen],
                advantages[chosen],
                info,
                bin_indices=mine,
                max_sequences_per_bin=cfg.max_sequences_per_bin,
                pad_id=self.tokenizer.pad_id,
            )
            inference = context.scatter(
                [torch.tensor(rollouts[i].inference_logprobs) for i in chosen]
            )
            minibatches.append(
                {
                    "context": context,
                    "inference": inference,
                    "num_global_tokens": float(
                        sum(len(rollouts[i].completion_ids) for i in chosen)
                    ),
                }
            )
        metrics["packing/efficiency"] = float(sum(efficiencies) / len(efficiencies))
        metrics["packing/bins_per_rank"] = float(minibatches[0]["context"].input_ids.shape[0])
        return minibatches

    def _row_forward(self, context: PackingContext, with_entropy: bool) -> Callable[..., Any]:
        def forward_step(model: Any, input_tensor: Any, row: int) -> Any:
            del input_tensor  # pipeline size 1: every row starts from its tokens
            logprobs, entropy = row_logprobs(
                model, context, row, temperature=self.config.temperature, device=self.device
            )
            return (logprobs, entropy) if with_entropy else logprobs

        return forward_step

    def _forward_rows(self, context: PackingContext) -> torch.Tensor:
        # The forward-only schedule (loss_func=None) collects one output per microbatch (row).
        result = forward_backward(
            self.model,
            list(range(context.input_ids.shape[0])),
            forward_step=self._row_forward(context, with_entropy=False),
            loss_func=None,
            forward_only=True,
        )
        return torch.stack([output.float().cpu() for output in result.outputs])

    def _old_logprobs(self, minibatch: dict[str, Any]) -> None:
        minibatch["old"] = self._forward_rows(minibatch["context"])

    def _train_minibatch(self, minibatch: dict[str, Any], sums: dict[str, torch.Tensor]) -> float:
        context: PackingContext = minibatch["context"]
        rows = int(context.input_ids.shape[0])

        def loss_func(output: Any, row: int) -> torch.Tensor:
            logprobs, entropy = output
            loss, metrics = grpo_loss(
                logprobs,
                self._row(row, minibatch["old"]),
                self._row(row, context.advantages),
                self._row(row, context.loss_mask),
                num_global_tokens=minibatch["num_global_tokens"],
                config=self.loss_config,
                ref_logprobs=self._row(row, minibatch["ref"]) if "ref" in minibatch else None,
                inference_logprobs=self._row(row, minibatch["inference"]),
                entropy=entropy,
            )
            metrics["loss"] = loss
            for name, value in metrics.items():
                sums[name] = sums.get(name, torch.zeros((), device=self.device)) + value.detach()
            # The schedule divides each loss by the row count and DDP averages over the DP
            # ranks; the loss already is a share of the global token mean, so undo both.
            return loss * (rows * self.dp_size)

        self.model.zero_grad_buffer()
        forward_backward(
            self.model,
            list(range(rows)),
            forward_step=self._row_forward(context, with_entropy=True),
            loss_func=loss_func,
            no_sync=self.model.no_sync,
        )
        return self.optimizer.step()

    def _row(self, row: int, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[row].to(self.device, non_blocking=True)

    def _reduce_sums(self, sums: dict[str, torch.Tensor], minibatches: int) -> dict[str, float]:
        names = sorted(sums)
        if not names:
            return {}
        packed = torch.stack([sums[n].float() for n in names])
        if self.dp_size > 1:
            dist.all_reduce(packed, group=self.state.dp_group)
        # Every minibatch normalises by its own token count: average the minibatch means.
        return {n: float(v) / minibatches for n, v in zip(names, packed.tolist())}

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_state(self, step: int) -> dict[str, Any]:
        return {
            "model": unwrap_model(self.model).state_dict(),
            "optimizer": self.optimizer,
            "reference": self.reference.state_dict(),
            "step": step,
        }

    def save_checkpoint(self, root: str | Path, step: int) -> None:
        """Saves model, optimizer and reference weights as checkpoint ``step`` under ``root``.

        Parameters are synchronised first (no all-gather in flight while saving).

        Args:
            root: The checkpoint root (``<run_dir>/checkpoints``).
            step: Number of completed steps.
        """
        self.optimizer.start_param_sync(force_sync=True)
        save(root, self._checkpoint_state(step), state=self.state, step=step)

    def load_checkpoint(self, root: str | Path) -> int:
        """Loads the latest checkpoint under ``root``.

        Args:
            root: The checkpoint root.

        Returns:
            Number of completed steps it holds.
        """
        self.optimizer.start_param_sync(force_sync=True)
        state = self._checkpoint_state(0)
        reference = {k: v.clone() for k, v in state["reference"].items()}
        state["reference"] = reference
        with self.optimizer.param_sync_hooks_disabled():
            load(root, state, state=self.state)
        self.reference.load_state_dict(reference)
        return int(state["step"])


def _rollout_metrics(rollouts: list[Rollout], rewards: torch.Tensor) -> dict[str, float]:
    lengths = torch.tensor([float(len(r.completion_ids)) for r in rollouts])
    return {
        "reward/mean": float(rewards.mean()),
        "reward/accuracy": float((rewards == 1.0).float().mean()),
        "response/length": float(lengths.mean()),
        "response/stopped": float(
            sum(r.finish_reason == "stop_token" for r in rollouts) / len(rollouts)
        ),
        "rollouts": float(len(rollouts)),
    }
