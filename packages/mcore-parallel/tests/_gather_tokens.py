"""Shared by the expert-gradient tests of DDP and FSDP: the token all-gather that stands in for
the dispatch of a real MoE layer."""

import torch


class GatherTokens(torch.autograd.Function):
    """All-gather along rows whose backward sums the gradients and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        size = torch.distributed.get_world_size(group)
        ctx.group, ctx.size, ctx.index = group, size, torch.distributed.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size)[ctx.index], None
