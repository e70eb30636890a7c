"""The GRPO policy worker: one per rank, the same code in-process, under torchrun or in Ray.

A step is collective over the data-parallel group: generate this rank's share of rollouts,
gather them, compute advantages, pack every sequence and give each rank its bins, compute old
(and reference) log-probs with the training forward, then one or more optimizer steps with the
token-normalised GRPO loss.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_ckpt import load, save
from mcore_inference import HFTokenizer, InferenceConfig, InferenceEngine
from mcore_models import GPTConfig, GPTModel
from mcore_models.gpt.hf import save_hf
from mcore_parallel import ParallelState, forward_backward
from mcore_parallel.distributed.config import DDPConfig
from mcore_parallel.distributed.ddp import DistributedDataParallel
from mcore_parallel.distributed.optimizer import DistributedOptimizer
from mcore_parallel.sharding import ShardedTensor
from mcore_rl.advantages import compute_advantages
from mcore_rl.config import GRPOConfig
from mcore_rl.context_parallel import packing_multiples, split_packed_rows, split_packing_context
from mcore_rl.errors import RLConfigError, RLStateError
from mcore_rl.hf import ChatTokenizer, PromptTokenizer, copy_tokenizer_files
from mcore_rl.inference_policy import InferencePolicy
from mcore_rl.logprobs import row_logprobs
from mcore_rl.loss import grpo_loss, grpo_loss_metric_names
from mcore_rl.memory import allocated_bytes, live_tensor_bytes
from mcore_rl.moe_config import moe_config_for
from mcore_rl.packing import PackingContext, distribute_bins, pack_sequences
from mcore_rl.policy import (
    PolicyChunks,
    allreduce_shared_embedding_grads,
    build_policy_chunks,
    load_policy_chunks,
)
from mcore_rl.prompt_data import PromptDataset, load_prompt_dataset
from mcore_rl.reference import ReferenceWeights
from mcore_rl.rewards import RewardScorer
from mcore_rl.rollout import Rollout, evaluate_greedy, generate_rollouts
from mcore_rl.router_loss import RouterLoss
from mcore_rl.seeding import derive_seed
from mcore_rl.shared_prompts import build_shared_prompt_rows
from mcore_rl.tasks import DatasetTask, Problem, Task, get_task, sample_problems
from mcore_rl.tokenizer import CharTokenizer

__all__ = ["GRPOWorker", "Minibatch", "build_task", "derive_seed"]

PhaseCallback = Callable[[str], None]
"""Called with the name of each phase as it starts (drives progress bars)."""


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


def _model_config(config: GRPOConfig, vocab_size: int) -> GPTConfig:
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


def _context_length(directory: str) -> int:
    # max_position_embeddings of a checkpoint's config.json (GPTConfig's default without it).
    file = Path(directory) / "config.json"
    values = json.loads(file.read_text()) if file.is_file() else {}
    found = values.get("max_position_embeddings")
    return int(found) if isinstance(found, int) else GPTConfig().max_position_embeddings


@dataclass(kw_only=True, slots=True)
class Minibatch:
    """The rollouts of one optimizer step, packed into this rank's bins."""

    context: PackingContext
    """Packed token ids, positions, loss mask and advantages of this rank's bins (under context
    parallelism, this rank's tokens of them)."""
    inference_logprobs: torch.Tensor
    """Log-probs the inference engine sampled with, scattered (and split) like the tokens."""
    num_global_tokens: float
    """Completion tokens of the minibatch over every rank (the loss normaliser)."""
    old_logprobs: torch.Tensor | None = None
    """Log-probs of the policy before the step (set by the old-logprob pass)."""
    old_from_training_forward: bool = False
    """The weights have not changed since generation (the step's first minibatch): the old
    log-probs are the training forward's own, detached, and no separate pass runs."""
    ref_logprobs: torch.Tensor | None = None
    """Log-probs of the reference weights (set when ``loss.kl_beta > 0``)."""


