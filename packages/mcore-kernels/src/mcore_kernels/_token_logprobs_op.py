"""``token_logprobs`` as the custom ops ``mcore_kernels::token_logprobs_fwd`` / ``_bwd``.

Used while ``torch.compile`` traces :func:`mcore_kernels.token_logprobs` (see :mod:`._compile`).
The process group travels as its name (op schemas hold no Python objects); the forward runs the
target range check (a host sync, impossible inside a traced graph), picks the Triton kernel or
the torch reference at run time and returns the full-vocabulary log-sum-exp and expected logit
of each row, from which the backward computes ``d(logits)`` without communication.
"""

from __future__ import annotations

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._validation import check_target_range
from mcore_kernels._vocab_parallel import group_rank_and_size
from mcore_kernels.reference import token_logprobs_parts

__all__ = ["token_logprobs_via_op"]


def _triton(logits: torch.Tensor, targets: torch.Tensor) -> bool:
    return logits.dtype != torch.float64 and use_triton(logits, targets)


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@_compile.custom_op(
    "token_logprobs_fwd",
    "(Tensor logits, Tensor targets, float temperature, str group_name, bool with_entropy, "
    "int ignore_index, bool check_targets) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _token_logprobs_fwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    group_name: str,
    with_entropy: bool,
    ignore_index: int,
    check_targets: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    group = _compile.resolve_group(group_name)
    _, world = group_rank_and_size(group)
    vocab = logits.shape[-1]
    if check_targets:
        check_target_range(targets, vocab * world, ignore_index)
    if _triton(logits, targets):
        from mcore_kernels._token_logprobs_triton import token_logprobs_forward
        from mcore_kernels._triton_utils import as_rows, on_device_of

        with on_device_of(logits):
            logprobs, entropy, lse, expected = token_logprobs_forward(
                as_rows(logits),
                targets.reshape(-1).contiguous(),
                1.0 / temperature,
                group,
                with_entropy,
                ignore_index,
            )
        logprobs = logprobs.reshape(targets.shape)
        entropy = entropy.reshape(targets.shape)
        # The launcher keeps lse and expected in one buffer; op outputs may not share storage.
        expected = expected.clone()
    else:
        parts = token_logprobs_parts(
            logits, targets, temperature, group, with_entropy, ignore_index
        )
        logprobs, entropy, lse, expected = parts  # type: ignore[assignment]
    # Outputs of a custom op may neither alias each other nor be None: empty stand-ins.
    empty = logprobs.new_empty(0)
    return (
        logprobs,
        entropy if with_entropy else empty,
        lse,
        expected if with_entropy else empty.clone(),
    )


@_compile.custom_op(
    "token_logprobs_bwd",
    "(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, Tensor targets, Tensor lse, "
    "Tensor expected, float temperature, str group_name, int ignore_index) -> Tensor",
)
def _token_logprobs_bwd(
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    expected: torch.Tensor,
    temperature: float,
    group_name: str,
    ignore_index: int,
) -> torch.Tensor:
    rank, _ = group_rank_and_size(_compile.resolve_group(group_name))
    vocab = logits.shape[-1]
    flat_targets = targets.reshape(-1).contiguous()
    if _triton(logits, targets):
        from mcore_kernels._token_logprobs_triton import token_logprobs_backward
        from mcore_kernels._triton_utils import as_rows, on_device_of

        with on_device_of(logits):
            grad = token_logprobs_backward(
                grad_logprobs.reshape(-1),
                grad_entropy.reshape(-1) if grad_entropy is not None else None,
                as_rows(logits),
                flat_targets,
                lse,
                expected,
                1.0 / temperature,
                rank * vocab,
                ignore_index,
            )
        return grad.reshape(logits.shape)
    # d(logprob)/dz = onehot - p and d(entropy)/dz = -p * (z - E[z]), both divided by T.
    compute = _stats_dtype(logits.dtype)
    z = logits.reshape(-1, vocab).to(compute) / temperature
    valid = flat_targets != ignore_index
    finite = torch.isfinite(lse).unsqueeze(1)
    probs = torch.where(finite, torch.exp(z - torch.where(finite, lse.unsqueeze(1), 0.0)), 0.0)
    grad_lp = torch.where(valid, grad_logprobs.reshape(-1).to(compute), 0.0).unsqueeze(1)
    local = flat_targets.long() - rank * vocab
    onehot = torch.arange(vocab, device=logits.device).unsqueeze(0) == local.unsqueeze(1)
    dz = torch.where(onehot, grad_lp, 0.0) - grad_lp * probs
    if grad_entropy is not None:
        grad_ent = torch.where(valid, grad_entropy.reshape(-1).to(compute), 0.0).unsqueeze(1)
        dz = dz - grad_ent * probs * (torch.where(probs > 0, z, 0.0) - expected.unsqueeze(1))
    return (dz / temperature).to(logits.dtype).reshape(logits.shape)


if _compile.CUSTOM_OPS:

    @_token_logprobs_fwd.register_fake
    def _(logits, targets, temperature, group_name, with_entropy, ignore_index, check_targets):
        dtype = _stats_dtype(logits.dtype)
        rows = targets.numel()
        logprobs = logits.new_empty(targets.shape, dtype=dtype)
        entropy = logits.new_empty(targets.shape if with_entropy else (0,), dtype=dtype)
        expected = logits.new_empty((rows,) if with_entropy else (0,), dtype=dtype)
        return logprobs, entropy, logits.new_empty((rows,), dtype=dtype), expected

    @_token_logprobs_bwd.register_fake
    def _(grad_logprobs, grad_entropy, logits, targets, lse, expected, *args):
        return logits.new_empty(logits.shape)

    def _setup_context(ctx, inputs, output):
        logits, targets, temperature, group_name, with_entropy, ignore_index, _ = inputs
        _, _, lse, expected = output
        ctx.save_for_backward(logits, targets, lse, expected)
        ctx.arguments = (temperature, group_name, ignore_index)
        ctx.with_entropy = with_entropy

    def _backward(ctx, grad_logprobs, grad_entropy, _grad_lse, _grad_expected):
        logits, targets, lse, expected = ctx.saved_tensors
        grad_logits = _token_logprobs_bwd(
            grad_logprobs,
            grad_entropy if ctx.with_entropy else None,
            logits,
            targets,
            lse,
            expected if ctx.with_entropy else lse,
            *ctx.arguments,
        )
        return grad_logits, None, None, None, None, None, None

    _token_logprobs_fwd.register_autograd(_backward, setup_context=_setup_context)


def token_logprobs_via_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    group_name: str,
    return_entropy: bool,
    ignore_index: int,
    check_targets: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Target log-probabilities (and entropies) through the custom op.

    Args:
        logits: ``[..., V]`` logits or this rank's vocabulary shard (metadata validated).
        targets: global token ids shaped ``logits.shape[:-1]``.
        temperature: logits are divided by it before the softmax.
        group_name: name of the vocabulary-parallel group, ``""`` for none.
        return_entropy: also return the entropy of each row.
        ignore_index: rows whose target equals it give 0 and no gradient.
        check_targets: check the target range when the op runs.

    Returns:
        Log-probabilities shaped like ``targets``; with ``return_entropy`` the pair
        ``(logprobs, entropy)``.
    """
    logprobs, entropy, _, _ = _token_logprobs_fwd(
        logits,
        targets,
        float(temperature),
        group_name,
        return_entropy,
        ignore_index,
        check_targets,
    )
    return (logprobs, entropy) if return_entropy else logprobs
