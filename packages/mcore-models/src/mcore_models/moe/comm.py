"""Process groups of a MoE layer and the differentiable collectives its dispatch uses.

:class:`ExpertComm` names the groups a parallelized MoE layer moves tokens over: the
expert-parallel (EP) group of ranks holding different experts, and the expert tensor-parallel
(ETP) group of ranks holding slices of the same experts' FFNs. How the ETP ranks combine
their partial FFN outputs depends on whether they hold the same tokens:

- ``"allreduce"``: the ETP ranks hold identical tokens (replicated activations under tensor
  parallelism without sequence parallelism, the ETP group inside the TP group). Each computes
  its slice of every expert for all tokens and the partial outputs are all-reduced, as in a
  tensor-parallel MLP.
- ``"gather"``: the ETP ranks hold different tokens (sequence parallelism, or an ETP group
  spanning data-parallel ranks). The expert inputs are all-gathered over the ETP group and the
  partial outputs reduce-scattered back (Megatron-Core's ETP dispatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_models.errors import ModelConfigError
from mcore_parallel.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

__all__ = ["ETP_MODES", "ExpertComm", "all_to_all", "gather_rows", "reduce_scatter_rows"]

ETP_MODES = ("allreduce", "gather")
"""How expert tensor-parallel ranks combine partial outputs (see the module docstring)."""


@dataclass(kw_only=True, slots=True)
class ExpertComm:
    """Groups a parallelized MoE layer dispatches over (set by ``parallelize_moe``)."""

    ep_group: dist.ProcessGroup | None = None
    """Expert-parallel group (ranks holding different experts); None for one rank."""
    etp_group: dist.ProcessGroup | None = None
    """Expert tensor-parallel group (ranks holding FFN slices of the same experts); None for
    one rank."""
    etp_mode: str = "gather"
    """"allreduce" when the ETP ranks hold identical tokens, else "gather"."""

    def __post_init__(self) -> None:
        if self.etp_mode not in ETP_MODES:
            raise ModelConfigError(
                f"ExpertComm.etp_mode={self.etp_mode!r} is unknown; expected one of {ETP_MODES}"
            )

    @property
    def gathers_over_etp(self) -> bool:
        """Whether expert inputs are all-gathered over the ETP group."""
        return self.etp_group is not None and self.etp_mode == "gather"

    @property
    def reduces_over_etp(self) -> bool:
        """Whether partial expert outputs are all-reduced over the ETP group."""
        return self.etp_group is not None and self.etp_mode == "allreduce"

    def sources(self) -> int:
        """Number of source ranks whose tokens meet at one expert.

        Returns:
            The EP size, times the ETP size when the ETP ranks gather their tokens.
        """
        ep = 1 if self.ep_group is None else dist.get_world_size(self.ep_group)
        etp = dist.get_world_size(self.etp_group) if self.gathers_over_etp else 1
        return ep * etp

    def enter_experts(self, rows: torch.Tensor) -> torch.Tensor:
        """Identity forward; sums the input gradient over the ETP group in "allreduce" mode.

        Args:
            rows: Expert inputs.

        Returns:
            The same rows.
        """
        if self.reduces_over_etp:
            return copy_to_tensor_parallel_region(rows, self.etp_group)
        return rows

    def leave_experts(self, rows: torch.Tensor) -> torch.Tensor:
        """Sums partial expert outputs over the ETP group in "allreduce" mode.

        Args:
            rows: This rank's partial expert outputs.

        Returns:
            The summed outputs (the input unchanged in other modes).
        """
        if self.reduces_over_etp:
            return reduce_from_tensor_parallel_region(rows, self.etp_group)
        return rows

    def gather_fixed(self, rows: torch.Tensor) -> torch.Tensor:
        """All-gather equal-size blocks of rows over the ETP group in "gather" mode.

        Args:
            rows: This rank's rows.

        Returns:
            Every ETP rank's rows in rank order; the backward reduce-scatters.
        """
        if not self.gathers_over_etp:
            return rows
        return gather_from_sequence_parallel_region(
            rows, self.etp_group, tensor_parallel_output_grad=True
        )

    def scatter_fixed(self, rows: torch.Tensor) -> torch.Tensor:
        """Reduce-scatter equal-size blocks of partial outputs over the ETP group ("gather").

        Args:
            rows: Partial outputs of every ETP rank's rows.

        Returns:
            This rank's block, summed over the group.
        """
        if not self.gathers_over_etp:
            return rows
        return reduce_scatter_to_sequence_parallel_region(rows, self.etp_group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        output_splits: list[int] | None,
        input_splits: list[int] | None,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        x = x.contiguous()
        rows = x.shape[0] if output_splits is None else sum(output_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = _AllToAll.apply(grad, ctx.input_splits, ctx.output_splits, ctx.group)
        return back, None, None, None


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dimension 0.

    Args:
        x: Rows to send, grouped by destination rank.
        group: Process group.
        output_splits: Rows received from each rank; None splits evenly.
        input_splits: Rows sent to each rank; None splits evenly.

    Returns:
        The received rows, grouped by source rank. The backward pass sends gradients back.
    """
    return _AllToAll.apply(x, output_splits, input_splits, group)


def _send_to_all(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    world = len(sizes)
    out = x.new_empty((sum(sizes), *x.shape[1:]))
    send = x.contiguous().repeat(world, *([1] * (x.dim() - 1)))
    dist.all_to_all_single(out, send, sizes, [x.shape[0]] * world, group=group)
    return out


def _sum_own_blocks(y: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    world, mine = len(sizes), sizes[dist.get_rank(group)]
    received = y.new_empty((world * mine, *y.shape[1:]))
    dist.all_to_all_single(received, y.contiguous(), [mine] * world, sizes, group=group)
    # Summed in rank order in one reduction: deterministic.
    return received.view(world, mine, *y.shape[1:]).sum(dim=0)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _send_to_all(x, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _sum_own_blocks(grad, ctx.sizes, ctx.group), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, sizes: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _sum_own_blocks(y, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _send_to_all(grad, ctx.sizes, ctx.group), None, None


def gather_rows(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather blocks of rows whose sizes differ between ranks (differentiable).

    Args:
        x: This rank's ``sizes[rank]`` rows.
        sizes: Rows of every rank of ``group``.
        group: Process group.

    Returns:
        ``[sum(sizes), ...]`` every rank's rows in rank order. The backward sums each rank's
        gradient of this rank's rows (in rank order, deterministic).
    """
    return _GatherRows.apply(x, sizes, group)


def reduce_scatter_rows(
    y: torch.Tensor, sizes: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Sum partial results of every rank's rows over ``group``; keep this rank's block.

    The inverse of :func:`gather_rows` (its backward gathers).

    Args:
        y: ``[sum(sizes), ...]`` this rank's partial results for every rank's rows.
        sizes: Rows of every rank of ``group``.
        group: Process group.

    Returns:
        ``[sizes[rank], ...]`` this rank's rows summed over the group.
    """
    return _ReduceScatterRows.apply(y, sizes, group)
