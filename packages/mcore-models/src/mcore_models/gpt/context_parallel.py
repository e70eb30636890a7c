"""Context-parallel core attention: the hook ``parallelize`` installs on each attention module.

Under context parallelism every rank holds ``T / cp`` tokens of every sequence (the
load-balanced chunks of :func:`mcore_parallel.context_parallel.split_sequence`); everything but
attention is token-local, and attention runs as ring attention (or all-gather-KV) over the cp
group through :func:`mcore_parallel.context_parallel.context_parallel_attention`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mcore_models.gpt.attention_backends import AttentionMask
from mcore_parallel.context_parallel import context_parallel_attention

__all__ = ["ContextParallelAttention"]


class ContextParallelAttention(nn.Module):
    """Causal attention of this rank's tokens over the whole context-parallel group.

    Args:
        group: Context-parallel process group.
        method: ``"ring"`` (overlapped point-to-point exchange of keys/values) or
            ``"all_gather"``.
    """

    def __init__(self, group: dist.ProcessGroup, method: str = "ring") -> None:
        super().__init__()
        self.group = group
        self.method = method

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: AttentionMask,
        scale: float,
    ) -> torch.Tensor:
        """Attend.

        Args:
            q: ``[B, T_local, Hq, D]`` queries.
            k: ``[B, T_local, Hkv, D]`` keys.
            v: ``[B, T_local, Hkv, D]`` values.
            mask: The forward pass's mask; its ``cu_seqlens`` are those of the full packed
                sequence (None when unpacked).
            scale: Multiplier of the query-key products.

        Returns:
            ``[B, T_local, Hq, D]``.
        """
        out = context_parallel_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            self.group,
            causal=True,
            cu_seqlens=mask.cu_seqlens,
            scale=scale,
            method=self.method,
        )
        return out.transpose(1, 2)
