"""The routed experts of a MoE layer: SwiGLU MLPs stored as stacked 3-D weights."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GroupedExperts", "grouped_mm_supported"]

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


class GroupedExperts(nn.Module):
    """``num_local_experts`` SwiGLU MLPs (``down(silu(gate(x)) * up(x))``) held as 3-D weights.

    Weights are laid out like stacked ``nn.Linear`` weights: ``gate_proj`` and ``up_proj``
    ``[E, ffn, hidden]``, ``down_proj`` ``[E, hidden, ffn]``.

    Args:
        num_experts: Number of experts held (all of them, or this rank's share after
            expert-parallel sharding).
        hidden_size: Width of the input and output.
        ffn_hidden_size: Inner width of each expert.
        dtype: Dtype of the weights.
        grouped_gemm: Use ``torch._grouped_mm`` for variable-size groups where available.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        dtype: torch.dtype,
        *,
        grouped_gemm: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.grouped_gemm = grouped_gemm
        shape = (num_experts, ffn_hidden_size, hidden_size)
        self.gate_proj = nn.Parameter(torch.empty(shape, dtype=dtype))
        self.up_proj = nn.Parameter(torch.empty(shape, dtype=dtype))
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, ffn_hidden_size, dtype=dtype)
        )

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Run variable-size groups of tokens through their experts (dropless).

        Args:
            tokens: ``[M, hidden]`` tokens sorted by expert.
            counts: ``[num_experts]`` int64 number of tokens of each expert (sums to ``M``).

        Returns:
            ``[M, hidden]`` expert outputs in the order of ``tokens``.
        """
        if self.grouped_gemm and grouped_mm_supported(tokens.device, tokens.dtype):
            offsets = counts.cumsum(0).to(torch.int32)
            gate = _grouped_linear(tokens, self.gate_proj, offsets)
            up = _grouped_linear(tokens, self.up_proj, offsets)
            return _grouped_linear(F.silu(gate) * up, self.down_proj, offsets)
        outputs = []
        # NOTE: the loop needs the group sizes on the host (one device sync per call).
        for expert, chunk in enumerate(tokens.split(counts.tolist())):
            activation = F.silu(F.linear(chunk, self.gate_proj[expert])) * F.linear(
                chunk, self.up_proj[expert]
            )
            outputs.append(F.linear(activation, self.down_proj[expert]))
        return torch.cat(outputs) if outputs else tokens.new_zeros(tokens.shape)

    def forward_padded(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run fixed-capacity groups through their experts with batched GEMMs (no host sync).

        Args:
            tokens: ``[num_experts, capacity, hidden]`` slots of each expert (padding is zero).

        Returns:
            ``[num_experts, capacity, hidden]`` outputs.
        """
        gate = _BatchedLinear.apply(tokens, self.gate_proj)
        up = _BatchedLinear.apply(tokens, self.up_proj)
        return _BatchedLinear.apply(F.silu(gate) * up, self.down_proj)