class GRPOWorker:
    """One rank of a GRPO run: the policy at both layouts, its optimizer, the reference weights.

    The policy trains at ``train_parallel`` (tensor, pipeline with virtual stages, context,
    expert and data parallel; ``state`` is that layout) and generates at ``infer_parallel`` on
    the same ranks; see :class:`~mcore_rl.inference_policy.InferencePolicy`.

    Args:
        config: The run config.
        state: This rank's parallel state at the training layout.

    Raises:
        RLConfigError: If the config is invalid.
    """

    def __init__(self, config: GRPOConfig, state: ParallelState) -> None:
        self.config = config
        self.state = state
        self.device = torch.device(state.device)
        if self.device.type == "cpu" and config.run.cpu_threads is not None:
            torch.set_num_threads(config.run.cpu_threads)
        self.task = build_task(config)
        torch.manual_seed(config.run.seed)
        self.tokenizer: PromptTokenizer
        self.hf_path = config.model.hf_path
        self.dataset: PromptDataset | None = None
        layout = config.train_parallel
        # The prompts load (and fail on a bad dataset) before the weights do.
        if self.hf_path is not None:
            if not Path(self.hf_path).is_dir():
                raise RLConfigError(
                    f"model.hf_path={self.hf_path!r} is not a directory (expected a Hugging "
                    "Face checkpoint with config.json, safetensors and tokenizer.json)"
                )
            self.tokenizer = ChatTokenizer(
                HFTokenizer(self.hf_path),
                system_prompt=config.data.system_prompt,
                chat_template=config.data.chat_template,
            )
            context_length = _context_length(self.hf_path)
            self.eval_problems = self._load_prompts(context_length)
            chunks = load_policy_chunks(
                self.hf_path,
                state,
                dtype=config.model.dtype,
                virtual_stages=layout.vp,
                sequence_parallel=layout.sequence_parallel,
                device=self.device,
                batch_invariant=config.model.batch_invariant,
                context_parallel_method=layout.cp_method,
            )
        else:
            self.tokenizer = CharTokenizer(self.task.alphabet)
            vocab_size = max(config.model.vocab_size or 0, self.tokenizer.vocab_size)
            shape = _model_config(config, vocab_size)
            context_length = shape.max_position_embeddings
            self.eval_problems = self._load_prompts(context_length)
            chunks = build_policy_chunks(
                shape,
                state,
                virtual_stages=layout.vp,
                sequence_parallel=layout.sequence_parallel,
                device=self.device,
                context_parallel_method=layout.cp_method,
            )
        self.chunks = chunks
        self.router_loss = RouterLoss(chunks, config.model.moe, tp_rank=state.rank_in("tp"))
        ddp_config = DDPConfig(
            use_distributed_optimizer=True,
            overlap_param_gather=True,
            # The GRPO loss of a row is already its share of the global token mean.
            average_over_data_parallel=False,
        )
        self.model = DistributedDataParallel(PolicyChunks(chunks), ddp_config, state)
        self.optimizer = DistributedOptimizer(self.model, config.optimizer)
        self.reference = ReferenceWeights(
            self.model, optimizer=self.optimizer, on_device=config.loss.reference_on_device
        )
        self.loss_config = config.loss
        self.dp_size = state.size("dp")
        self.dp_rank = state.rank_in("dp")
        self.cp_size = state.size("cp")
        self.cp_rank = state.rank_in("cp")
        self.inference = InferencePolicy(
            chunks,
            state,
            layout,
            config.infer_parallel,
            self._engine_config(context_length),
            keep_engine=config.rollout.keep_engine,
        )
        self.track_live_tensors = False
        """Count live tensors at every step start (slow; used by tests on the CPU)."""

    def _engine_config(self, context_length: int) -> InferenceConfig:
        # The long-lived engine: every rollout of a step fits one batch (up to
        # parallel_generation_tasks), contexts up to the prompt budget.
        rollout = self.config.rollout
        world = dist.get_world_size()
        replicas = self.config.infer_parallel.data_parallel_size(world)
        per_replica = -(-rollout.num_prompts // replicas) * rollout.group_size
        batch = max(1, min(rollout.parallel_generation_tasks, per_replica))
        # On a GPU a step takes up to 16384 tokens: the prompts of a large rollout batch are in
        # after a few prefill steps (2048 admits 8 prompts of 256 tokens a step), so fewer
        # mixed prefill/decode steps run without CUDA graphs (2.76 -> 2.60 s for the 1B
        # benchmark's 512 x 256 new tokens on an H100). The CPU keeps the small budget.
        budget = 16384 if self.device.type == "cuda" else 2048
        return InferenceConfig(
            max_batch_size=batch,
            max_sequence_length=context_length,
            block_size=16,
            attention_split_size=256,
            max_tokens_per_step=max(budget, batch),
            use_cuda_graphs=rollout.use_cuda_graphs,
            seed=self.config.run.seed,
            share_prompt_prefixes=rollout.share_prompt_prefixes,
        )

    def _load_prompts(self, context_length: int) -> list[Problem]:
        cfg = self.config
        budget = context_length - cfg.rollout.max_new_tokens
        if cfg.data.max_prompt_tokens is not None:
            budget = min(budget, cfg.data.max_prompt_tokens)
        if cfg.data.path is not None:
            self.dataset = load_prompt_dataset(
                cfg.data,
                seed=cfg.run.seed,
                fits=lambda prompt: len(self.tokenizer.encode_prompt(prompt)) <= budget,
                eval_limit=cfg.eval.num_prompts,
            )
            return self.dataset.eval
        # Procedural tasks: a fixed set drawn with its own seed stands in for a held-out split.
        return sample_problems(self.task, cfg.eval.num_prompts, derive_seed(cfg.run.seed, "eval"))

    def problems_for_step(self, step: int) -> list[Problem]:
        """The prompts of a step, identical on every rank (they depend on the seed and step).

        Args:
            step: Step number.

        Returns:
            ``rollout.num_prompts`` problems.
        """
        count = self.config.rollout.num_prompts
        if self.dataset is not None:
            return self.dataset.problems_for_step(step, count)
        return sample_problems(self.task, count, derive_seed(self.config.run.seed, step, "prompts"))

    @property
    def max_steps(self) -> int | None:
        """Steps until a dataset's epochs are used up; None when unbounded.

        Returns:
            The step count or None.
        """
        if self.dataset is None:
            return None
        return self.dataset.max_steps(self.config.rollout.num_prompts)

    def _over_world(self, values: list[float], op: Any = dist.ReduceOp.SUM) -> list[float]:
        if dist.get_world_size() == 1:
            return values
        total = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(total, op=op)
        return [float(v) for v in total.tolist()]

    def _reward_failures(self) -> int:
        return self.task.scorer.failures if isinstance(self.task, DatasetTask) else 0

    def evaluate(self) -> dict[str, float]:
        """Greedy pass@1 and mean reward on the held-out prompts (collective).

        Returns:
            ``eval/pass@1``, ``eval/reward`` and ``eval/prompts``; empty without held-out
            prompts.
        """
        if not self.eval_problems:
            return {}
        with self.generation_mode():
            return evaluate_greedy(
                self.inference.model,
                self.eval_problems,
                task=self.task,
                tokenizer=self.tokenizer,
                max_new_tokens=self.config.rollout.max_new_tokens,
                use_cuda_graphs=self.config.rollout.use_cuda_graphs,
                dp_group=self.inference.dp_group,
                engine=self._engine_for(self.eval_problems),
                state=self.inference.state,
            )

    def _engine_for(self, problems: list[Problem]) -> InferenceEngine | None:
        # The long-lived engine, long enough for these prompts plus the new tokens (the same
        # problems on every rank, so a collective rebuild happens on all of them).
        longest = max((len(self.tokenizer.encode_prompt(p.prompt)) for p in problems), default=1)
        return self.inference.engine_for(longest + self.config.rollout.max_new_tokens)

    def export_hf(self, directory: str | Path) -> Path:
        """Writes the policy as a Hugging Face checkpoint (collective).

        ``config.json`` and the safetensors shards come from ``mcore_models``' sharded export
        (every pipeline stage writes its shard files; tensor-parallel blocks are gathered one
        tensor at a time); the tokenizer and generation files of ``model.hf_path`` are copied
        next to them, so transformers' ``from_pretrained`` and ``mcore-inference generate``
        load the directory as it is.

        Args:
            directory: Output directory.

        Returns:
            The directory.
        """
        directory = Path(directory)
        self.optimizer.start_param_sync(force_sync=True)
        with self.optimizer.param_sync_hooks_disabled():
            chunks: Any = self.chunks if len(self.chunks) > 1 else self.chunks[0]
            save_hf(chunks, directory, state=self.state)
        if self.hf_path is not None and dist.get_rank() == 0:
            copy_tokenizer_files(self.hf_path, directory)
        if dist.get_world_size() > 1:
            dist.barrier()
        return directory

    def close(self) -> None:
        """Closes the inference engine and stops the reward process pool, if any."""
        self.inference.close()
        self.router_loss.close()
        if isinstance(self.task, DatasetTask):
            self.task.scorer.close()

    # ------------------------------------------------------------------ one step

    def step(self, step: int, on_phase: PhaseCallback | None = None) -> dict[str, float]:
        """Runs one GRPO step, top to bottom.

        generate (at the generation layout) -> rewards -> advantages -> packing -> old and
        reference log-probs (forward-only pipeline schedule) -> per minibatch: loss and
        backward over the packed rows, optimizer step -> weight push to the generation layout.

        Args:
            step: The step number (0-based); prompts and sampling derive from it.
            on_phase: Called with each phase's name as it starts.

        Returns:
            The step's metrics (identical on every rank).
        """
        phase = on_phase or (lambda name: None)
        times: dict[str, float] = {}
        metrics: dict[str, float] = {"step": float(step)}
        metrics["memory/allocated_bytes"] = float(allocated_bytes(self.device))
        if self.track_live_tensors:
            count, nbytes = live_tensor_bytes()
            metrics["memory/live_tensors"], metrics["memory/live_tensor_bytes"] = count, nbytes

        phase("generate")
        start = time.perf_counter()
        failures = self._reward_failures()
        rollouts = self.generate(step)
        times["generate"] = time.perf_counter() - start
        if isinstance(self.task, DatasetTask):
            # Every rank scored its own share of the completions: the sum is the step's count.
            new_failures = float(self._reward_failures() - failures)
            metrics["reward/failures"] = self._over_world([new_failures])[0]
            if step == 0 and self.dataset is not None:
                metrics["data/skipped_prompts"] = float(self.dataset.skipped)

        metrics.update(self.train_on_rollouts(rollouts, times, phase))

        phase("push")
        with self.generation_mode():
            pushed = self.inference.push()
        times["push"] = pushed.seconds
        moved = [float(pushed.bytes_sent), float(pushed.bytes_local)]
        metrics["reshard/bytes_sent"], metrics["reshard/bytes_local"] = self._over_world(moved)
        metrics["reshard/seconds_max"] = self._over_world([pushed.seconds], dist.ReduceOp.MAX)[0]
        for name, seconds in times.items():
            metrics[f"time/{name}"] = seconds
        return metrics

    def generate(self, step: int) -> list[Rollout]:
        """Samples and scores the step's rollouts at the generation layout (collective).

        Args:
            step: The step number.

        Returns:
            Every rollout of the step, grouped by prompt, identical on every rank.
        """
        cfg = self.config
        rollout = cfg.rollout
        problems = self.problems_for_step(step)
        with self.generation_mode():
            return generate_rollouts(
                self.inference.model,
                problems,
                task=self.task,
                tokenizer=self.tokenizer,
                group_size=rollout.group_size,
                max_new_tokens=rollout.max_new_tokens,
                temperature=rollout.temperature,
                seed=derive_seed(cfg.run.seed, step, "sampling"),
                parallel_generation_tasks=rollout.parallel_generation_tasks,
                use_cuda_graphs=rollout.use_cuda_graphs,
                dp_group=self.inference.dp_group,
                require_stop=rollout.reward_requires_stop,
                engine=self._engine_for(problems),
                state=self.inference.state,
            )

    def train_on_rollouts(
        self,
        rollouts: list[Rollout],
        times: dict[str, float] | None = None,
        on_phase: PhaseCallback | None = None,
        *,
        recompute_old_logprobs: bool = False,
    ) -> dict[str, float]:
        """Trains on gathered rollouts: advantages, packing, log-probs, optimizer steps.

        The first minibatch trains on the weights that generated the rollouts, so its old
        log-probs are the training forward's own (detached): the ratio is exactly 1 there and
        the separate forward-only pass is skipped. Later minibatches (``minibatches_per_step >
        1``) get theirs from that pass before the first optimizer step.

        Args:
            rollouts: The rollouts of every rank, ``group_size`` per prompt, identical on
                every rank.
            times: Filled with the seconds of each phase.
            on_phase: Called with each phase's name as it starts.
            recompute_old_logprobs: Run the forward-only pass for every minibatch, the first
                included (slower; the result is the same up to rounding).

        Returns:
            Reward, loss, KL, entropy, mismatch and packing metrics (identical on every rank).
        """
        cfg = self.config
        phase = on_phase or (lambda name: None)
        times = {} if times is None else times
        metrics: dict[str, float] = {}
        rewards = torch.tensor([r.reward for r in rollouts])
        advantages = compute_advantages(
            rewards, cfg.rollout.group_size, cfg.rollout.advantage_estimator
        )
        metrics.update(_rollout_metrics(rollouts, rewards))

        phase("logprobs")
        start = time.perf_counter()
        minibatches = self._pack(rollouts, advantages, metrics)
        for index, minibatch in enumerate(minibatches):
            if index == 0 and not recompute_old_logprobs:
                minibatch.old_from_training_forward = True
            else:
                minibatch.old_logprobs = self._forward_logprobs(minibatch.context)
        times["logprobs"] = time.perf_counter() - start
        if cfg.loss.kl_beta > 0.0:
            phase("reference")
            start = time.perf_counter()
            with self.reference.use_reference_weights():
                for minibatch in minibatches:
                    minibatch.ref_logprobs = self._forward_logprobs(minibatch.context)
            times["reference"] = time.perf_counter() - start

        phase("train")
        start = time.perf_counter()
        sums: dict[str, torch.Tensor] = {}
        grad_norms = []
        for minibatch in minibatches:
            grad_norms.append(self._train_minibatch(minibatch, sums))
        times["train"] = time.perf_counter() - start
        metrics.update(self._reduce_sums(sums, len(minibatches)))
        metrics.update(self.router_loss.take_metrics(self._over_world, len(minibatches)))
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
            if self.config.rollout.offload_optimizer:
                stack.enter_context(self.optimizer.offloaded(optimizer_state=True, grads=True))
            yield

    def _bin_multiple(self) -> int:
        # The interleaved schedule runs a multiple of pp microbatches on every rank.
        layout = self.config.train_parallel
        return layout.pp if layout.vp > 1 else 1

    def _pack(
        self, rollouts: list[Rollout], advantages: torch.Tensor, metrics: dict[str, float]
    ) -> list[Minibatch]:
        group_size = self.config.rollout.group_size
        packing = self.config.packing
        layout = self.config.train_parallel
        groups = len(rollouts) // group_size
        per_minibatch = -(-groups // packing.minibatches_per_step)
        minibatches: list[Minibatch] = []
        efficiencies: list[float] = []
        # Sequence parallelism splits every row over the tensor-parallel ranks, context
        # parallelism every sequence into 2 cp chunks.
        pad_multiple, slot_multiple = packing_multiples(layout)
        for first in range(0, groups, per_minibatch):
            last = min(groups, first + per_minibatch)
            chosen = list(range(first * group_size, last * group_size))
            sequences = [rollouts[i].prompt_ids + rollouts[i].completion_ids for i in chosen]
            if packing.share_prompts:  # cp is 1 (checked by the config)
                context, logprobs, efficiency = build_shared_prompt_rows(
                    sequences,
                    [len(rollouts[i].prompt_ids) for i in chosen],
                    advantages[chosen].tolist(),
                    [rollouts[i].inference_logprobs for i in chosen],
                    token_budget=packing.max_tokens_per_microbatch,
                    pad_multiple=pad_multiple,
                    max_sequences_per_bin=packing.max_sequences_per_bin,
                    dp_size=self.dp_size,
                    dp_rank=self.dp_rank,
                    bin_multiple=self._bin_multiple(),
                    pad_id=self.tokenizer.pad_id,
                )
                efficiencies.append(efficiency)
                tokens = float(sum(len(rollouts[i].completion_ids) for i in chosen))
                minibatches.append(
                    Minibatch(
                        context=context, inference_logprobs=logprobs, num_global_tokens=tokens
                    )
                )
                continue
            info = pack_sequences(
                [len(s) for s in sequences],
                max_sequences_per_bin=packing.max_sequences_per_bin,
                algorithm=packing.algorithm,
                token_budget=packing.max_tokens_per_microbatch,
                pad_multiple=pad_multiple,
                slot_multiple=slot_multiple,
            )
            efficiencies.append(info.efficiency)
            mine = distribute_bins(info, self.dp_size)[self.dp_rank]
            multiple = self._bin_multiple()
            mine = mine + [-1] * (-len(mine) % multiple)
            context = PackingContext.build(
                sequences,
                [len(rollouts[i].prompt_ids) for i in chosen],
                advantages[chosen],
                info,
                bin_indices=mine,
                max_sequences_per_bin=packing.max_sequences_per_bin,
                pad_id=self.tokenizer.pad_id,
            )
            inference_logprobs = context.scatter([rollouts[i].inference_logprobs for i in chosen])
            if self.cp_size > 1:
                # This rank's tokens of every row; the token count stays the global one.
                inference_logprobs = split_packed_rows(
                    inference_logprobs, context.cu_seqlens, self.cp_size, self.cp_rank
                )
                context = split_packing_context(context, self.cp_size, self.cp_rank)
            minibatches.append(
                Minibatch(
                    context=context,
                    inference_logprobs=inference_logprobs,
                    num_global_tokens=float(sum(len(rollouts[i].completion_ids) for i in chosen)),
                )
            )
        metrics["packing/efficiency"] = float(sum(efficiencies) / len(efficiencies))
        metrics["packing/bins_per_rank"] = float(minibatches[0].context.input_ids.shape[0])
        return minibatches

    def _schedule_model(self) -> Any:
        return self.chunks if len(self.chunks) > 1 else self.chunks[0]

    def _tensor_shape(self, context: PackingContext) -> tuple[int, ...] | None:
        layout = self.config.train_parallel
        if layout.pp == 1:
            return None
        tokens = int(context.input_ids.shape[1])
        if layout.sequence_parallel:
            tokens //= layout.tp
        return (1, tokens, self.chunks[0].config.hidden_size)

    def _forward_logprobs(self, context: PackingContext) -> torch.Tensor | None:
        # The forward-only schedule (loss_func=None) collects one output per row on the last
        # stage: log-probs and entropies stacked as [2, bin_size].
        result = forward_backward(
            self._schedule_model(),
            list(range(context.input_ids.shape[0])),
            state=self.state,
            forward_step=self._forward_step(context),
            loss_func=None,
            forward_only=True,
            tensor_shape=self._tensor_shape(context),
            dtype=_activation_dtype(self.chunks[0]),
        )
        if not result.outputs:
            return None
        return torch.stack([output[0].float() for output in result.outputs])

    def _forward_step(self, context: PackingContext) -> Callable[..., Any]:
        temperature = self.config.rollout.temperature
        tp_group = self.state.group("tp") if self.state.size("tp") > 1 else None

        def forward_step(model: Any, input_tensor: Any, row: int) -> Any:
            return row_logprobs(
                model,
                context,
                row,
                temperature=temperature,
                device=self.device,
                input_tensor=input_tensor,
                tp_group=tp_group,
                loss_positions_only=True,
            )

        return forward_step

    def _train_minibatch(self, minibatch: Minibatch, sums: dict[str, torch.Tensor]) -> float:
        context = minibatch.context
        rows = int(context.input_ids.shape[0])
        old, ref = minibatch.old_logprobs, minibatch.ref_logprobs
        last_stage = self.state.is_last_stage
        reuse = minibatch.old_from_training_forward
        if last_stage and old is None and not reuse:
            raise RLStateError("the old log-probs of a minibatch must be computed before training")
        counts = self.state.rank_in("tp") == 0 and last_stage

        def loss_func(output: torch.Tensor, row: int) -> torch.Tensor:
            logprobs, entropy = output[0], output[1]
            if reuse:
                old_row = logprobs.detach()
            else:
                assert old is not None
                old_row = self._row(row, old)
            loss, metrics = grpo_loss(
                logprobs,
                old_row,
                self._row(row, context.advantages),
                self._row(row, context.loss_mask),
                num_global_tokens=minibatch.num_global_tokens,
                config=self.loss_config,
                ref_logprobs=self._row(row, ref) if ref is not None else None,
                inference_logprobs=self._row(row, minibatch.inference_logprobs),
                entropy=entropy,
            )
            metrics["loss"] = loss
            if counts:
                for name, value in metrics.items():
                    total = sums.get(name, torch.zeros((), device=self.device))
                    sums[name] = total + value.detach()
            # Each row's loss is its share of the minibatch's token mean over every rank:
            # rows and data-parallel ranks are summed (average_microbatches=False, DDP with
            # average_over_data_parallel=False), never averaged and undone.
            return loss

        self.model.zero_grad_buffer()
        forward_backward(
            self._schedule_model(),
            list(range(rows)),
            state=self.state,
            forward_step=self.router_loss.weighted_rows(
                self._forward_step(context), context, minibatch.num_global_tokens
            ),
            loss_func=loss_func,
            no_sync=self.model.no_sync,
            tensor_shape=self._tensor_shape(context),
            dtype=_activation_dtype(self.chunks[0]),
            average_microbatches=False,
        )
        allreduce_shared_embedding_grads(self.chunks, self.state)
        return self.optimizer.step()

    def _row(self, row: int, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[row].to(self.device, non_blocking=True)

    def _reduce_sums(self, sums: dict[str, torch.Tensor], minibatches: int) -> dict[str, float]:
        # Every rank reduces the same names (those of grpo_loss); ranks that hold no loss
        # contribute zeros.
        expected = grpo_loss_metric_names(
            self.loss_config, reference=self.loss_config.kl_beta > 0.0, inference=True, entropy=True
        )
        names = sorted(expected | set(sums))
        values = [float(sums[n]) if n in sums else 0.0 for n in names]
        totals = self._over_world(values)
        # Every minibatch normalises by its own token count: average the minibatch means.
        return {n: v / minibatches for n, v in zip(names, totals)}

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_state(self, step: int) -> dict[str, Any]:
        policy = self.model.module
        assert isinstance(policy, PolicyChunks)
        model = policy.sharded_model_state(self.state)
        reference = self.reference.state_dict()
        return {
            "model": model,
            "optimizer": self.optimizer,
            "reference": {
                name: ShardedTensor(
                    reference[name], block.global_shape, block.global_offset, block.replica_id
                )
                for name, block in model.items()
            },
            "step": step,
        }

    def save_checkpoint(self, root: str | Path, step: int) -> None:
        """Saves model, optimizer and reference weights as checkpoint ``step`` under ``root``.

        Parameters are synchronised first (no all-gather in flight while saving). Tensors are
        saved as blocks of the whole model, so the checkpoint records the layout it came from.

        Args:
            root: The checkpoint root (``<run_dir>/checkpoints``).
            step: Number of completed steps.
        """
        self.optimizer.start_param_sync(force_sync=True)
        save(root, self._checkpoint_state(step), state=self.state, step=step)

    def load_checkpoint(self, root: str | Path) -> int:
        """Loads the latest checkpoint under ``root`` and pushes the weights to generation.

        Args:
            root: The checkpoint root.

        Returns:
            Number of completed steps it holds.
        """
        self.optimizer.start_param_sync(force_sync=True)
        state = self._checkpoint_state(0)
        reference = {
            name: ShardedTensor(
                block.local.clone(), block.global_shape, block.global_offset, block.replica_id
            )
            for name, block in state["reference"].items()
        }
        state["reference"] = reference
        with self.optimizer.param_sync_hooks_disabled():
            load(root, state, state=self.state)
        self.reference.load_state_dict({n: b.local for n, b in reference.items()})
        with self.generation_mode():
            self.inference.push()
        return int(state["step"])


def _activation_dtype(chunk: GPTModel) -> torch.dtype:
    return next(chunk.parameters()).dtype


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
