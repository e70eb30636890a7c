"""Torch references of the fused MoE kernels (same signatures as the Triton launchers).

Each function is the definition its kernel is tested against, and the path taken on tensors
the Triton kernels do not handle (CPU tensors without ``TRITON_INTERPRET=1``).

Conventions shared by the kernels: a token ``t`` of ``T`` has ``top_k`` routing assignments,
assignment ``a = t * top_k + j``. ``slots[a]`` is the row of the expert buffer that holds
assignment ``a`` (-1 when the assignment is dropped); ``rows[r]`` is the token copied into
buffer row ``r`` and ``fillers[r]`` the assignment it holds (-1 for an empty padding row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "k_grouped_mm_reference",
    "m_grouped_mm_reference",
    "routed_experts_reference",
    "aligned_rows_reference",
    "capacity_rows_reference",
    "dropless_rows_reference",
    "padded_slots_reference",
    "moe_router_reference",
    "permute_tokens_reference",
    "swiglu_reference",
    "unpermute_combine_reference",
    "unpermute_sum_reference",
    "weighted_swiglu_reference",
]


def moe_router_reference(
    logits: torch.Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    normalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores, top-k choice, routing weights and expert counts of a batch of router logits.

    Args:
        logits: ``[T, E]`` float32 router logits.
        top_k: Experts per token.
        score: "softmax" or "sigmoid".
        expert_bias: ``[E]`` float32 bias added to the scores for the choice only, or None.
        normalize: Rescale each token's ``top_k`` weights to sum to one.
        scaling: Factor applied to the weights last.

    Returns:
        ``(weights [T, top_k] float32, experts [T, top_k] int64 best first, scores [T, E]
        float32, counts [E] int64)``.
    """
    scores = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    choice = scores if expert_bias is None else scores + expert_bias
    experts = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    counts = torch.zeros(logits.shape[-1], dtype=torch.int64, device=logits.device)
    counts.scatter_add_(0, experts.reshape(-1), torch.ones_like(experts.reshape(-1)))
    return weights, experts, scores, counts


