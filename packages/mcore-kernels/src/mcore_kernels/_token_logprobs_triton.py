"""Triton kernels of ``token_logprobs``: chunked online log-sum-exp forward, fused backward.

Forward: one program per row streams the row's logits in chunks of ``BLOCK_V`` (a function of
the vocabulary size only), keeping a running maximum, the running sum of ``exp(z - max)`` and,
for the entropy, the running sum of ``exp(z - max) * z``; every value is upcast to float32 in
registers, so no float32 copy of the logits is ever made. The per-row statistics of a
vocabulary shard are combined across the tensor-parallel group in torch (a few floats per row).

Backward: one program per row writes ``d(logits)`` in the logits' dtype, the only
logits-sized buffer of the whole computation:
``dz = g_logprob * (onehot - p) - g_entropy * p * (z - E[z])`` with ``p = exp(z - lse)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from mcore_kernels._triton_utils import as_rows, on_device_of, round_to
from mcore_kernels._vocab_parallel import combine_shard_stats, group_rank_and_size

__all__ = [
    "FORWARD_STAGES",
    "MAX_BLOCK_V",
    "token_logprobs_triton",
    "token_logprobs_forward",
    "token_logprobs_backward",
]

MAX_BLOCK_V = 4096
"""Widest vocabulary chunk a program holds in registers at once."""

FORWARD_STAGES = 1
"""Software-pipelining depth of the forward's vocabulary loop (``tl.range(num_stages=...)``)."""


def _block_and_warps(vocab: int, *, backward: bool) -> tuple[int, int]:
    # Measured on H200 at [8192, 151936] bf16 (benchmarks/tune_launch_configs.py): 4 warps per
    # program stream the forward fastest, 8 warps the backward.
    block = min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    if backward:
        return block, 8 if block >= 2048 else 4
    return block, 4


@triton.jit
def _token_logprobs_fwd_kernel(
    logits_ptr,
    targets_ptr,
    lse_ptr,
    expected_ptr,
    target_logit_ptr,
    logprobs_ptr,
    entropy_ptr,
    row_stride,
    vocab,
    vocab_start,
    ignore_index,
    inv_temperature,
    WITH_ENTROPY: tl.constexpr,
    FULL_VOCAB: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK_V)
    running_max = -float("inf")
    running_sum = 0.0
    running_weighted = 0.0
    for start in tl.range(0, vocab, BLOCK_V, num_stages=NUM_STAGES):
        offs = start + cols
        z = (
            tl.load(row_ptr + offs, mask=offs < vocab, other=-float("inf")).to(tl.float32)
            * inv_temperature
        )
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        # While every logit so far is -inf the shift is undefined; keep the sums at zero.
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        scale = tl.exp(running_max - shift)
        exps = tl.exp(z - shift)
        running_sum = running_sum * scale + tl.sum(exps, axis=0)
        if WITH_ENTROPY:
            # exp(-inf) * -inf would be nan: masked logits contribute nothing.
            weighted = exps * tl.where(exps > 0.0, z, 0.0)
            running_weighted = running_weighted * scale + tl.sum(weighted, axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    expected = running_weighted / tl.where(running_sum > 0.0, running_sum, 1.0)
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = target != ignore_index
    local = target - vocab_start
    in_shard = valid & (local >= 0) & (local < vocab)
    target_logit = tl.load(row_ptr + tl.where(in_shard, local, 0), mask=in_shard, other=0.0).to(
        tl.float32
    )
    target_logit = tl.where(in_shard, target_logit * inv_temperature, 0.0)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        tl.store(expected_ptr + row, expected)
    if FULL_VOCAB:
        tl.store(logprobs_ptr + row, tl.where(valid, target_logit - lse, 0.0))
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, tl.where(valid, lse - expected, 0.0))
    else:
        tl.store(target_logit_ptr + row, target_logit)


