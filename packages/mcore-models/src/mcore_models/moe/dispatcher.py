"""Token dispatch of a MoE layer: permute tokens to their experts and combine the results.

Two dispatchers move tokens over the expert-parallel (EP) group, after Megatron-Core's
``MoEAllGatherTokenDispatcher`` and ``MoEAlltoAllTokenDispatcher``:

- all-to-all (general): each rank sorts its ``T * top_k`` routing assignments by expert and
  sends every EP rank the tokens of the experts it holds; outputs travel back the same way.
- all-gather (small EP): every rank gathers all tokens and routing decisions of the group,
  runs its own experts on the assignments that chose them, and the partial outputs are
  reduce-scattered back.

Under expert tensor parallelism (ETP) the experts' inputs additionally meet over the ETP group
(see :mod:`mcore_models.moe.comm`): gathered and reduce-scattered when the ETP ranks hold
different tokens, all-reduced when they hold the same ones.

Both run dropless (variable group sizes; the all-to-all exchanges its split sizes on the host)
or drop-and-pad (fixed shapes, as CUDA graphs need; no host sync, except where one rank runs
the packed kept rows on a GEMM plan that reads the kept counts on the host, which
:meth:`~mcore_models.moe.experts.GroupedExperts.plan_for` never picks while a graph is
captured). Drop-and-pad gives every
expert ``capacity`` slots per source rank, ``capacity`` derived from the source rank's own
token count; a source rank's assignments past an expert's capacity are dropped in token
order. The source ranks of an expert are the EP ranks (times the ETP ranks when these hold
different tokens), so with the same weights both dispatchers drop the same assignments, and
an expert-parallel layer drops what one rank running each source rank's tokens separately
drops.

Dropless routing accepts a different number of tokens on every rank, zero included (the
all-gather pads to the group's largest count first). Drop-and-pad routing derives the capacity
from the local token count, so every rank of the EP (and ETP) group must bring the same number
of tokens; the inference engine pads its steps to the group's largest count for that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mcore_kernels.moe import permute_tokens, unpermute_combine, unpermute_sum
from mcore_kernels.moe.expert_gemms import ExpertGemms, without_host_sync
from mcore_kernels.moe.rows import aligned_rows, dropless_rows, padded_slots
from mcore_models.moe import host_counts
from mcore_models.moe.comm import ExpertComm, all_to_all, gather_rows, reduce_scatter_rows
from mcore_models.moe.experts import GroupedExperts
from mcore_models.moe.host_counts import HostCounts
from mcore_models.moe.permute import (
    GatherOrZero,
    PermuteRows,
    capacity_fillers,
    capacity_rows,
    capacity_slots,
    count,
    expert_order,
    inverse_permutation,
    padded_index,
    run_padded,
    sorted_slots,
)
from mcore_parallel.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

__all__ = ["all_to_all", "dispatch_and_combine"]

_NO_COMM = ExpertComm()

PACKED_MIN_CAPACITY = 384
"""Capacity (rows per expert) from which capacity routing on the fused grouped experts packs
the kept assignments for grouped GEMMs (no padding rows computed). Below it, batched GEMMs
over the padded slots run instead: on one H200 at DeepSeek-V3's layer shape with 8192 tokens
(capacity 320 at factor 1.25) they took 37.95 ms per step, against 41.5 ms for the grouped
GEMMs on every assignment (``torch._grouped_mm`` at 444 TFLOP/s there, its 128-row tiles
streaming an expert's weights once per 128 rows); at Qwen3-30B-A3B's shape (capacity 640) the
packed grouped GEMMs took 4.51 ms against 5.30 ms for the batched ones."""


def _host_counts(plan: ExpertGemms, counts: torch.Tensor) -> HostCounts | None:
    """The counts' early copy to the host when ``plan`` loops over experts on packed rows."""
    if not host_counts.EARLY or plan.row_align != 1 or without_host_sync(plan) == plan:
        return None
    return HostCounts(counts)


def _regroup_index(counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Row order turning ``[source, expert]``-major rows into ``[expert, source]``-major rows."""
    # ``counts`` lives on the host; the index is built there in a few vectorised ops.
    flat = counts.flatten()
    starts = (flat.cumsum(0) - flat).view_as(counts)
    block_starts = starts.t().flatten()
    lengths = counts.t().flatten()
    out_starts = lengths.cumsum(0) - lengths
    total = int(lengths.sum())
    shift = torch.repeat_interleave(block_starts - out_starts, lengths, output_size=total)
    return (torch.arange(total) + shift).to(device)


def _run_grouped(
    rows: torch.Tensor,
    matrix: torch.Tensor,
    experts_module: GroupedExperts,
    comm: ExpertComm,
) -> torch.Tensor:
    """Run ``[source, expert]``-major rows (block sizes ``matrix``, on the host) through the
    experts, grouping them by expert first and restoring the order after."""
    if matrix.shape[0] == 1:
        counts = matrix[0].to(rows.device)
        return comm.leave_experts(experts_module(comm.enter_experts(rows), counts))
    regroup = _regroup_index(matrix, rows.device)
    ungroup = inverse_permutation(regroup)
    grouped = comm.enter_experts(PermuteRows.apply(rows, regroup, ungroup))
    outputs = experts_module(grouped, matrix.sum(0).to(rows.device))
    return PermuteRows.apply(comm.leave_experts(outputs), ungroup, regroup)


def _dropless_alltoall(
    permuted: torch.Tensor,
    counts: torch.Tensor,
    experts_module: GroupedExperts,
    comm: ExpertComm,
) -> torch.Tensor:
    """Expert outputs of ``permuted`` (this rank's assignments sorted by global expert,
    ``counts`` per expert), in the same order."""
    if comm.ep_group is None and comm.etp_group is None:
        # One rank holds every expert: counts stay on the device, no host sync.
        return experts_module(permuted, counts)
    local = experts_module.num_experts
    if comm.ep_group is not None:
        group = comm.ep_group
        ep = dist.get_world_size(group)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)
        host = torch.stack([counts, received_counts]).cpu()
        send_splits = host[0].view(ep, local).sum(1).tolist()
        matrix = host[1].view(ep, local)
        receive_splits = matrix.sum(1).tolist()
        rows = all_to_all(permuted, group, receive_splits, send_splits)
    else:
        rows, matrix = permuted, counts.cpu().view(1, local)
    if comm.gathers_over_etp:
        etp_group = comm.etp_group
        assert etp_group is not None
        etp = dist.get_world_size(etp_group)
        every = torch.empty(etp * matrix.numel(), dtype=matrix.dtype, device=counts.device)
        dist.all_gather_into_tensor(every, matrix.flatten().to(counts.device), group=etp_group)
        full = every.cpu().view(etp, *matrix.shape)
        sizes = full.flatten(1).sum(1).tolist()
        outputs = _run_grouped(
            gather_rows(rows, sizes, etp_group), full.flatten(0, 1), experts_module, comm
        )
        outputs = reduce_scatter_rows(outputs, sizes, etp_group)
    else:
        outputs = _run_grouped(rows, matrix, experts_module, comm)
    if comm.ep_group is not None:
        outputs = all_to_all(outputs, comm.ep_group, send_splits, receive_splits)
    return outputs


def _padded_run(
    experts_module: GroupedExperts, capacity: int, comm: ExpertComm, *, exchange: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Runs a slot buffer through the experts.

    With ``exchange`` (all-to-all dispatch) the buffer is ``[E, capacity]`` slots of this
    rank's tokens for every global expert, sent over the EP group and gathered over the ETP
    group; otherwise it already is ``[local, sources * capacity]`` (all-gather dispatch).
    """
    local = experts_module.num_experts

    def run(buffer: torch.Tensor) -> torch.Tensor:
        hidden = buffer.shape[-1]
        if not exchange:
            slots = buffer.view(local, -1, hidden)
            outputs = experts_module.forward_padded(comm.enter_experts(slots))
            return comm.leave_experts(outputs).flatten(0, 1)
        if comm.ep_group is not None:
            buffer = all_to_all(buffer, comm.ep_group)
        buffer = comm.gather_fixed(buffer)
        sources = buffer.shape[0] // (local * capacity)
        grouped = buffer.view(sources, local, capacity, hidden).transpose(0, 1)
        grouped = grouped.reshape(local, sources * capacity, hidden)
        outputs = comm.leave_experts(experts_module.forward_padded(comm.enter_experts(grouped)))
        outputs = outputs.view(local, sources, capacity, hidden).transpose(0, 1)
        outputs = comm.scatter_fixed(outputs.reshape(-1, hidden))
        if comm.ep_group is not None:
            outputs = all_to_all(outputs, comm.ep_group)
        return outputs

    return run


def dispatch_and_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    experts_module: GroupedExperts,
    *,
    num_experts: int,
    capacity: int | None,
    dispatcher: str,
    comm: ExpertComm | None = None,
    counts: torch.Tensor | None = None,
    weights_in_experts: bool = False,
    padded_dropless: bool = False,
    order: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send every token to its experts, run them, and sum their weighted outputs per token.

    Args:
        x: ``[T, hidden]`` this rank's tokens.
        weights: ``[T, top_k]`` routing weights.
        experts: ``[T, top_k]`` chosen (global) expert indices.
        experts_module: This rank's experts (``num_experts / ep`` of them, consecutive).
        num_experts: Total number of experts.
        capacity: Slots per expert and source rank (drop-and-pad), or None (dropless).
        dispatcher: "alltoall" or "allgather".
        comm: Groups of the layer, or None without expert or expert tensor parallelism.
        counts: ``[num_experts]`` int64 assignments per expert if the router counted them.
        weights_in_experts: Dropless on one rank: the experts scale
            their activations by the routing weights and the combine is a plain sum (see
            ``MoEConfig.weights_in_experts``).
        padded_dropless: ``capacity`` holds every expert's assignments (see
            :func:`~mcore_models.moe.permute.padded_capacity`): the slots come from one sort
            and nothing is dropped.
        order: The caller's stable sort of the assignments by expert
            (:func:`~mcore_models.moe.permute.expert_order`), reused by dropless routing (its
            rows, or the slots with ``padded_dropless``); None sorts here.

    Returns:
        ``([T, hidden]`` combined output, ``[num_experts]`` int64 assignments per expert of
        this rank's tokens before any drop).
    """
    comm = comm or _NO_COMM
    top_k = experts.shape[1]
    if dispatcher == "allgather" and (comm.ep_group is not None or comm.gathers_over_etp):
        return _allgather(x, weights, experts, experts_module, num_experts, capacity, comm)
    flat_experts = experts.reshape(-1)
    if counts is None:
        counts = count(flat_experts, num_experts)
    if capacity is None:
        one_rank = comm.ep_group is None and comm.etp_group is None
        if weights_in_experts and one_rank and experts_module.fuses_routing(x):
            # The GEMM plan may ask for every expert's rows padded to a row multiple.
            plan = experts_module.plan_for(flat_experts.numel(), x)
            align = plan.row_align
            host = _host_counts(plan, counts)
            # Assignments in expert order; stable, so each expert sees its tokens in order.
            if order is None:
                order = expert_order(flat_experts, num_experts - 1)
            if align > 1:
                rows, inverse, offsets = aligned_rows(flat_experts, order, counts, align)
            else:
                rows, (inverse, offsets) = order, dropless_rows(order, counts)
            output = experts_module.forward_routed(
                x,
                weights,
                rows,
                inverse,
                counts,
                offsets,
                row_align=align,
                host_ends=None if host is None else host.ends,
            )
            return output, counts
        if order is None:
            order = expert_order(flat_experts, num_experts - 1)
        inverse, offsets = dropless_rows(order, counts)
        if weights_in_experts and one_rank:
            permuted = permute_tokens(x, order // top_k, inverse, top_k)
            # Each row's routing weight, in row order (a gather; its backward gathers back).
            row_weights = PermuteRows.apply(weights.reshape(-1, 1), order, inverse).view(-1)
            outputs = experts_module(permuted, counts, row_weights)
            return unpermute_sum(outputs, inverse, order, top_k), counts
        else:
            permuted = permute_tokens(x, order // top_k, inverse, top_k)
            outputs = _dropless_alltoall(permuted, counts, experts_module, comm)
        return unpermute_combine(outputs, weights, inverse, order), counts
    one_rank = comm.ep_group is None and comm.etp_group is None
    fused = weights_in_experts and one_rank and experts_module.fuses_routing(x)
    packs = capacity >= PACKED_MIN_CAPACITY and experts_module.expert_kernel != "bmm"
    if fused and packs and not padded_dropless:
        # Capacity routing on the fused grouped experts: the kept assignments packed without
        # padding rows, so the GEMMs skip the padding. The plan is the dropless one of the
        # shape (at Mixtral's the cuBLAS loop, which reads the kept counts on the host; never
        # while a CUDA graph is being captured).
        plan = experts_module.plan_for(flat_experts.numel(), x)
        align = plan.row_align
        host = _host_counts(plan, counts)
        if align > 1:
            order = expert_order(flat_experts, num_experts - 1)
            rows, inverse, offsets = aligned_rows(
                flat_experts, order, counts, align, capacity=capacity
            )
            kept = counts.clamp(max=capacity)
        else:
            rows, inverse, kept, offsets = capacity_rows(flat_experts, counts, capacity)
        output = experts_module.forward_routed(
            x,
            weights,
            rows,
            inverse,
            kept,
            offsets,
            row_align=align,
            host_ends=None if host is None else lambda: host.ends(capacity),
        )
        return output, counts
    if fused and padded_dropless:
        # Every expert padded to the largest one, in one fused operation on batched GEMMs: the
        # slots' routing weights are read through their assignments, the combine is a plain
        # sum. (Drop-and-pad's slots run the separate operations below: the fused operation
        # measured no faster there, 39.4-40.7 against 39.1-40.3 ms per step at DeepSeek-V3 8k
        # on one H200.)
        if order is None:
            fillers, kept = capacity_fillers(flat_experts, None, num_experts, capacity)
        else:
            # capacity_fillers' slots from the caller's sort (no key is skipped here).
            fillers, kept = padded_slots(flat_experts, order, F.pad(counts, (0, 1)), capacity)
        output = experts_module.forward_slots(x, weights, fillers, kept, capacity)
        return output, counts
    if weights_in_experts and comm.ep_group is None and comm.etp_group is None:
        # One rank: the slots' routing weights scale the activations inside the experts and
        # the combine is a plain sum (as on the dropless path).
        if padded_dropless:
            fillers, kept = padded_index(
                sorted_slots(flat_experts, counts, capacity), num_experts * capacity
            )
        else:
            fillers, kept = capacity_fillers(flat_experts, None, num_experts, capacity)
        rows = torch.where(fillers < 0, -1, fillers // top_k)
        buffer = permute_tokens(x, rows, kept, top_k).view(num_experts, capacity, -1)
        slot_weights = GatherOrZero.apply(weights.reshape(-1), fillers, kept)
        outputs = experts_module.forward_padded(buffer, slot_weights.view(num_experts, capacity))
        return unpermute_sum(outputs.flatten(0, 1), kept, fillers, top_k), counts
    if padded_dropless:
        slots = sorted_slots(flat_experts, counts, capacity)
    else:
        slots = capacity_slots(flat_experts, None, num_experts, capacity)
    run = _padded_run(experts_module, capacity, comm, exchange=True)
    return run_padded(x, weights, slots, num_experts * capacity, run), counts


def _gather(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    group: dist.ProcessGroup,
    num_experts: int,
    pad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-gather tokens and routing over ``group`` (padded to the largest count if ``pad``).

    Each rank's gradient of the gathered tensors covers its own experts only, so the backward
    pass reduce-scatters.
    """
    if pad:
        x, weights, experts = _pad_to_group_max(x, weights, experts, num_experts, group)
    return (
        gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=True),
        gather_from_sequence_parallel_region(weights, group, tensor_parallel_output_grad=True),
        gather_from_sequence_parallel_region(experts, group),
    )


def _allgather(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    experts_module: GroupedExperts,
    num_experts: int,
    capacity: int | None,
    comm: ExpertComm,
) -> tuple[torch.Tensor, torch.Tensor]:
    counts = count(experts.reshape(-1), num_experts)
    dropless = capacity is None
    sizes = [x.shape[0]]
    if comm.ep_group is not None:
        x, weights, experts = _gather(x, weights, experts, comm.ep_group, num_experts, dropless)
    if comm.gathers_over_etp:
        assert comm.etp_group is not None
        sizes.append(x.shape[0])
        x, weights, experts = _gather(x, weights, experts, comm.etp_group, num_experts, dropless)
    local = experts_module.num_experts
    first = 0 if comm.ep_group is None else dist.get_rank(comm.ep_group) * local
    flat_experts = experts.reshape(-1) - first
    valid = (flat_experts >= 0) & (flat_experts < local)
    flat_experts = torch.where(valid, flat_experts, 0)
    if dropless:
        # Local assignments in expert order (stable: source-major within each expert, as the
        # all-to-all groups them); the others are skipped and read a zero row.
        keys = torch.where(valid, flat_experts, local)
        order = expert_order(keys, local)
        local_counts = count(keys, local + 1)[:local]
        num_kept = int(local_counts.sum())
        position = inverse_permutation(order)
        slots = torch.where(position < num_kept, position, num_kept)

        def run_kept(rows: torch.Tensor) -> torch.Tensor:
            outputs = experts_module(comm.enter_experts(rows), local_counts)
            return comm.leave_experts(outputs)

        combined = run_padded(x, weights, slots, num_kept, run_kept)
    else:
        assert capacity is not None
        sources = comm.sources()
        slots = capacity_slots(flat_experts, valid, local, capacity, sources)
        run = _padded_run(experts_module, capacity, comm, exchange=False)
        combined = run_padded(x, weights, slots, local * sources * capacity, run)
    if comm.gathers_over_etp:
        assert comm.etp_group is not None
        combined = reduce_scatter_to_sequence_parallel_region(combined, comm.etp_group)
        combined = combined[: sizes.pop()]
    if comm.ep_group is not None:
        combined = reduce_scatter_to_sequence_parallel_region(combined, comm.ep_group)
    return combined[: sizes[0]], counts


def _pad_to_group_max(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad this rank's tokens to the most tokens of any rank of ``group`` (the gathers need
    equal sizes).

    Padding rows choose expert ``num_experts``, which no rank holds, so they are never run.
    Dropless routing only: it syncs with the host anyway, drop-and-pad must not (CUDA graphs),
    so there every rank must bring the same number of tokens.
    """
    size = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    sizes = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=x.device)
    dist.all_gather_into_tensor(sizes, size, group=group)
    missing = int(sizes.max()) - x.shape[0]
    if missing == 0:
        return x, weights, experts
    x = torch.cat([x, x.new_zeros(missing, x.shape[1])])
    weights = torch.cat([weights, weights.new_zeros(missing, weights.shape[1])])
    experts = torch.cat([experts, experts.new_full((missing, experts.shape[1]), num_experts)])
    return x, weights, experts
