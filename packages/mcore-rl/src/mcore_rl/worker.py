"""The GRPO policy worker: one per rank, the same code in-process, under torchrun or in Ray.

A step is collective over the data-parallel group: generate this rank's share of rollouts,
gather them, compute advantages, pack every sequence and give each rank its bins, compute old
(and reference) log-probs with the training forward, then one or more optimizer steps with the
token-normalised GRPO loss.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_ckpt import load, save
from mcore_inference import HFTokenizer, InferenceEngine
from mcore_models.gpt.hf import save_hf
from mcore_parallel import ParallelState
from mcore_parallel.distributed.config import DDPConfig
from mcore_parallel.distributed.ddp import DistributedDataParallel
from mcore_parallel.distributed.optimizer import DistributedOptimizer
from mcore_parallel.sharding import ShardedTensor
from mcore_rl.advantages import compute_advantages
from mcore_rl.config import GRPOConfig
from mcore_rl.errors import RLConfigError
from mcore_rl.hf import ChatTokenizer, PromptTokenizer, copy_tokenizer_files
from mcore_rl.inference_policy import InferencePolicy
from mcore_rl.loss import grpo_loss_metric_names
from mcore_rl.memory import allocated_bytes, live_tensor_bytes
from mcore_rl.minibatch import Minibatch, pack_minibatches
from mcore_rl.minibatch_training import MinibatchTrainer
from mcore_rl.policy import (
    PolicyChunks,
    build_policy_chunks,
    load_policy_chunks,
)
from mcore_rl.prompt_data import PromptDataset, load_prompt_dataset
from mcore_rl.reference import ReferenceWeights
from mcore_rl.rollout import Rollout, evaluate_greedy, generate_rollouts
from mcore_rl.router_loss import RouterLoss
from mcore_rl.seeding import derive_seed
from mcore_rl.tasks import DatasetTask, Problem, sample_problems
from mcore_rl.tokenizer import CharTokenizer
from mcore_rl.worker_config import (
    build_task,
    checkpoint_context_length,
    engine_config,
    model_config,
)

__all__ = ["GRPOWorker", "Minibatch", "build_task", "derive_seed"]

PhaseCallback = Callable[[str], None]
"""Called with the name of each phase as it starts (drives progress bars)."""


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
            context_length = checkpoint_context_length(self.hf_path)
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
            shape = model_config(config, vocab_size)
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
        self.trainer = MinibatchTrainer(
            config, state, chunks, self.model, self.optimizer, self.router_loss, self.device
        )
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
            engine_config(config, context_length, self.device, dist.get_world_size()),
            keep_engine=config.rollout.keep_engine,
        )
        self.track_live_tensors = False
        """Count live tensors at every step start (slow; used by tests on the CPU)."""

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
        minibatches, packing = pack_minibatches(
            rollouts,
            advantages,
            cfg,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            cp_rank=self.cp_rank,
            cp_size=self.cp_size,
            pad_id=self.tokenizer.pad_id,
        )
        metrics.update(packing)
        for index, minibatch in enumerate(minibatches):
            if index == 0 and not recompute_old_logprobs:
                minibatch.old_from_training_forward = True
            else:
                minibatch.old_logprobs = self.trainer.forward_logprobs(minibatch.context)
        times["logprobs"] = time.perf_counter() - start
        if cfg.loss.kl_beta > 0.0:
            phase("reference")
            start = time.perf_counter()
            with self.reference.use_reference_weights():
                for minibatch in minibatches:
                    minibatch.ref_logprobs = self.trainer.forward_logprobs(minibatch.context)
            times["reference"] = time.perf_counter() - start

        phase("train")
        start = time.perf_counter()
        sums: dict[str, torch.Tensor] = {}
        grad_norms = []
        for minibatch in minibatches:
            grad_norms.append(self.trainer.train(minibatch, sums))
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