def permute_tokens_reference(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Copy tokens into expert-buffer rows: ``out[r] = x[rows[r]]``, zero where ``rows[r] < 0``.

    Args:
        x: ``[T, H]`` tokens.
        rows: ``[R]`` int64 token of each buffer row, or -1.

    Returns:
        ``[R, H]`` buffer in the dtype of ``x``.
    """
    padded = torch.cat([x, x.new_zeros(1, x.shape[-1])])
    return padded.index_select(0, torch.where(rows < 0, x.shape[0], rows))


def unpermute_combine_reference(
    y: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Weighted sum of each token's expert outputs: ``out[t] = sum_j w[t, j] * y[slots[t*k+j]]``.

    Dropped assignments (``slots < 0``) contribute nothing. Accumulates in float32.

    Args:
        y: ``[R, H]`` expert outputs.
        weights: ``[T, top_k]`` routing weights.
        slots: ``[T * top_k]`` int64 buffer row of each assignment, or -1.

    Returns:
        ``[T, H]`` in the dtype of ``y``.
    """
    num_tokens, top_k = weights.shape
    rows = permute_tokens_reference(y, slots).float().view(num_tokens, top_k, y.shape[-1])
    return (rows * weights.float().unsqueeze(-1)).sum(dim=1).to(y.dtype)


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[M, 2F]`` tensor holding gate columns then up columns.

    Args:
        gate_up: ``[M, 2F]`` output of the fused gate/up projection.

    Returns:
        ``[M, F]`` in the dtype of ``gate_up`` (computed in float32).
    """
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def weighted_swiglu_reference(gate_up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``w[m] * silu(gate) * up`` of every row: SwiGLU with each row scaled by its routing weight.

    Args:
        gate_up: ``[M, 2F]`` output of the fused gate/up projection.
        weights: ``[M]`` weight of each row.

    Returns:
        ``[M, F]`` in the dtype of ``gate_up`` (computed in float32).
    """
    gate, up = gate_up.float().chunk(2, dim=-1)
    out = torch.nn.functional.silu(gate) * up * weights.float().unsqueeze(-1)
    return out.to(gate_up.dtype)


def unpermute_sum_reference(y: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """Sum of each token's expert outputs: ``out[t] = sum_j y[slots[t*k+j]]`` (float32 sums).

    Args:
        y: ``[R, H]`` expert outputs (already scaled by their routing weights).
        slots: ``[T * top_k]`` int64 buffer row of each assignment, or -1.
        top_k: Assignments per token.

    Returns:
        ``[T, H]`` in the dtype of ``y``.
    """
    rows = permute_tokens_reference(y, slots).float().view(-1, top_k, y.shape[-1])
    return rows.sum(dim=1).to(y.dtype)


def dropless_rows_reference(
    order: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`dropless_rows`.

    Args:
        order: ``[A]`` int64 stable sort of the assignments by expert.
        counts: ``[E]`` int64 assignments per expert.

    Returns:
        ``(inverse, offsets)`` as :func:`dropless_rows`.
    """
    positions = torch.arange(order.numel(), device=order.device)
    inverse = torch.empty_like(order).scatter_(0, order, positions)
    return inverse, counts.cumsum(0).to(torch.int32)


def capacity_rows_reference(
    experts: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`capacity_rows`.

    Args:
        experts: ``[A]`` int64 expert of each assignment.
        order: ``[A]`` int64 stable sort of the assignments by expert.
        counts: ``[E]`` int64 assignments per expert.
        capacity: Rows each expert keeps at most.

    Returns:
        ``(compact, inverse, kept, offsets)`` as :func:`capacity_rows`.
    """
    total = experts.numel()
    sorted_experts = experts.index_select(0, order)
    starts = counts.cumsum(0) - counts
    position = torch.arange(total, device=experts.device) - starts.index_select(0, sorted_experts)
    kept = counts.clamp(max=capacity)
    kept_starts = kept.cumsum(0) - kept
    rows = torch.where(
        position < capacity, kept_starts.index_select(0, sorted_experts) + position, -1
    )
    inverse = torch.empty_like(order).scatter_(0, order, rows)
    # Dropped assignments all land in one extra trash row, which is cut off.
    compact = torch.full((total + 1,), -1, dtype=torch.int64, device=experts.device)
    compact.scatter_(0, torch.where(rows < 0, total, rows), order)
    return compact[:total], inverse, kept, kept.cumsum(0).to(torch.int32)


def aligned_rows_reference(
    experts: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    align: int,
    capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`aligned_rows`.

    Args:
        experts: ``[A]`` int64 expert of each assignment.
        order: ``[A]`` int64 stable sort of the assignments by expert.
        counts: ``[E]`` int64 assignments per expert.
        align: Row multiple of every expert.
        capacity: Assignments each expert keeps at most (None: all).

    Returns:
        ``(compact, inverse, offsets)`` as :func:`aligned_rows`.
    """
    total, num_experts = experts.numel(), counts.numel()
    kept = counts if capacity is None else counts.clamp(max=capacity)
    padded = (kept + align - 1) // align * align
    sorted_experts = experts.index_select(0, order)
    rank = torch.arange(total, device=experts.device) - (counts.cumsum(0) - counts).index_select(
        0, sorted_experts
    )
    rows = (padded.cumsum(0) - padded).index_select(0, sorted_experts) + rank
    if capacity is not None:
        rows = torch.where(rank < capacity, rows, -1)
    inverse = torch.empty_like(order).scatter_(0, order, rows)
    # Dropped assignments all land in one extra trash row, which is cut off.
    size = total + num_experts * (align - 1)
    compact = torch.full((size + 1,), -1, dtype=torch.int64, device=experts.device)
    compact.scatter_(0, torch.where(rows < 0, size, rows), order)
    return compact[:size], inverse, padded.cumsum(0).to(torch.int32)


def padded_slots_reference(
    keys: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`padded_slots`.

    Args:
        keys: ``[A]`` int64 key of each assignment, in ``[0, K]``.
        order: ``[A]`` int64 stable sort of the assignments by key.
        counts: ``[K + 1]`` int64 assignments per key.
        capacity: Slots per key.

    Returns:
        ``(fillers, kept)`` as :func:`padded_slots`.
    """
    num_slots = (counts.numel() - 1) * capacity
    sorted_keys = keys.index_select(0, order)
    starts = counts.cumsum(0) - counts
    rank = torch.arange(keys.numel(), device=keys.device) - starts.index_select(0, sorted_keys)
    keep = (rank < capacity) & (sorted_keys < counts.numel() - 1)
    slots = torch.where(keep, sorted_keys * capacity + rank, -1)
    kept = torch.empty_like(order).scatter_(0, order, slots)
    # Dropped assignments all land in one extra trash slot, which is cut off.
    fillers = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=keys.device)
    fillers.scatter_(0, torch.where(slots < 0, num_slots, slots), order)
    return fillers[:num_slots], kept


def routed_experts_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Torch reference of :func:`routed_experts`: one SwiGLU MLP per expert over its rows.

    Args:
        x: ``[T, H]`` tokens.
        weights: ``[T, top_k]`` routing weights.
        w_gate_up: ``[E, 2F, H]`` gate rows then up rows of each expert.
        w_down: ``[E, H, F]``.
        order: ``[M]`` int64 assignment in each row (rows sorted by expert; -1 in a row
            without one).
        offsets: ``[E]`` int32 end row of each expert's rows.

    Returns:
        ``[T, H]`` sum of each token's weighted expert outputs (assignments in no row count
        zero), in the dtype of ``x``.
    """
    top_k = weights.shape[1]
    ffn = w_down.shape[-1]
    ends = offsets.tolist()
    outputs = []
    start = 0
    for expert, end in enumerate(ends):
        assignments = order[start:end]
        assignments = assignments[assignments >= 0]
        rows = x.index_select(0, assignments // top_k)
        gate, up = F.linear(rows, w_gate_up[expert]).float().split(ffn, dim=-1)
        scale = weights.reshape(-1).index_select(0, assignments).float().unsqueeze(-1)
        act = (F.silu(gate) * up * scale).to(x.dtype)
        outputs.append(F.linear(act, w_down[expert]))
        start = end
    y = torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[1])
    used = order[:start]
    per_assignment = x.new_zeros(weights.numel(), x.shape[1]).index_copy(0, used[used >= 0], y)
    summed = per_assignment.float().view(-1, top_k, x.shape[1]).sum(dim=1)
    return summed.to(x.dtype)


def m_grouped_mm_reference(
    a: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, transpose_weight: bool
) -> torch.Tensor:
    """Torch reference of :func:`m_grouped_mm` (one expert at a time, float32 accumulation;
    syncs the host; rows past ``offsets[-1]`` are zero).

    Args:
        a: ``[M, K]``.
        weight: ``[E, N, K]`` or ``[E, K, N]``.
        offsets: ``[E]`` end row of each expert.
        transpose_weight: Whether ``weight`` holds ``w[e].T``.

    Returns:
        ``[M, N]`` in the dtype of ``a``.
    """
    n = weight.shape[1] if transpose_weight else weight.shape[2]
    out = torch.zeros(a.shape[0], n, dtype=a.dtype, device=a.device)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        w = weight[expert].float()
        w = w.t() if transpose_weight else w
        out[start:end] = (a[start:end].float() @ w).to(a.dtype)
        start = end
    return out


def k_grouped_mm_reference(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`k_grouped_mm` (float32 accumulation; syncs the host).

    Args:
        g: ``[M, N]``.
        x: ``[M, K]``.
        offsets: ``[E]`` end row of each expert.

    Returns:
        ``[E, N, K]`` in the dtype of ``g``.
    """
    out = []
    start = 0
    for end in offsets.tolist():
        out.append((g[start:end].float().t() @ x[start:end].float()).to(g.dtype))
        start = end
    return torch.stack(out)
