"""The routed experts of a MoE layer: SwiGLU MLPs stored as stacked 3-D weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mcore_kernels._backend import use_triton
from mcore_kernels.moe import routed_experts, swiglu, weighted_swiglu
from mcore_kernels.moe.expert_gemms import (
    BATCHED_PLAN,
    CUBLAS_LOOP_PLAN,
    ExpertGemms,
    choose_expert_gemms,
    prefers_slots,
    without_host_sync,
)

__all__ = ["CUBLAS_LOOP_PLAN", "GroupedExperts", "grouped_mm_supported"]

_GROUPED_MM_PROBES: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on this device and dtype.

    The answer is probed once per (device type, dtype) with a tiny problem, because support
    depends on the torch build and GPU (torch 2.8+ on CUDA needs bf16 and Hopper or newer).

    Args:
        device: Device of the tokens and weights.
        dtype: Dtype of the tokens and weights.

    Returns:
        True when the grouped GEMM is usable.
    """
    key = (device.type, dtype)
    if key not in _GROUPED_MM_PROBES:
        supported = hasattr(torch, "_grouped_mm")
        if supported:
            # Autograd on even when the first call comes from inference code (the answer is
            # cached); a dense output gradient, as the layer's wrapper guarantees.
            try:
                with torch.inference_mode(False), torch.enable_grad():
                    a = torch.randn(32, 16, device=device, dtype=dtype, requires_grad=True)
                    b = torch.randn(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
                    offsets = torch.tensor([16, 32], device=device, dtype=torch.int32)
                    out = _grouped_linear(a, b, offsets)
                    out.backward(torch.ones_like(out))
            except (RuntimeError, NotImplementedError, TypeError):
                supported = False
        _GROUPED_MM_PROBES[key] = supported
    return _GROUPED_MM_PROBES[key]


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.

    ``torch._grouped_mm``'s backward rejects gradients with zero strides (the expanded
    gradient of ``out.sum()``, for instance).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets[g-1]:offsets[g]`` of ``x`` times ``weight[g].T`` (a grouped ``F.linear``)."""
    return _DenseGrad.apply(torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets))


class _BatchedLinear(torch.autograd.Function):
    """``x[e] @ weight[e].T`` for every expert ``e`` (a batched ``F.linear``).

    Autograd through ``torch.bmm(x, weight.transpose(1, 2))`` yields the weight gradient as a
    transposed view, which the gradient accumulation then copies into the parameter's layout
    (a strided copy of every expert weight, 36% of a drop-and-pad step on an H200); here the
    weight gradient is computed in the parameter's layout directly.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.bmm(x, weight.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = torch.bmm(grad.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


