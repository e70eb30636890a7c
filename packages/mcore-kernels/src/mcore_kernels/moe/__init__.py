"""Fused MoE kernels: router, token permutation, weighted combine and SwiGLU.

Each operation is a Triton kernel launched through an ``autograd.Function`` whose backward is
a kernel (or a recomputation) without atomic floating-point adds, with its torch reference in
:mod:`mcore_kernels.moe.reference` (also the path for CPU tensors). Each op's module holds its
Triton kernels, their launchers, its ``autograd.Function`` and its ``torch.library``
registration (what ``torch.compile`` traces).
"""

from mcore_kernels.moe import reference
from mcore_kernels.moe.permute import permute_tokens, unpermute_combine, unpermute_sum
from mcore_kernels.moe.routed import routed_experts
from mcore_kernels.moe.router import moe_router
from mcore_kernels.moe.swiglu import swiglu, weighted_swiglu

__all__ = [
    "moe_router",
    "permute_tokens",
    "reference",
    "routed_experts",
    "swiglu",
    "unpermute_combine",
    "unpermute_sum",
    "weighted_swiglu",
]
