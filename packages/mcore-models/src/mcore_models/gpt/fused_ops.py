"""Fused work of the decoder layer's training forward on CUDA: QKV projection, RoPE, SwiGLU.

A training forward and backward of a packed row otherwise spends a large share of its time in
small kernels between the large GEMMs: RoPE alone is seven passes over the queries and keys each
way, the activation three, and the separate query, key and value projections run two narrow
GEMMs and, backward, two additions of the input gradients. On CUDA these helpers run one Triton
kernel each way for RoPE and SwiGLU (``mcore_kernels.rotary`` and ``mcore_kernels.swiglu``,
float32 math rounded once) and one GEMM over the concatenated query/key/value weights (the
parameters stay separate: the concatenation is made per call, 3 x hidden x hidden/heads bf16
elements, and its backward splits the weight gradient). On the CPU and in the batch-invariant
mode, whose numerics are pinned to the inference engine's, they run the unfused torch code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mcore_kernels.batch_invariant import is_batch_invariant
from mcore_kernels.rotary import rotary_embedding
from mcore_kernels.swiglu import swiglu_pair
from mcore_models.gpt.rope import apply_rotary

__all__ = ["project_qkv", "rotate_queries_keys", "swiglu_activation"]


def _fused(x: torch.Tensor) -> bool:
    return x.is_cuda and not is_batch_invariant()


def project_qkv(
    q_proj: nn.Module, k_proj: nn.Module, v_proj: nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value projections of ``x``.

    Args:
        q_proj: The query projection.
        k_proj: The key projection.
        v_proj: The value projection.
        x: ``[..., hidden]`` normalised hidden states.

    Returns:
        ``(q, k, v)`` flat over heads (``[..., heads * head_dim]``); on CUDA with three plain
        ``nn.Linear`` layers, ``q`` and ``k`` are strided slices of one fused GEMM's output
        (``v`` a packed copy).
    """
    layers = (q_proj, k_proj, v_proj)
    if not (_fused(x) and all(type(layer) is nn.Linear for layer in layers)):
        return q_proj(x), k_proj(x), v_proj(x)
    linears: tuple[nn.Linear, ...] = layers  # type: ignore[assignment]
    weight = torch.cat([layer.weight for layer in linears])
    biases = [layer.bias for layer in linears]
    bias = None
    if all(b is not None for b in biases):
        bias = torch.cat(biases)  # type: ignore[arg-type]
    elif any(b is not None for b in biases):
        return q_proj(x), k_proj(x), v_proj(x)
    widths = [layer.out_features for layer in linears]
    q, k, v = F.linear(x, weight, bias).split(widths, dim=-1)
    # Queries and keys go through RoPE, which reads the strided slices and writes packed
    # tensors; values are packed here (attention kernels downstream expect packed rows).
    return q, k, v.contiguous()


def rotate_queries_keys(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to queries and keys (see :func:`mcore_models.gpt.rope.apply_rotary`).

    Args:
        q: ``[B, T, Hq, D]`` queries.
        k: ``[B, T, Hkv, D]`` keys.
        cos: ``[B, T, D // 2]`` float32 cosines.
        sin: ``[B, T, D // 2]`` float32 sines.

    Returns:
        The rotated ``(q, k)``.
    """
    if _fused(q):
        return rotary_embedding(q, cos, sin), rotary_embedding(k, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def swiglu_activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``.

    Args:
        gate: Output of the gate projection.
        up: Output of the up projection.

    Returns:
        The activation.
    """
    if _fused(gate):
        return swiglu_pair(gate, up)
    return F.silu(gate) * up