class _ExpertLoopLinear(torch.autograd.Function):
    """Rows grouped by expert (``sizes`` on the host) times ``weight[e].T``: one cuBLAS GEMM
    per expert and per pass, every result written in place.

    The weight gradient is computed expert by expert into one ``[E, N, K]`` tensor in the
    parameter's layout (indexing the parameter per expert under autograd would instead build
    a zero-filled gradient of the whole weight for every expert and sum them).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.sizes = sizes
        out = x.new_empty(x.shape[0], weight.shape[1])
        start = 0
        for expert, size in enumerate(sizes):
            if size:
                rows = slice(start, start + size)
                torch.mm(x[rows], weight[expert].t(), out=out[rows])
            start += size
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = x.new_empty(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        start = 0
        for expert, size in enumerate(ctx.sizes):
            rows = slice(start, start + size)
            if grad_x is not None and size:
                torch.mm(grad[rows], weight[expert], out=grad_x[rows])
            if grad_w is not None:
                if size:
                    torch.mm(grad[rows].t(), x[rows], out=grad_w[expert])
                else:
                    grad_w[expert].zero_()
            start += size
        return grad_x, grad_w, None


class GroupedExperts(nn.Module):
    """``num_local_experts`` SwiGLU MLPs (``down(silu(gate(x)) * up(x))``) held as 3-D weights.

    ``gate_up_proj`` is ``[E, 2, ffn, hidden]`` (index 0 of dimension 1 the gate projection,
    index 1 the up projection, each laid out like an ``nn.Linear`` weight) and ``down_proj``
    ``[E, hidden, ffn]``. Gate and up run as one GEMM through the ``[E, 2 * ffn, hidden]`` view;
    an expert tensor-parallel split cuts dimension 2 of ``gate_up_proj`` and of ``down_proj``
    into even contiguous slices, so every rank's shard keeps that layout.

    Args:
        num_experts: Number of experts held (all of them, or this rank's share after
            expert-parallel sharding).
        hidden_size: Width of the input and output.
        ffn_hidden_size: Inner width of each expert (this rank's share under expert tensor
            parallelism).
        dtype: Dtype of the weights.
        grouped_gemm: Use grouped kernels (``torch._grouped_mm`` where available); False runs
            a loop over experts.
        expert_kernel: "grouped_mm", "cublas" or "bmm" (see
            ``MoEConfig.expert_kernel``).
        fused: Run dropless routed assignments as one fused operation where possible (see
            ``MoEConfig.fused_experts`` and :meth:`fuses_routing`).
        device: Device of the weights (``"meta"`` for construction without memory).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        dtype: torch.dtype,
        *,
        grouped_gemm: bool = True,
        expert_kernel: str = "grouped_mm",
        fused: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.grouped_gemm = grouped_gemm
        self.expert_kernel = expert_kernel
        self.fused = fused
        self.gemm_plan: ExpertGemms | None = None
        """Kernel of each grouped GEMM of :meth:`forward_routed` (``torch._grouped_mm`` or the
        persistent Triton kernels); None picks the measured fastest for the shape
        (:func:`mcore_kernels.moe.expert_gemms.choose_expert_gemms`)."""
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2, ffn_hidden_size, hidden_size, dtype=dtype, device=device)
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, ffn_hidden_size, dtype=dtype, device=device)
        )

    @property
    def ffn_hidden_size(self) -> int:
        """Inner width of each expert held here."""
        return self.down_proj.shape[-1]

    def _gate_up_weight(self) -> torch.Tensor:
        """``[E, 2 * ffn, hidden]`` view of ``gate_up_proj`` (gate rows first)."""
        return self.gate_up_proj.flatten(1, 2)

    def fuses_routing(self, tokens: torch.Tensor) -> bool:
        """Whether :meth:`forward_routed` runs these tokens as one fused operation.

        Args:
            tokens: The tokens about to be run.

        Returns:
            True with ``fused`` on, any ``expert_kernel``, the Triton kernels for these tokens
            and ``torch._grouped_mm`` on their device.
        """
        return (
            self.fused
            and self.grouped_gemm
            and self.expert_kernel in ("grouped_mm", "cublas", "bmm")
            and use_triton(tokens)
            and grouped_mm_supported(tokens.device, tokens.dtype)
        )

    def plan_for(self, rows: int, tokens: torch.Tensor, sync_free: bool = False) -> ExpertGemms:
        """Kernel of each grouped GEMM of :meth:`forward_routed` for ``rows`` routed rows.

        Args:
            rows: Routed rows (tokens x top-k).
            tokens: The tokens (for their device).
            sync_free: Keep the measured plan free of host syncs (for callers that must not
                synchronise; a CUDA graph capture gets such a plan anyway).

        Returns:
            ``gemm_plan`` when set; with ``expert_kernel="cublas"`` one cuBLAS GEMM per expert
            for all six (a host sync); else the plan measured fastest for this shape and row
            count (:func:`~mcore_kernels.moe.expert_gemms.choose_expert_gemms`: at
            Mixtral's shape with many rows the cuBLAS loop, a host sync, for dropless routing
            and capacity routing's packed kept rows alike, except with ``sync_free`` or while
            a CUDA graph is being captured).
        """
        if self.gemm_plan is not None:
            return self.gemm_plan
        if self.expert_kernel == "cublas":
            return CUBLAS_LOOP_PLAN
        hidden = self.down_proj.shape[1]
        plan = choose_expert_gemms(
            rows, hidden, self.ffn_hidden_size, self.num_experts, tokens.device
        )
        return without_host_sync(plan) if sync_free else plan

    def pads_dropless(self, rows: int, tokens: torch.Tensor) -> bool:
        """Whether dropless routing of ``rows`` routed rows pads every expert to the largest one
        and runs batched GEMMs over the slots (one host sync for the largest count).

        Args:
            rows: Routed rows (tokens x top-k).
            tokens: The tokens (for their device).

        Returns:
            True with ``expert_kernel="bmm"``; with "grouped_mm", no ``gemm_plan`` and the
            fused operation, where that was measured faster for the shape
            (:func:`~mcore_kernels.moe.expert_gemms.prefers_slots`; never while a CUDA graph
            is being captured).
        """
        if not self.grouped_gemm:
            return False
        if self.expert_kernel == "bmm":
            return True
        if self.expert_kernel != "grouped_mm" or self.gemm_plan is not None:
            return False
        hidden = self.down_proj.shape[1]
        # The shape lookup first: for the shapes without a slot plan it answers alone.
        return prefers_slots(
            rows, hidden, self.ffn_hidden_size, self.num_experts, tokens.device
        ) and self.fuses_routing(tokens)

    def slot_plan(self) -> ExpertGemms:
        """Kernel of each GEMM on equal row slots per expert (:meth:`forward_slots`).

        Returns:
            ``gemm_plan`` when set (its row alignment dropped), else batched cuBLAS GEMMs for
            all six (:data:`~mcore_kernels.moe.expert_gemms.BATCHED_PLAN`).
        """
        if self.gemm_plan is not None:
            return replace(self.gemm_plan, row_align=1)
        return BATCHED_PLAN

    def forward_slots(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        fillers: torch.Tensor,
        kept: torch.Tensor,
        capacity: int,
    ) -> torch.Tensor:
        """Permute, run and combine routing assignments in equal slots per expert, in one fused
        operation (no host sync).

        Expert ``e`` owns rows ``e * capacity`` to ``(e + 1) * capacity``; its kept assignments
        come first, the rest of its slots are empty (zero input, zero weight, zero gradient)
        and computed by the batched GEMMs of :meth:`slot_plan`.

        Args:
            x: ``[T, hidden]`` tokens.
            weights: ``[T, top_k]`` routing weights.
            fillers: ``[num_experts * capacity]`` int64 assignment in each slot, -1 when empty.
            kept: ``[T * top_k]`` int64 slot of each assignment, -1 when dropped.
            capacity: Slots per expert.

        Returns:
            ``[T, hidden]`` weighted sum of each token's expert outputs (dropped ones count
            zero).
        """
        ends = torch.arange(1, self.num_experts + 1, dtype=torch.int32, device=x.device)
        return routed_experts(
            x,
            weights,
            self._gate_up_weight(),
            self.down_proj,
            fillers,
            kept,
            ends * capacity,
            gemms=self.slot_plan(),
        )

    def forward_routed(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        order: torch.Tensor,
        inverse: torch.Tensor,
        counts: torch.Tensor,
        offsets: torch.Tensor | None = None,
        sync_free: bool = False,
        row_align: int = 1,
        host_ends: Callable[[], list[int]] | None = None,
    ) -> torch.Tensor:
        """Permute, run and combine dropless routing assignments in one fused operation.

        The routing weights scale each row's activation inside the experts (as with
        ``row_weights`` in :meth:`forward`); see :func:`mcore_kernels.moe.routed_experts`.

        Args:
            x: ``[T, hidden]`` tokens.
            weights: ``[T, top_k]`` routing weights.
            order: ``[M]`` int64 assignment in each expert row (sorted by expert; ``M = T *
                top_k`` unless the rows are padded, -1 in an empty row).
            inverse: ``[T * top_k]`` int64 row of each assignment.
            counts: ``[num_experts]`` int64 assignments of each expert.
            offsets: ``[num_experts]`` int32 end row of each expert (the running sum of
                ``counts`` when None).
            sync_free: Run a GEMM plan without host syncs (see :meth:`plan_for`).
            row_align: Every expert's rows are padded to a multiple of this
                (:func:`mcore_kernels.moe.rows.aligned_rows`); the plan's ``row_align`` is
                set to it.

        Returns:
            ``[T, hidden]`` weighted sum of each token's expert outputs.
        """
        if offsets is None:
            offsets = counts.cumsum(0).to(torch.int32)
        plan = self.plan_for(inverse.shape[0], x, sync_free)
        if plan.row_align != row_align:
            plan = replace(plan, row_align=row_align)
        return routed_experts(
            x,
            weights,
            self._gate_up_weight(),
            self.down_proj,
            order,
            inverse,
            offsets,
            gemms=plan,
            host_ends=host_ends,
        )

    def forward(
        self, tokens: torch.Tensor, counts: torch.Tensor, row_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run variable-size groups of tokens through their experts (dropless).

        Args:
            tokens: ``[M, hidden]`` tokens sorted by expert.
            counts: ``[num_experts]`` int64 number of tokens of each expert (sums to ``M``).
            row_weights: ``[M]`` routing weight of each row, applied to its activation before
                the down projection, or None.

        Returns:
            ``[M, hidden]`` expert outputs in the order of ``tokens``.
        """
        ffn = self.ffn_hidden_size

        def activation(gate_up: torch.Tensor) -> torch.Tensor:
            if row_weights is None:
                return swiglu(gate_up)
            return weighted_swiglu(gate_up, row_weights)

        if self.grouped_gemm and self.expert_kernel == "cublas":
            # NOTE: the group sizes on the host (one device sync per call) for per-expert GEMMs.
            sizes = counts.tolist()
            gate_up = _ExpertLoopLinear.apply(tokens, self._gate_up_weight(), sizes)
            return _ExpertLoopLinear.apply(activation(gate_up), self.down_proj, sizes)
        if self.grouped_gemm and grouped_mm_supported(tokens.device, tokens.dtype):
            offsets = counts.cumsum(0).to(torch.int32)
            gate_up = _grouped_linear(tokens, self._gate_up_weight(), offsets)
            return _grouped_linear(activation(gate_up), self.down_proj, offsets)
        outputs = []
        # NOTE: the loop needs the group sizes on the host (one device sync per call).
        sizes = counts.tolist()
        chunks = tokens.split(sizes)
        scales = [None] * len(chunks) if row_weights is None else row_weights.split(sizes)
        for expert, (chunk, scale) in enumerate(zip(chunks, scales)):
            gate_up = F.linear(chunk, self._gate_up_weight()[expert])
            hidden = F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
            if scale is not None:
                hidden = hidden * scale.unsqueeze(-1)
            outputs.append(F.linear(hidden, self.down_proj[expert]))
        return torch.cat(outputs) if outputs else tokens.new_zeros(tokens.shape)

    def forward_padded(
        self, tokens: torch.Tensor, slot_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run fixed-capacity groups through their experts (no host sync).

        Batched GEMMs over every slot.

        Args:
            tokens: ``[num_experts, capacity, hidden]`` slots of each expert (padding is zero).
            slot_weights: ``[num_experts, capacity]`` routing weight of each slot, applied to
                its activation before the down projection, or None.

        Returns:
            ``[num_experts, capacity, hidden]`` outputs.
        """
        gate_up = _BatchedLinear.apply(tokens, self._gate_up_weight())
        if slot_weights is None:
            activation = swiglu(gate_up.flatten(0, 1))
        else:
            activation = weighted_swiglu(gate_up.flatten(0, 1), slot_weights.reshape(-1))
        return _BatchedLinear.apply(activation.view(*gate_up.shape[:2], -1), self.down_proj)
