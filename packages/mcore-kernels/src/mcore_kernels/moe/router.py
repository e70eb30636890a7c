"""Fused MoE router: logits -> scores -> top-k -> weights (normalised, scaled) -> expert counts.

One Triton program handles a block of tokens: it computes the softmax or sigmoid scores of
each row of logits, adds the expert bias for the choice, picks the ``top_k`` experts by
repeated arg-max, gathers, normalises and scales their weights and adds them to the per-expert
counts (integer atomics, whose result does not depend on their order). The backward pass
recomputes the scores from the logits and applies the closed-form gradient of the weights (and
of the scores, which the auxiliary losses use) in one kernel per block of tokens (a few torch
operations on the reference path): it adds at distinct experts only, so it is deterministic.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._compile import register_function
from mcore_kernels._triton_utils import jit, tl
from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.moe._launch import cdiv, launch, next_power_of_2
from mcore_kernels.moe.reference import moe_router_reference

__all__ = ["moe_router"]

_SCORES = ("softmax", "sigmoid")


@jit
def router_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    experts_ptr,
    scores_ptr,
    counts_ptr,
    num_tokens,
    num_experts,
    scaling,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    WEIGHTS_BF16: tl.constexpr = False,
):
    """Scores, top-k, weights and counts of ``BLOCK_T`` tokens (one row of logits each); the
    weights stored in the dtype of ``weights_ptr``."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    mask = row_ok[:, None] & col_ok[None, :]
    logits = tl.load(logits_ptr + rows[:, None] * num_experts + cols[None, :], mask=mask, other=0.0)
    logits = tl.where(col_ok[None, :], logits.to(tl.float32), float("-inf"))
    if SIGMOID:
        scores = tl.where(col_ok[None, :], 1.0 / (1.0 + tl.exp(-logits)), 0.0)
    else:
        shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = shifted / tl.sum(shifted, axis=1)[:, None]
    tl.store(scores_ptr + rows[:, None] * num_experts + cols[None, :], scores, mask=mask)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    choice = tl.where(col_ok[None, :], choice, float("-inf"))
    ks = tl.arange(0, K_PAD)
    picked_w = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    picked_e = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        # First column holding the maximum (torch.topk's order for distinct scores).
        index = tl.min(tl.where(choice == best[:, None], cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == index[:, None]
        weight = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        picked_w = tl.where(ks[None, :] == j, weight[:, None], picked_w)
        picked_e = tl.where(ks[None, :] == j, index[:, None], picked_e)
        tl.atomic_add(counts_ptr + index, 1, mask=row_ok)
        choice = tl.where(hit, float("-inf"), choice)
    if NORMALIZE:
        picked_w = picked_w / (tl.sum(picked_w, axis=1)[:, None] + 1e-20)
    picked_w = picked_w * scaling
    out_mask = row_ok[:, None] & (ks[None, :] < TOP_K)
    offsets = rows[:, None] * TOP_K + ks[None, :]
    if WEIGHTS_BF16:
        # Rounded to the nearest bf16, ties to even, as torch's cast (written out in integer
        # operations: the interpreter's float cast truncates). The weights are finite.
        bits = picked_w.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        tl.store(
            weights_ptr + offsets,
            (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True),
            mask=out_mask,
        )
    else:
        tl.store(weights_ptr + offsets, picked_w.to(weights_ptr.dtype.element_ty), mask=out_mask)
    tl.store(experts_ptr + offsets, picked_e.to(tl.int64), mask=out_mask)


@jit
def router_backward_kernel(
    logits_ptr,
    experts_ptr,
    grad_w_ptr,
    grad_s_ptr,
    out_ptr,
    num_tokens,
    num_experts,
    scaling,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SIGMOID: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_GW: tl.constexpr,
    HAS_GS: tl.constexpr,
):
    """Gradient of :func:`router_kernel`'s weights and scores with respect to the logits of
    ``BLOCK_T`` tokens: the scores recomputed, the weights' closed-form gradient added at the
    chosen experts (distinct per token), then the softmax or sigmoid backward."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * num_experts + cols[None, :]
    logits = tl.load(logits_ptr + offsets, mask=mask, other=0.0)
    logits = tl.where(col_ok[None, :], logits.to(tl.float32), float("-inf"))
    if SIGMOID:
        scores = tl.where(col_ok[None, :], 1.0 / (1.0 + tl.exp(-logits)), 0.0)
    else:
        shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = shifted / tl.sum(shifted, axis=1)[:, None]
    if HAS_GS:
        grad = tl.load(grad_s_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    else:
        grad = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    if HAS_GW:
        ks = tl.arange(0, K_PAD)
        k_mask = row_ok[:, None] & (ks[None, :] < TOP_K)
        k_offsets = rows[:, None] * TOP_K + ks[None, :]
        chosen_e = tl.load(experts_ptr + k_offsets, mask=k_mask, other=0).to(tl.int32)
        g = tl.load(grad_w_ptr + k_offsets, mask=k_mask, other=0.0).to(tl.float32) * scaling
        chosen = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            expert = tl.sum(tl.where(ks[None, :] == j, chosen_e, 0), axis=1)
            picked = tl.sum(tl.where(cols[None, :] == expert[:, None], scores, 0.0), axis=1)
            chosen = tl.where(ks[None, :] == j, picked[:, None], chosen)
        if NORMALIZE:
            total = tl.sum(chosen, axis=1) + 1e-20
            g = (g - (tl.sum(g * chosen, axis=1) / total)[:, None]) / total[:, None]
        for j in tl.static_range(TOP_K):
            expert = tl.sum(tl.where(ks[None, :] == j, chosen_e, 0), axis=1)
            g_j = tl.sum(tl.where(ks[None, :] == j, g, 0.0), axis=1)
            grad += tl.where(cols[None, :] == expert[:, None], g_j[:, None], 0.0)
    if SIGMOID:
        out = grad * scores * (1.0 - scores)
    else:
        out = scores * (grad - tl.sum(grad * scores, axis=1)[:, None])
    tl.store(out_ptr + offsets, out, mask=mask)


def _launch_token_blocks(
    kernel: Any, tensors: tuple, scaling: float, top_k: int, score: str, **constexprs: Any
) -> None:
    """Launch :func:`router_kernel` or :func:`router_backward_kernel` on blocks of ``BLOCK_T``
    tokens by ``BLOCK_E`` experts (at most 4096 elements and 64 tokens), nothing without
    tokens: ``tensors`` (the logits first) then the sizes and ``scaling``; its own
    ``constexprs`` after the shared ones."""
    logits = tensors[0]
    num_tokens, num_experts = logits.shape
    if not num_tokens:
        return
    block_e = next_power_of_2(num_experts)
    block_t = max(1, min(64, 4096 // block_e))
    with torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext():
        launch(
            kernel,
            (cdiv(num_tokens, block_t),),
            (*tensors, num_tokens, num_experts, float(scaling)),
            dict(
                TOP_K=top_k,
                K_PAD=next_power_of_2(top_k),
                BLOCK_T=block_t,
                BLOCK_E=block_e,
                SIGMOID=score == "sigmoid",
                **constexprs,
            ),
            device=logits.device,
        )


def _triton_router(
    logits: torch.Tensor,
    top_k: int,
    score: str,
    expert_bias: torch.Tensor | None,
    normalize: bool,
    scaling: float,
    weights_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:

    num_tokens, num_experts = logits.shape
    # The weights stored in their final dtype and the counts as int64 by the kernel: no cast
    # kernels after it (nor the weights' cast back in the backward pass).
    weights = logits.new_empty(num_tokens, top_k, dtype=weights_dtype)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    scores = torch.empty_like(logits)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=logits.device)
    bias = expert_bias if expert_bias is not None else logits
    _launch_token_blocks(
        router_kernel,
        (logits, bias, weights, experts, scores, counts),
        scaling,
        top_k,
        score,
        HAS_BIAS=expert_bias is not None,
        NORMALIZE=normalize,
        WEIGHTS_BF16=weights_dtype == torch.bfloat16,
    )
    return weights, experts, scores, counts


def _triton_logits_grad(
    logits: torch.Tensor,
    experts: torch.Tensor,
    grad_weights: torch.Tensor | None,
    grad_scores: torch.Tensor | None,
    score: str,
    normalize: bool,
    scaling: float,
) -> torch.Tensor:
    """:func:`router_logits_grad` in one kernel (one launch instead of about fifteen)."""

    out = torch.empty_like(logits)
    grad_w = None if grad_weights is None else grad_weights.contiguous()
    grad_s = None if grad_scores is None else grad_scores.contiguous()
    _launch_token_blocks(
        router_backward_kernel,
        (
            logits,
            experts,
            grad_w if grad_w is not None else logits,
            grad_s if grad_s is not None else logits,
            out,
        ),
        scaling,
        experts.shape[1],
        score,
        NORMALIZE=normalize,
        HAS_GW=grad_w is not None,
        HAS_GS=grad_s is not None,
    )
    return out


class MoERouterFunction(torch.autograd.Function):
    """Autograd wrapper of the fused router; differentiable in the logits."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        top_k: int,
        score: str,
        expert_bias: torch.Tensor | None,
        normalize: bool,
        scaling: float,
        weights_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scores, top-k experts, routing weights and expert counts of :func:`moe_router`.

        Args:
            ctx: Autograd context; keeps the logits, the chosen experts and the routing options.
            logits: ``[T, E]`` float32 router logits.
            top_k: Experts per token.
            score: "softmax" or "sigmoid".
            expert_bias: ``[E]`` float32 bias added to the scores for the choice only, or None.
            normalize: Rescale each token's ``top_k`` weights to sum to one.
            scaling: Factor applied to the weights last.
            weights_dtype: Dtype of the returned weights; None keeps the logits' dtype.

        Returns:
            ``(weights [T, top_k], experts [T, top_k] int64, scores [T, E] float32, counts [E]
            int64)``; experts and counts are not differentiable.
        """
        tensors = (logits,) if expert_bias is None else (logits, expert_bias)
        dtype = weights_dtype or logits.dtype
        if use_triton(*tensors):
            out = _triton_router(logits, top_k, score, expert_bias, normalize, scaling, dtype)
        else:
            with torch.no_grad():
                out = moe_router_reference(
                    logits,
                    top_k,
                    score=score,
                    expert_bias=expert_bias,
                    normalize=normalize,
                    scaling=scaling,
                )
            out = (out[0].to(dtype), *out[1:])
        ctx.save_for_backward(logits, out[1])
        ctx.score, ctx.normalize, ctx.scaling = score, normalize, scaling
        ctx.mark_non_differentiable(out[1], out[3])
        return out

    @staticmethod
    def backward(
        ctx: Any,
        grad_weights: torch.Tensor | None,
        grad_experts: Any,
        grad_scores: torch.Tensor | None,
        grad_counts: Any,
    ) -> tuple[torch.Tensor | None, None, None, None, None, None, None]:
        """Gradient of the logits from those of the weights and the scores.

        Args:
            ctx: Autograd context saved by :meth:`forward`.
            grad_weights: ``[T, top_k]`` gradient of the weights, or None.
            grad_experts: Unused (the experts are not differentiable).
            grad_scores: ``[T, E]`` gradient of the scores, or None.
            grad_counts: Unused (the counts are not differentiable).

        Returns:
            ``(grad_logits [T, E] float32 or None, None, None, None, None, None, None)``; None
            when neither the weights nor the scores have a gradient.
        """
        logits, experts = ctx.saved_tensors
        if grad_weights is None and grad_scores is None:
            return None, None, None, None, None, None, None
        return (
            router_logits_grad(
                logits,
                experts,
                grad_weights,
                grad_scores,
                score=ctx.score,
                normalize=ctx.normalize,
                scaling=ctx.scaling,
            ),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def router_logits_grad(
    logits: torch.Tensor,
    experts: torch.Tensor,
    grad_weights: torch.Tensor | None,
    grad_scores: torch.Tensor | None,
    *,
    score: str,
    normalize: bool,
    scaling: float,
) -> torch.Tensor:
    """Gradient of the router's weights and scores with respect to its logits, in closed form.

    With ``s`` the scores, ``w = scaling * s[e] / (sum s[e] + eps)`` (or ``scaling * s[e]``):
    ``dL/ds[e_j] = scaling * (g_j - sum_k g_k * w'_k) / (sum s[e] + eps)`` with ``w'`` the
    normalised weights (``scaling * g_j`` without normalisation), added at the chosen experts
    (distinct per token, so a plain scatter) to the scores' own gradient; then the softmax or
    sigmoid backward. A few tensor operations and no nested autograd call, so the backward costs
    little host time.

    Args:
        logits: ``[T, E]`` float32 logits.
        experts: ``[T, top_k]`` chosen experts.
        grad_weights: ``[T, top_k]`` gradient of the weights, or None.
        grad_scores: ``[T, E]`` gradient of the scores, or None.
        score: "softmax" or "sigmoid".
        normalize: Whether the weights were normalised.
        scaling: The weights' scaling factor.

    Returns:
        ``[T, E]`` float32 gradient of the logits.
    """
    if use_triton(logits, experts):
        return _triton_logits_grad(
            logits, experts, grad_weights, grad_scores, score, normalize, scaling
        )
    scores = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    grad = torch.zeros_like(scores) if grad_scores is None else grad_scores.float().clone()
    if grad_weights is not None:
        g = grad_weights.float() * scaling
        chosen = scores.gather(1, experts)
        if normalize:
            total = chosen.sum(dim=-1, keepdim=True) + 1e-20
            g = (g - (g * chosen / total).sum(dim=-1, keepdim=True)) / total
        grad = grad + torch.zeros_like(scores).scatter_(1, experts, g)
    if score == "softmax":
        return scores * (grad - (grad * scores).sum(dim=-1, keepdim=True))
    return grad * scores * (1.0 - scores)


def moe_router(
    logits: torch.Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    normalize: bool = True,
    scaling: float = 1.0,
    weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route tokens: scores, top-k experts, routing weights and expert counts in one kernel.

    Args:
        logits: ``[T, E]`` float32 router logits (contiguous).
        top_k: Experts per token (``1 <= top_k <= E``).
        score: "softmax" or "sigmoid".
        expert_bias: ``[E]`` float32 bias added to the scores for the choice only, or None.
        normalize: Rescale each token's ``top_k`` weights to sum to one.
        scaling: Factor applied to the weights last.
        weights_dtype: Dtype of the returned weights (computed in float32, rounded once when
            stored; their gradient is read in this dtype); None keeps float32.

    Returns:
        ``(weights [T, top_k] float32 (or weights_dtype), experts [T, top_k] int64 best first,
        scores [T, E] float32, counts [E] int64)``; weights and scores are differentiable in
        ``logits``.

    Raises:
        KernelShapeError: If ``logits`` is not 2-D or ``expert_bias`` is not ``[E]``.
        KernelDtypeError: If ``logits`` or ``expert_bias`` is not float32.
        KernelValueError: If ``top_k`` or ``score`` is invalid.
    """
    if logits.dim() != 2:
        raise KernelShapeError(f"logits.shape={tuple(logits.shape)} must be [tokens, experts]")
    if logits.dtype != torch.float32:
        raise KernelDtypeError(f"logits.dtype={logits.dtype} must be torch.float32")
    num_experts = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise KernelValueError(f"top_k={top_k!r} must be an int in [1, {num_experts}]")
    if score not in _SCORES:
        raise KernelValueError(f"score={score!r} must be one of {_SCORES}")
    if expert_bias is not None:
        if tuple(expert_bias.shape) != (num_experts,):
            raise KernelShapeError(
                f"expert_bias.shape={tuple(expert_bias.shape)} must be ({num_experts},)"
            )
        if expert_bias.dtype != torch.float32:
            raise KernelDtypeError(f"expert_bias.dtype={expert_bias.dtype} must be torch.float32")
    if _compile.compiling():
        weights, *rest = torch.ops.mcore_kernels.moe_router(
            logits.contiguous(), top_k, score, expert_bias, normalize, float(scaling)
        )
        return (weights if weights_dtype is None else weights.to(weights_dtype), *rest)
    return MoERouterFunction.apply(
        logits.contiguous(), top_k, score, expert_bias, normalize, float(scaling), weights_dtype
    )


# --- torch.library: the op torch.compile traces (forward, and its backward through the
# Function's own gradients; see mcore_kernels._compile.register_function) ---------------


def _router_fake(logits, top_k, score, expert_bias, normalize, scaling):
    tokens, experts = logits.shape
    return (
        logits.new_empty((tokens, top_k)),
        logits.new_empty((tokens, top_k), dtype=torch.int64),
        logits.new_empty((tokens, experts)),
        logits.new_empty((experts,), dtype=torch.int64),
    )


register_function(
    "moe_router",
    MoERouterFunction,
    "Tensor logits, int top_k, str score, Tensor? expert_bias, bool normalize, float scaling",
    4,
    (0,),
    _router_fake,
)
