"""Ring attention: keys and values travel around the context-parallel ring, overlapped.

At step ``s`` rank ``r`` attends its queries to the key/value block of rank ``(r - s) mod cp``
while it already sends that block on to rank ``r + 1`` and receives the next one from
``r - 1`` (asynchronous point-to-point, posted together with ``batch_isend_irecv`` so that NCCL
does not deadlock on the ring). Partial outputs merge with their log-sum-exp. The backward
pass runs the same ring again, recomputing each block's probabilities from the final
log-sum-exp; the gradients of a key/value block travel with it and arrive back at its owner
after the last step. Under a causal mask the load-balanced chunks (see
:mod:`~mcore_parallel.context_parallel.layout`) let every rank skip the same amount of work.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.context_parallel.blocks import block_backward, block_forward, merge_into
from mcore_parallel.context_parallel.layout import ChunkLayout, block_plan

__all__ = ["RingAttentionFunction"]

_KV_TAG, _GRAD_TAG = 11, 12


class _Ring:
    """This rank's neighbours in the context-parallel group and the async exchange."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.next = ranks[(self.rank + 1) % self.size]
        self.prev = ranks[(self.rank - 1) % self.size]

    def start(self, tensor: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[Any]]:
        """Sends ``tensor`` to the next rank and receives one like it from the previous one.

        Returns:
            The receive buffer and the handles to wait for.
        """
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ]
        return received, dist.batch_isend_irecv(ops)


def _take(x: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    return x[..., index, :] if isinstance(index, slice) else x.index_select(-2, index)


def _take_rows(x: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    return x[..., index] if isinstance(index, slice) else x.index_select(-1, index)


def _add_at(x: torch.Tensor, index: slice | torch.Tensor, value: torch.Tensor) -> None:
    if isinstance(index, slice):
        x[..., index, :] += value
    else:
        x.index_add_(-2, index, value)


def _put_rows(
    out: torch.Tensor,
    lse: torch.Tensor,
    index: slice | torch.Tensor,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> None:
    if isinstance(index, slice):
        merged_out, merged_lse = merge_into(
            out[..., index, :], lse[..., index], block_out, block_lse
        )
        out[..., index, :] = merged_out
        lse[..., index] = merged_lse
        return
    merged_out, merged_lse = merge_into(
        out.index_select(-2, index), lse.index_select(-1, index), block_out, block_lse
    )
    out.index_copy_(-2, index, merged_out)
    lse.index_copy_(-1, index, merged_lse)


class RingAttentionFunction(torch.autograd.Function):
    """Autograd function of ring attention; call through
    :func:`~mcore_parallel.context_parallel.ring_attention`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup,
        layout: ChunkLayout,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:
        """Runs the forward ring; see the module docstring."""
        ring = _Ring(group)
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            pending = ring.start(kv, _KV_TAG) if step < ring.size - 1 else None
            kf, vf = kv[0].float(), kv[1].float()
            for q_index, kv_index, mask, is_causal in block_plan(layout, ring.rank, source, causal):
                block_out, block_lse = block_forward(
                    _take(qf, q_index),
                    _take(kf, kv_index),
                    _take(vf, kv_index),
                    mask,
                    scale,
                    is_causal,
                )
                _put_rows(out, lse, q_index, block_out, block_lse)
            if pending is not None:
                received, works = pending
                for work in works:
                    work.wait()
                kv = received
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.causal, ctx.scale = group, layout, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        """Runs the backward ring; see the module docstring."""
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        qf, grad_out = q.float(), grad_output.float()
        delta = (grad_out * out).sum(dim=-1)
        grad_q = torch.zeros_like(qf)
        kv = torch.stack([k, v]).contiguous()
        grad_kv: torch.Tensor | None = None
        grad_pending: tuple[torch.Tensor, list[Any]] | None = None
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            pending = ring.start(kv, _KV_TAG) if step < ring.size - 1 else None
            kf, vf = kv[0].float(), kv[1].float()
            contribution = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for q_index, kv_index, mask, is_causal in block_plan(
                ctx.layout, ring.rank, source, ctx.causal
            ):
                dq, dk, dv = block_backward(
                    _take(qf, q_index),
                    _take(kf, kv_index),
                    _take(vf, kv_index),
                    mask,
                    ctx.scale,
                    _take_rows(lse, q_index),
                    _take(grad_out, q_index),
                    _take_rows(delta, q_index),
                    _take(out, q_index),
                    is_causal,
                )
                _add_at(grad_q, q_index, dq)
                _add_at(contribution[0], kv_index, dk)
                _add_at(contribution[1], kv_index, dv)
            if grad_pending is not None:
                received_grad, works = grad_pending
                for work in works:
                    work.wait()
                contribution += received_grad
            grad_kv = contribution
            if ring.size > 1:
                # The block's gradient follows it round the ring back to its owner.
                grad_pending = ring.start(grad_kv, _GRAD_TAG)
            if pending is not None:
                received, works = pending
                for work in works:
                    work.wait()
                kv = received
        if grad_pending is not None:
            received_grad, works = grad_pending
            for work in works:
                work.wait()
            grad_kv = received_grad
        assert grad_kv is not None
        grad_k, grad_v = grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype)
        return grad_q.to(q.dtype), grad_k, grad_v, None, None, None, None
