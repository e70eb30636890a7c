"""Lock-step engine steps across an expert-parallel (EP) group.

Every MoE layer of an expert-parallel model exchanges tokens with its EP peers (all-to-all or
all-gather), so every rank of the group must run the same number of forwards, and with
drop-and-pad routing (CUDA-graph decode, or a ``capacity_factor``) the same number of tokens.
Each rank serves its own requests, so before each step the ranks agree, in one all-reduce of
four integers over the EP group, on the largest token count of the step and whether every rank
can replay a decode CUDA graph from the same list of graph batch sizes (so all pick the same
bucket). A rank with no work then runs a padding-only forward while a peer still has tokens,
and generation ends on every rank at the first step in which no rank has any.

With expert tensor parallelism the experts' FFNs are also split over an ``etp`` group; the
agreement then runs over the EP group and then over the ETP group, which gives the maximum over
every rank that exchanges tokens with this one (the groups form a grid). A rank's ``has_work``
(requests waiting, running, or pipeline microbatches in flight) travels with the token count,
so pipeline stages keep stepping while a peer replica still has work.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_models.moe import moe_layers

__all__ = [
    "ExpertParallelSync",
    "StepAgreement",
    "find_expert_parallel_group",
    "find_expert_tensor_parallel_group",
]


def find_expert_parallel_group(model: Any) -> dist.ProcessGroup | None:
    """The expert-parallel group of a model's MoE layers, if it has more than one rank.

    Args:
        model: The served model (any module).

    Returns:
        The EP group of the first expert-parallel MoE layer, or None for a dense model, an
        unsharded MoE model or an EP group of one rank.
    """
    for layer in moe_layers(model):
        group = layer.ep_group
        if group is not None and dist.get_world_size(group) > 1:
            return group
    return None


def find_expert_tensor_parallel_group(model: Any) -> dist.ProcessGroup | None:
    """The expert tensor-parallel group of a model's MoE layers, if it has more than one rank.

    Args:
        model: The served model (any module).

    Returns:
        The ``etp_group`` of the first MoE layer that has one of more than one rank, else None.
    """
    for layer in moe_layers(model):
        group = getattr(layer, "etp_group", None)
        if group is not None and dist.get_world_size(group) > 1:
            return group
    return None


@dataclass(frozen=True, slots=True)
class StepAgreement:
    """What the ranks of an EP group agreed on for one step."""

    max_tokens: int
    """Most tokens any rank runs in the step; 0 means no rank has work."""
    use_graphs: bool
    """Whether every rank replays a decode CUDA graph (of the same bucket of ``max_tokens``)."""
    any_has_work: bool = False
    """Whether any rank had tokens or declared work (``has_work``) for this step."""


class ExpertParallelSync:
    """Per-step agreement of an engine with its EP peers.

    Cost: one all-reduce (MAX) of five int64 values over the EP group (and one over the ETP
    group when there is one) per engine step, plus
    reading the result on the host (the engine reads its sampled tokens on the host every step
    anyway). Ranks without work pay a padding-only forward per step while a peer decodes.

    Args:
        model: The served model; its MoE layers give the EP group and their routing mode.
        group: The EP group (from :func:`find_expert_parallel_group`).
        device: Device of the all-reduced tensor (the model's: CUDA under NCCL, CPU under gloo).
        extra_groups: Further groups agreed over after ``group`` (the ETP group).
    """

    def __init__(
        self,
        model: Any,
        group: dist.ProcessGroup,
        device: torch.device,
        extra_groups: tuple[dist.ProcessGroup, ...] = (),
    ) -> None:
        self.group = group
        self.groups = (group, *extra_groups)
        self.size = dist.get_world_size(group)
        self._layers = moe_layers(model)
        self._buffer = torch.zeros(5, dtype=torch.int64, device=device)
        self.group_has_work = False
        """Whether any rank of the group ran tokens in the last agreed step."""

    @property
    def needs_equal_tokens(self) -> bool:
        """Whether drop-and-pad routing is on, so every rank must run the same token count."""
        return any(layer.capacity_factor is not None for layer in self._layers)

    def agree(
        self,
        num_tokens: int,
        graph_batch_sizes: tuple[int, ...] | None,
        *,
        has_work: bool = False,
    ) -> StepAgreement:
        """Exchange this rank's step with its peers (collective over the EP and ETP groups).

        Args:
            num_tokens: Tokens this rank has for the step (0 when idle).
            graph_batch_sizes: The batch sizes of this rank's decode graphs if this rank's
                step could replay one (pure decode or idle), else None.
            has_work: Whether this rank has work beyond this step's tokens (requests waiting
                or running, microbatches in flight).

        Returns:
            The step every rank of the group runs. Graphs are used only when every rank can
            replay one and all have the same batch sizes, so every rank pads to the same
            bucket of ``max_tokens``.
        """
        sizes = graph_batch_sizes or ()
        fingerprint = zlib.crc32(repr(tuple(sizes)).encode())
        # MAX of (tokens, cannot replay, fingerprint, -fingerprint): the largest step, whether
        # any rank needs the eager path, and whether all graph size lists agree.
        values = (
            num_tokens,
            0 if sizes else 1,
            fingerprint,
            -fingerprint,
            int(has_work or num_tokens > 0),
        )
        self._buffer.copy_(torch.tensor(values, dtype=torch.int64))
        for group in self.groups:
            dist.all_reduce(self._buffer, op=dist.ReduceOp.MAX, group=group)
        max_tokens, eager, largest, negative_smallest, any_work = self._buffer.tolist()
        self.group_has_work = bool(any_work)
        same_sizes = largest == -negative_smallest
        use_graphs = not eager and same_sizes and 0 < max_tokens <= max(sizes, default=0)
        return StepAgreement(
            max_tokens=max_tokens, use_graphs=use_graphs, any_has_work=bool(any_work)
        )