@triton.jit
def _token_logprobs_bwd_kernel(
    logits_ptr,
    targets_ptr,
    lse_ptr,
    expected_ptr,
    grad_logprob_ptr,
    grad_entropy_ptr,
    grad_logits_ptr,
    row_stride,
    vocab,
    vocab_start,
    ignore_index,
    inv_temperature,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    out_ptr = grad_logits_ptr + row * vocab
    cols = tl.arange(0, BLOCK_V)
    target = tl.load(targets_ptr + row).to(tl.int64)
    # Ignored rows get zero coefficients, hence exactly zero gradient.
    valid = target != ignore_index
    local = target - vocab_start
    lse = tl.load(lse_ptr + row)
    grad_logprob = tl.where(valid, tl.load(grad_logprob_ptr + row).to(tl.float32), 0.0)
    if WITH_ENTROPY:
        grad_entropy = tl.where(valid, tl.load(grad_entropy_ptr + row).to(tl.float32), 0.0)
        expected = tl.load(expected_ptr + row)
    for start in range(0, vocab, BLOCK_V):
        offs = start + cols
        mask = offs < vocab
        z = tl.load(row_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32) * inv_temperature
        probs = tl.exp(z - lse)
        dz = tl.where(offs == local, grad_logprob, 0.0) - grad_logprob * probs
        if WITH_ENTROPY:
            dz -= grad_entropy * probs * (tl.where(probs > 0.0, z, 0.0) - expected)
        tl.store(
            out_ptr + offs,
            round_to(dz * inv_temperature, grad_logits_ptr.dtype.element_ty),
            mask=mask,
        )


def token_logprobs_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: float,
    group: dist.ProcessGroup | None,
    with_entropy: bool,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on ``[rows, V]`` logits and combine the shards' statistics.

    Args:
        logits: ``[rows, V]`` logits (or this rank's vocabulary shard), unit stride in ``V``.
        targets: ``[rows]`` contiguous global token ids.
        inv_temperature: ``1 / temperature``.
        group: tensor-parallel process group of the vocabulary shards, or None.
        with_entropy: also compute the entropy.
        ignore_index: rows whose target equals it give 0.

    Returns:
        ``(logprobs, entropy, lse, expected)``, float32 ``[rows]`` each: ``lse`` and
        ``expected`` are the full vocabulary's log-sum-exp and expected logit that the backward
        needs. Without ``with_entropy``, ``entropy`` and ``expected`` alias other outputs.
    """
    rank, world = group_rank_and_size(group)
    rows, vocab = logits.shape
    full_vocab = world == 1
    stats = torch.empty((3 if with_entropy else 2, rows), dtype=torch.float32, device=logits.device)
    lse, target_logit = stats[0], stats[1]
    expected = stats[2] if with_entropy else lse
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logprobs) if with_entropy else logprobs
    if rows > 0:
        block, warps = _block_and_warps(vocab, backward=False)
        _token_logprobs_fwd_kernel[(rows,)](
            logits,
            targets,
            lse,
            expected,
            target_logit,
            logprobs,
            entropy,
            logits.stride(0),
            vocab,
            rank * vocab,
            ignore_index,
            inv_temperature,
            WITH_ENTROPY=with_entropy,
            FULL_VOCAB=full_vocab,
            BLOCK_V=block,
            NUM_STAGES=FORWARD_STAGES,
            num_warps=warps,
        )
    if not full_vocab:
        lse, target_logit, global_expected = combine_shard_stats(
            lse, target_logit, expected if with_entropy else None, group
        )
        valid = targets != ignore_index
        zeros = torch.zeros_like(lse)
        logprobs = torch.where(valid, target_logit - lse, zeros)
        if with_entropy:
            assert global_expected is not None
            expected = global_expected
            entropy = torch.where(valid, lse - expected, zeros)
        else:
            entropy, expected = logprobs, lse
    return logprobs, entropy, lse, expected


def token_logprobs_backward(
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    expected: torch.Tensor,
    inv_temperature: float,
    vocab_start: int,
    ignore_index: int,
) -> torch.Tensor:
    """Launch the backward kernel: ``d(logits)`` in the logits' dtype.

    Args:
        grad_logprobs: ``[rows]`` gradient of the log-probabilities.
        grad_entropy: ``[rows]`` gradient of the entropy, or None.
        logits: ``[rows, V]`` logits of the forward.
        targets: ``[rows]`` global token ids.
        lse: ``[rows]`` full-vocabulary log-sum-exp from the forward.
        expected: ``[rows]`` full-vocabulary expected logit (any ``[rows]`` tensor without entropy).
        inv_temperature: ``1 / temperature``.
        vocab_start: global id of this shard's first column.
        ignore_index: rows whose target equals it get no gradient.

    Returns:
        ``[rows, V]`` gradient of ``logits``.
    """
    rows, vocab = logits.shape
    with_entropy = grad_entropy is not None
    grad_logprobs = grad_logprobs.contiguous()
    grad_entropy = grad_entropy.contiguous() if grad_entropy is not None else grad_logprobs
    grad_logits = torch.empty((rows, vocab), dtype=logits.dtype, device=logits.device)
    if rows > 0:
        block, warps = _block_and_warps(vocab, backward=True)
        _token_logprobs_bwd_kernel[(rows,)](
            logits,
            targets,
            lse,
            expected,
            grad_logprobs,
            grad_entropy,
            grad_logits,
            logits.stride(0),
            vocab,
            vocab_start,
            ignore_index,
            inv_temperature,
            WITH_ENTROPY=with_entropy,
            BLOCK_V=block,
            num_warps=warps,
        )
    return grad_logits


class _TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, inv_temperature, group, with_entropy, ignore_index):  # type: ignore[override]
        logprobs, entropy, lse, expected = token_logprobs_forward(
            logits, targets, inv_temperature, group, with_entropy, ignore_index
        )
        ctx.save_for_backward(logits, targets, lse, expected)
        ctx.inv_temperature = inv_temperature
        ctx.with_entropy = with_entropy
        ctx.vocab_start = group_rank_and_size(group)[0] * logits.shape[1]
        ctx.ignore_index = ignore_index
        if not with_entropy:
            return logprobs
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):  # type: ignore[override]
        logits, targets, lse, expected = ctx.saved_tensors
        grad_logits = token_logprobs_backward(
            grad_logprobs,
            grad_entropy if ctx.with_entropy else None,
            logits,
            targets,
            lse,
            expected,
            ctx.inv_temperature,
            ctx.vocab_start,
            ctx.ignore_index,
        )
        return grad_logits, None, None, None, None, None


def token_logprobs_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Target log-probabilities (and entropies) through the Triton kernels.

    Arguments are those of :func:`mcore_kernels.token_logprobs`, already validated.

    Args:
        logits: ``[..., V]`` logits or this rank's vocabulary shard.
        targets: global token ids shaped ``logits.shape[:-1]``.
        temperature: logits are divided by it before the softmax.
        group: tensor-parallel process group of the vocabulary shards, or None.
        return_entropy: also return the entropy of each row.
        ignore_index: rows whose target equals it give 0 and no gradient.

    Returns:
        float32 log-probabilities shaped like ``targets``; with ``return_entropy`` the pair
        ``(logprobs, entropy)``.
    """
    lead_shape = targets.shape
    flat = as_rows(logits)
    # The autograd engine runs the backward on the device's own thread, with it current.
    with on_device_of(logits):
        out = _TokenLogprobsFunction.apply(
            flat,
            targets.reshape(-1).contiguous(),
            1.0 / temperature,
            group,
            return_entropy,
            ignore_index,
        )
    if not return_entropy:
        return out.reshape(lead_shape)
    logprobs, entropy = out
    return logprobs.reshape(lead_shape), entropy.reshape(lead_shape)
