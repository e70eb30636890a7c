"""MoELayer: router, routed experts, optional shared expert, in place of a dense MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mcore_models.errors import ModelConfigError, ModelInputError
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.mlp import SwiGLUMLP
from mcore_models.moe import host_counts
from mcore_models.moe.comm import ExpertComm
from mcore_models.moe.config import MoEConfig, expert_capacity
from mcore_models.moe.dispatcher import dispatch_and_combine
from mcore_models.moe.experts import GroupedExperts
from mcore_models.moe.host_counts import HostCounts
from mcore_models.moe.permute import count, expert_order, padded_capacity
from mcore_models.moe.router import TopKRouter

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["MoELayer"]


class MoELayer(nn.Module):
    """Mixture-of-experts MLP: ``sum_k w_k * expert_k(x) [+ gate(x) * shared(x)]``.

    Built whole (every expert) from the config and plain torch: it holds no process group
    until :func:`mcore_models.moe.parallelize_moe` shards it over expert, expert tensor and
    tensor parallelism. The decoder layer calls it like a dense MLP on ``[..., hidden]``; once
    parallelized with sequence parallelism it takes and returns this rank's sequence chunk
    ``[B, T / tp, hidden]``.

    Args:
        config: Model config; ``config.moe`` must be set.
        layer_idx: Index of the decoder layer (0-based).
        device: Device of the parameters (``"meta"`` to build without memory).

    Raises:
        ModelConfigError: If ``config.moe`` is None.
    """

    def __init__(
        self, config: GPTConfig, layer_idx: int, *, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        if config.moe is None:
            raise ModelConfigError("config.moe=None: a MoELayer needs a MoEConfig")
        moe: MoEConfig = config.moe
        self.config = config
        self.moe_config = moe
        self.layer_idx = layer_idx
        ffn = moe.expert_ffn_hidden_size or config.ffn_hidden_size
        with torch.device(device or torch.get_default_device()):
            self.router = TopKRouter(config.hidden_size, moe, config.dtype)
            self.experts = GroupedExperts(
                moe.num_experts,
                config.hidden_size,
                ffn,
                config.dtype,
                grouped_gemm=moe.grouped_gemm,
                expert_kernel=moe.expert_kernel,
                fused=moe.fused_experts,
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
        self.comm: ExpertComm | None = None
        """Groups of the token dispatch once parallelized (None before)."""
        self.sequence_parallel = False
        """Whether the layer takes and returns sequence chunks (set by ``parallelize_moe``)."""
        self.decode_padding = False
        """Whether decode expert padding is on (see ``set_decode_expert_padding``)."""
        self.decode_capacity_factor = moe.default_decode_capacity_factor
        """Capacity factor used while ``decode_padding`` is on."""
        self.tokens_per_expert: torch.Tensor | None = None
        """``[num_experts]`` assignments per expert of this rank's tokens in the last forward
        pass (variable-size routing metadata; cleared when the padding mode switches)."""

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """Expert-parallel group once parallelized with ``ep_size > 1``, else None."""
        return None if self.comm is None else self.comm.ep_group

    @property
    def etp_group(self) -> dist.ProcessGroup | None:
        """Expert-parallel group once parallelized with ``ep_size > 1``, else None."""
        return None if self.comm is None else self.comm.etp_group

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
        if self.sequence_parallel and x.dim() != 3:
            raise ModelInputError(
                f"x.shape={tuple(x.shape)}: under sequence parallelism the MoE layer expects "
                "this rank's sequence chunk [batch, tokens / tp, hidden]"
            )
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.router(tokens)
        factor = self.capacity_factor
        moe = self.moe_config
        capacity = None
        padded_dropless = False
        order = None
        if factor is not None:
            capacity = expert_capacity(tokens.shape[0], moe.top_k, moe.num_experts, factor)
        elif self._one_rank() and self.experts.pads_dropless(tokens.shape[0] * moe.top_k, tokens):
            # Every expert padded to the largest one for batched GEMMs (one host sync); routing
            # too uneven for that stays on the grouped kernels.
            counts = routing.counts
            if counts is None:
                counts = count(routing.experts.reshape(-1), moe.num_experts)
            largest = None
            if host_counts.EARLY:
                # The counts' copy queued first and the sort after it: the host waits for the
                # largest count while the sort runs, and the dispatch reuses the sort (for the
                # slots, or the rows when the routing is too uneven to pad).
                host = HostCounts(counts)
                if moe.weights_in_experts and self.experts.fuses_routing(tokens):
                    order = expert_order(routing.experts.reshape(-1), moe.num_experts - 1)
                largest = host.largest()
            capacity = padded_capacity(counts, tokens.shape[0] * moe.top_k, largest)
            padded_dropless = capacity is not None
        output, counts = dispatch_and_combine(
            tokens,
            routing.weights,
            routing.experts,
            self.experts,
            num_experts=self.moe_config.num_experts,
            capacity=capacity,
            dispatcher=self.moe_config.dispatcher,
            comm=self.comm,
            counts=routing.counts,
            weights_in_experts=self.moe_config.weights_in_experts,
            padded_dropless=padded_dropless,
            order=order,
        )
        self.tokens_per_expert = counts.detach()
        if self.shared_expert is not None:
            # Under tensor parallelism a column/row-parallel SwiGLU that gathers and
            # reduce-scatters the sequence dimension itself: it takes the unflattened input.
            shared = self.shared_expert(x).reshape(tokens.shape)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            output = output + shared
        return output.view(shape)

    def _one_rank(self) -> bool:
        """Whether this rank holds every expert and routes alone (no EP / ETP groups)."""
        return self.comm is None or (self.comm.ep_group is None and self.comm.etp_group is None)

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
