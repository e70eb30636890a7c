"""MoELayer: router, routed experts, optional shared expert, in place of a dense MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mcore_models.errors import ModelConfigError, ModelInputError
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.mlp import SwiGLUMLP
from mcore_models.moe.config import MoEConfig, expert_capacity
from mcore_models.moe.dispatcher import dispatch_and_combine
from mcore_models.moe.experts import GroupedExperts
from mcore_models.moe.router import TopKRouter
from mcore_parallel.sharding import set_partition_dim

if TYPE_CHECKING:
    import torch.distributed as dist

    from mcore_parallel.state import ParallelState

__all__ = ["MoELayer"]


class MoELayer(nn.Module):
    """Mixture-of-experts MLP: ``sum_k w_k * expert_k(x) [+ gate(x) * shared(x)]``.

    Built whole (every expert) from the config; :meth:`parallelize` keeps this rank's experts
    when the parallel state has expert parallelism. The decoder layer calls it like a dense
    MLP on ``[..., hidden]``.

    Args:
        config: Model config; ``config.moe`` must be set.
        layer_idx: Index of the decoder layer (0-based).

    Raises:
        ModelConfigError: If ``config.moe`` is None.
    """

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        if config.moe is None:
            raise ModelConfigError("config.moe=None: a MoELayer needs a MoEConfig")
        moe: MoEConfig = config.moe
        self.config = config
        self.moe_config = moe
        self.layer_idx = layer_idx
        ffn = moe.expert_ffn_hidden_size or config.ffn_hidden_size
        self.router = TopKRouter(config.hidden_size, moe, config.dtype)
        self.experts = GroupedExperts(
            moe.num_experts, config.hidden_size, ffn, config.dtype, grouped_gemm=moe.grouped_gemm
        )
        self.shared_expert: SwiGLUMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_ffn_hidden_size > 0:
            self.shared_expert = SwiGLUMLP(
                config.replace(ffn_hidden_size=moe.shared_expert_ffn_hidden_size)
            )
            if moe.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(
                    config.hidden_size, 1, bias=False, dtype=config.dtype
                )
        self.ep_group: dist.ProcessGroup | None = None
        """Expert-parallel group once parallelized with ``ep_size > 1``, else None."""
        self.decode_padding = False
        """Whether decode expert padding is on (see ``set_decode_expert_padding``)."""
        self.decode_capacity_factor = moe.default_decode_capacity_factor
        """Capacity factor used while ``decode_padding`` is on."""
        self.tokens_per_expert: torch.Tensor | None = None
        """``[num_experts]`` assignments per expert of this rank's tokens in the last forward
        pass (variable-size routing metadata; cleared when the padding mode switches)."""

    @property
    def capacity_factor(self) -> float | None:
        """Capacity factor in effect: the decode one while padding is on, else the config's."""
        if self.decode_padding:
            return self.decode_capacity_factor
        return self.moe_config.capacity_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route, dispatch, run the experts and combine.

        Args:
            x: ``[..., hidden]`` normalised hidden states.

        Returns:
            ``[..., hidden]`` output.

        Raises:
            ModelInputError: If the last dimension is not the hidden size.
        """
        if x.shape[-1] != self.config.hidden_size:
            raise ModelInputError(
                f"x.shape={tuple(x.shape)}: the last dimension must be hidden_size="
                f"{self.config.hidden_size}"
            )
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.router(tokens)
        factor = self.capacity_factor
        capacity = None
        if factor is not None:
            moe = self.moe_config
            capacity = expert_capacity(tokens.shape[0], moe.top_k, moe.num_experts, factor)
        output, counts = dispatch_and_combine(
            tokens,
            routing.weights,
            routing.experts,
            self.experts,
            num_experts=self.moe_config.num_experts,
            capacity=capacity,
            dispatcher=self.moe_config.dispatcher,
            group=self.ep_group,
        )
        self.tokens_per_expert = counts.detach()
        if self.shared_expert is not None:
            shared = self.shared_expert(tokens)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            output = output + shared
        return output.view(shape)

    @torch.no_grad()
    def update_expert_bias(self, rate: float) -> None:
        """Auxiliary-loss-free balancing step (Wang et al., 2024; DeepSeek-V3).

        Raises the bias of experts that got fewer assignments than the mean in the last
        forward pass and lowers it for the others, by ``rate``. Under expert or data
        parallelism, all-reduce ``tokens_per_expert`` first for a global decision.

        Args:
            rate: Bias update speed (DeepSeek-V3 uses 0.001).

        Raises:
            ModelConfigError: If the router has no expert bias or no forward pass ran yet.
        """
        bias = self.router.expert_bias
        if bias is None or self.tokens_per_expert is None:
            raise ModelConfigError(
                "update_expert_bias needs MoEConfig.router_expert_bias=True and a forward pass"
            )
        counts = self.tokens_per_expert.float()
        bias += rate * torch.sign(counts.mean() - counts)

    def parallelize(self, state: ParallelState) -> None:
        """Keep this rank's experts under expert parallelism (in place).

        Experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)`` stay; their weights are marked
        as partitioned over ``"ep"`` along dimension 0 for sharded checkpoints. Expert weights
        are replicated over the expert-data-parallel group, so their gradients are reduced
        there. Under tensor parallelism the layer computes replicated on every TP rank.

        Args:
            state: Parallel state.

        Raises:
            ModelConfigError: If ``num_experts`` is not divisible by the EP size, the layer is
                already sharded, or sequence parallelism is on (unsupported with MoE).
        """
        if state.tp_size > 1 and self.config.sequence_parallel:
            raise ModelConfigError(
                "sequence_parallel=True is not supported with MoE layers; expected "
                "sequence_parallel=False"
            )
        ep = state.ep_size
        if ep == 1:
            return
        if self.ep_group is not None:
            raise ModelConfigError(f"MoE layer {self.layer_idx} is already expert-parallel")
        total = self.moe_config.num_experts
        if total % ep:
            raise ModelConfigError(
                f"MoEConfig.num_experts={total} must be divisible by the expert-parallel "
                f"size ep={ep}"
            )
        local = total // ep
        first = state.ep_rank * local
        for name in ("gate_proj", "up_proj", "down_proj"):
            whole = getattr(self.experts, name)
            shard = nn.Parameter(whole.detach()[first : first + local].clone())
            set_partition_dim(shard, 0, axis="ep")
            setattr(self.experts, name, shard)
        self.experts.num_experts = local
        self.ep_group = state.ep_group
