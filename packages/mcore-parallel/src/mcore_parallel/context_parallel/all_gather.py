"""All-gather-KV context-parallel attention.

Every rank all-gathers the keys and values of its context-parallel group (``cp`` times the
local key/value memory, transiently), attends its local queries to all of them with one
``scaled_dot_product_attention`` call under a mask built from the token layout, and the
gradients of keys and values are reduce-scattered back to their owners. Simpler than the ring
and a single collective each way, but the collective is not overlapped with compute; with grouped-query attention the keys and values are small,
which is where this variant is competitive (Megatron-Core's ``a2a``/``allgather`` CP modes make
the same trade).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mcore_parallel.context_parallel.layout import ChunkLayout, full_mask

__all__ = ["all_gather_kv_attention"]


class _GatherKV(torch.autograd.Function):
    """All-gathers a ``[2, B, H, T, D]`` key/value stack along T; backward reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, kv: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        size = dist.get_world_size(group)
        gathered = torch.empty(
            (size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device
        )
        dist.all_gather_into_tensor(gathered, kv.contiguous(), group=group)
        gathered = gathered.view(size, *kv.shape)
        ctx.group = group
        # [cp, 2, B, H, T, D] -> [2, B, H, cp * T, D], rank blocks in rank order.
        return gathered.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        size = dist.get_world_size(ctx.group)
        two, batch, heads, total, dim = grad.shape
        blocks = grad.reshape(two, batch, heads, size, total // size, dim).permute(3, 0, 1, 2, 4, 5)
        # Sum in fp32: every rank's queries contributed to every block.
        blocks = blocks.float().contiguous().flatten(0, 1)
        local = torch.empty(
            blocks.shape[0] // size, *blocks.shape[1:], dtype=torch.float32, device=grad.device
        )
        dist.reduce_scatter_tensor(local, blocks, group=ctx.group)
        return local.to(grad.dtype), None


def all_gather_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    layout: ChunkLayout,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Attention of the local queries over the keys and values of the whole group.

    Args:
        q: Local queries ``[B, Hq, T_local, D]``.
        k: Local keys ``[B, Hkv, T_local, D]``.
        v: Local values ``[B, Hkv, T_local, D]``.
        group: The context-parallel group.
        layout: Token layout of the full sequence.
        causal: Whether the attention is causal.
        scale: Factor applied to the scores.

    Returns:
        The local output ``[B, Hq, T_local, D]``.
    """
    keys, values = _GatherKV.apply(torch.stack([k, v]), group)
    mask = full_mask(layout, dist.get_rank(group), causal)
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        keys = keys.repeat_interleave(repeat, dim=1)
        values = values.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
