"""The policy at its training layout run over packed minibatches: the forward-only pass that
gives old (and reference) log-probs, and the GRPO loss, backward and optimizer step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mcore_models import GPTModel
from mcore_parallel import ParallelState, forward_backward
from mcore_parallel.distributed.ddp import DistributedDataParallel
from mcore_parallel.distributed.optimizer import DistributedOptimizer
from mcore_rl.config import GRPOConfig
from mcore_rl.errors import RLStateError
from mcore_rl.logprobs import row_logprobs
from mcore_rl.loss import grpo_loss
from mcore_rl.minibatch import Minibatch
from mcore_rl.packing import PackingContext
from mcore_rl.policy import allreduce_shared_embedding_grads
from mcore_rl.router_loss import RouterLoss

__all__ = ["MinibatchTrainer"]


class MinibatchTrainer:
    """Runs this rank's policy chunks over packed minibatches through the pipeline schedule.

    Args:
        config: The run config (rollout temperature, loss, training layout).
        state: This rank's parallel state at the training layout.
        chunks: This rank's policy chunks.
        model: The data-parallel wrapper of the chunks.
        optimizer: Its distributed optimizer.
        router_loss: The MoE router loss, which weights each row's forward.
        device: The rank's device.
    """

    def __init__(
        self,
        config: GRPOConfig,
        state: ParallelState,
        chunks: list[GPTModel],
        model: DistributedDataParallel,
        optimizer: DistributedOptimizer,
        router_loss: RouterLoss,
        device: torch.device,
    ) -> None:
        self.config = config
        self.state = state
        self.chunks = chunks
        self.model = model
        self.optimizer = optimizer
        self.router_loss = router_loss
        self.device = device

    def forward_logprobs(self, context: PackingContext) -> torch.Tensor | None:
        """Log-probs of every packed row under the current weights (forward only, collective).

        Args:
            context: The packed rows.

        Returns:
            ``[rows, bin_size]`` log-probs on the last pipeline stage, None on the others.
        """
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
            dtype=self._activation_dtype(),
        )
        if not result.outputs:
            return None
        return torch.stack([output[0].float() for output in result.outputs])

    def train(self, minibatch: Minibatch, sums: dict[str, torch.Tensor]) -> float:
        """One optimizer step on a minibatch: GRPO loss and backward over its rows (collective).

        Args:
            minibatch: The packed rows with their old (and reference) log-probs.
            sums: Running sums of the loss metrics, added to on the ranks that count them
                (tensor-parallel rank 0 of the last pipeline stage).

        Returns:
            The gradient norm of the step.

        Raises:
            RLStateError: If the old log-probs were neither computed nor to be reused.
        """
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
                config=self.config.loss,
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
            dtype=self._activation_dtype(),
            average_microbatches=False,
        )
        allreduce_shared_embedding_grads(self.chunks, self.state)
        return self.optimizer.step()

    def _schedule_model(self) -> Any:
        return self.chunks if len(self.chunks) > 1 else self.chunks[0]

    def _activation_dtype(self) -> torch.dtype:
        return next(self.chunks[0].parameters()).dtype

    def _tensor_shape(self, context: PackingContext) -> tuple[int, ...] | None:
        layout = self.config.train_parallel
        if layout.pp == 1:
            return None
        tokens = int(context.input_ids.shape[1])
        if layout.sequence_parallel:
            tokens //= layout.tp
        return (1, tokens, self.chunks[0].config.hidden_size)

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

    def _row(self, row: int, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[row].to(self.device, non_blocking=True)
