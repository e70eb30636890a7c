"""Fused elementwise kernels of the decoder layer on CUDA: RoPE and the SwiGLU activation.

A training forward and backward of a packed row otherwise spends a large share of its time in
small elementwise kernels between the GEMMs (RoPE alone is seven passes over the queries and
keys each way, the activation three). On CUDA these helpers run one Triton kernel each way
(``mcore_kernels.rotary`` and ``mcore_kernels.swiglu``, float32 math rounded once); on the CPU
and in the batch-invariant mode, whose numerics are pinned to the inference engine's, they run
the unfused torch code. (One GEMM over the concatenated query/key/value weights was measured as
well: no faster on an H100 for the 1B shape, so the projections stay separate.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_kernels.batch_invariant import is_batch_invariant
from mcore_kernels.rotary import rotary_embedding
from mcore_kernels.swiglu import swiglu_pair
from mcore_models.gpt.rope import apply_rotary

__all__ = ["rotate_queries_keys", "swiglu_activation"]


def _fused(x: torch.Tensor) -> bool:
    return x.is_cuda and not is_batch_invariant()


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
