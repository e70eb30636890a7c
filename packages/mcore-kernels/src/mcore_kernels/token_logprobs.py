"""Per-token log-probabilities (and entropies): Triton kernels, launchers, autograd, custom ops.

Forward: one program per row streams the row's logits in chunks of ``BLOCK_V`` (a function of
the vocabulary size only). Every lane of a chunk keeps its own online statistics of the logits
it sees: the largest so far ``m``, ``sum exp(t * (z - m))`` and, for the entropy, the same sum
weighted by ``z``, updated with one exponential per logit and no reduction across threads
inside the loop. Values are upcast to float32 in registers, so no float32 copy of the logits is
ever made. After the loop the lanes are rotated back to the row's own order (lane ``k`` then
holds the terms ``k, k + BLOCK_V, ...`` of the row) and reduced once. Every sum of the row is
therefore taken in an order fixed by the row's logits and the vocabulary size alone: a row's
results are bitwise the same at any position in any batch, with or without the entropy, eager
or in a CUDA graph (batch-invariant RL compares the rollout engine's log-probs with the
trainer's to the last bit). The per-row statistics of a vocabulary shard are combined across
the tensor-parallel group in torch (a few floats per row).

Backward: one program per row writes ``d(logits)`` in the logits' dtype, the only logits-sized
buffer of the whole computation:
``dz = g_logprob * (onehot - p) - g_entropy * p * (z - E[z])`` with ``p = exp(z - lse)``.

Rows of a vocabulary whose size in bytes is not a multiple of 16 (GPT-2's 50257) start at
unaligned addresses: each row is walked from the 16-byte boundary below its start, with masks
only on its first and last chunk, so the chunks between are unmasked 16-byte vector accesses.
A masked logit leaves a lane's statistics bitwise unchanged, which is why the rotation back by
the row's offset from the boundary is all it takes to make the walk position independent.

No host synchronisation by default: a target outside ``[0, vocab)`` that is not
``ignore_index`` yields a NaN log-probability (a device-side check); ``check_targets=True``
raises a :class:`~mcore_kernels.errors.KernelValueError` instead, at the cost of a host sync.
Eager calls go straight to the launchers; while ``torch.compile`` traces a call it becomes the
custom op ``torch.ops.mcore_kernels.token_logprobs_fwd`` with the registered backward.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    CachedLauncher,
    as_rows,
    jit,
    next_power_of_2,
    on_device_of,
    round_to,
    tl,
)
from mcore_kernels._validation import check_target_range, check_token_logprobs_args
from mcore_kernels._vocab_parallel import combine_shard_stats, group_rank_and_size
from mcore_kernels.reference import token_logprobs_parts, token_logprobs_reference

__all__ = [
    "FORWARD_BLOCK_V",
    "FORWARD_STAGES",
    "FORWARD_WARPS",
    "MAX_BLOCK_V",
    "token_logprobs",
]

MAX_BLOCK_V = 4096
"""Widest vocabulary chunk a program holds in registers at once."""

FORWARD_BLOCK_V = 1024
"""Vocabulary chunk of the forward (narrower for smaller vocabularies); it fixes the order of a
row's sums, so it depends on nothing but the vocabulary size."""

FORWARD_STAGES = 1
"""Software-pipelining depth of the forward's vocabulary loop (``tl.range(num_stages=...)``)."""

FORWARD_WARPS = 4
"""Warps of a forward program."""

_ALIGN_BYTES = 16


@functools.lru_cache(maxsize=64)
def _block_and_warps(vocab: int, backward: bool) -> tuple[int, int]:
    """Vocabulary chunk and warps of one program; a function of the vocabulary size only.

    The forward's chunk also fixes the order in which a row's terms are summed (term ``k`` of a
    row goes to lane ``k mod BLOCK_V``), so it must never depend on the number of rows. Chunks
    are at least 16 elements wide, so the chunk before a row's first 16-byte boundary is never
    narrower than the bytes between them. The forward's 1024-wide chunks and 4 warps were the
    fastest of the H200 sweep (session 9, round-2 probe, plain forward, one CUDA graph): 29.1 /
    75.8 / 194.9 / 550.4 us at [1024 | 8192, 50257 | 151936] bf16 against 32.8 / 80.9 / 205.9 /
    553.6 for 2048 and 8 warps, 41.6-694.5 for 2048 and 4, 38.9-555.7 for 4096 and 16, and
    63.7-1220.6 for 4096 and 8. From the sweep of ``benchmarks/tune_launch_configs.py`` on an
    H200 (results under ``benchmarks/results/nvidia-h200/launch_configs.md``): the backward, which also writes the gradient, streams fastest with 2048-wide chunks and 16 warps
    (1.33 ms against 1.58 ms for 4096 and 8 warps at [8192, 151936] bf16, and 16-21 % faster at
    [1024, 151936] and [8192, 50257]).
    """
    if backward:
        block = max(min(next_power_of_2(vocab), 2048), 16)
        return block, 16 if block >= 2048 else 4
    return max(min(next_power_of_2(vocab), FORWARD_BLOCK_V), 16), FORWARD_WARPS


# The lowest finite float32 (a constexpr: kernels read no other globals).
_LOWEST = tl.constexpr(-3.4028234663852886e38) if tl else None


@jit
def _reference_update(x, ref_scaled, s, w, scale, WITH_ENTROPY: tl.constexpr):
    # Terms relative to the lane's fixed reference: one fused multiply-add, one exponential and
    # one add per logit (a -inf logit adds exp2(-inf) = 0).
    e = tl.exp2(x * scale - ref_scaled)
    s += e
    if WITH_ENTROPY:
        # -inf logits (zero terms) weigh the lowest float: 0 * -inf would be NaN.
        w += e * tl.maximum(x, _LOWEST)
    return s, w


@jit
def _online_update(x, m, s, w, scale, WITH_ENTROPY: tl.constexpr):
    # Per lane: m the largest logit so far, s = sum exp2(scale * (x - m)), w = sum of the same
    # terms times x. One exponential per logit, of the smaller minus the larger of (m, x): the
    # old sums are rescaled by it when x is a new maximum, else it is x's own term.
    new_m = tl.maximum(m, x)
    e = tl.exp2((tl.minimum(m, x) - new_m) * scale)
    up = x > m
    s = tl.where(up, s * e + 1.0, s + e)
    if WITH_ENTROPY:
        xw = tl.maximum(x, _LOWEST)
        w = tl.where(up, w * e + xw, w + e * xw)
    return new_m, s, w


@jit
def _walk_reference(base, end, cols, lead, ref_scaled, scale, WITH_ENTROPY, BLOCK_V, NUM_STAGES):
    s = tl.zeros([BLOCK_V], tl.float32)
    w = tl.zeros([BLOCK_V], tl.float32)
    # First chunk: masked below the row start (and at its end for short rows).
    head = tl.load(base + cols, mask=(cols >= lead) & (cols < end), other=-float("inf"))
    s, w = _reference_update(head.to(tl.float32), ref_scaled, s, w, scale, WITH_ENTROPY)
    full_end = (end // BLOCK_V) * BLOCK_V
    for start in tl.range(BLOCK_V, full_end, BLOCK_V, num_stages=NUM_STAGES):
        x = tl.load(base + start + cols).to(tl.float32)
        s, w = _reference_update(x, ref_scaled, s, w, scale, WITH_ENTROPY)
    if (full_end >= BLOCK_V) & (full_end < end):
        offs = full_end + cols
        tail = tl.load(base + offs, mask=offs < end, other=-float("inf"))
        s, w = _reference_update(tail.to(tl.float32), ref_scaled, s, w, scale, WITH_ENTROPY)
    return s, w


@jit
def _walk_online(base, end, cols, lead, scale, WITH_ENTROPY, BLOCK_V):
    # m starts at the lowest finite float (not -inf): a first term's rescale is then
    # exp2(-huge) = 0 instead of a NaN.
    m = tl.full([BLOCK_V], _LOWEST, tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    w = tl.zeros([BLOCK_V], tl.float32)
    head = tl.load(base + cols, mask=(cols >= lead) & (cols < end), other=-float("inf"))
    m, s, w = _online_update(head.to(tl.float32), m, s, w, scale, WITH_ENTROPY)
    full_end = (end // BLOCK_V) * BLOCK_V
    for start in tl.range(BLOCK_V, full_end, BLOCK_V):
        x = tl.load(base + start + cols).to(tl.float32)
        m, s, w = _online_update(x, m, s, w, scale, WITH_ENTROPY)
    if (full_end >= BLOCK_V) & (full_end < end):
        offs = full_end + cols
        tail = tl.load(base + offs, mask=offs < end, other=-float("inf"))
        m, s, w = _online_update(tail.to(tl.float32), m, s, w, scale, WITH_ENTROPY)
    return m, s, w


@jit(do_not_specialize=["rows"])
def _token_logprobs_fwd_kernel(
    logits_ptr,
    targets_ptr,
    stats_ptr,
    rows,
    first,
    row_stride,
    vocab,
    vocab_start,
    total_vocab,
    ignore_index,
    inv_temperature,
    WITH_ENTROPY: tl.constexpr,
    FULL_VOCAB: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # stats rows: 0 log-prob (or the target logit of a shard), 1 lse, 2 entropy, 3 E[z].
    row = tl.program_id(0).to(tl.int64)
    # ``first``: elements from the 16-byte aligned base pointer to row 0.
    row_start = first + row * row_stride
    lead = row_start % ALIGN
    base = logits_ptr + tl.multiple_of(row_start - lead, ALIGN)
    end = vocab + lead
    cols = tl.arange(0, BLOCK_V)
    scale = inv_temperature * 1.4426950408889634
    # Lane p sees the row's terms k = p - lead, p - lead + BLOCK_V, ... in that order, and only
    # masked (-inf) logits before and after them, which leave its sums bitwise unchanged. Its
    # reference is its first term, logit (p - lead) mod BLOCK_V of the row.
    firsts = (cols + (BLOCK_V - lead)) % BLOCK_V
    ref = tl.load(logits_ptr + row_start + firsts, mask=firsts < vocab, other=0.0).to(tl.float32)
    s, w = _walk_reference(
        base, end, cols, lead, ref * scale, scale, WITH_ENTROPY, BLOCK_V, NUM_STAGES
    )
    # A logit far above its lane's reference (or a -inf / NaN reference) overflows the sums:
    # that row is walked again with a running maximum per lane (exact at any range).
    finite = s < float("inf")
    if WITH_ENTROPY:
        finite = finite & (tl.abs(w) < float("inf"))
    top = ref
    if tl.min(finite.to(tl.int32), axis=0) == 0:
        top, s, w = _walk_online(base, end, cols, lead, scale, WITH_ENTROPY, BLOCK_V)
    # Rotate the lanes back so that lane k holds the terms k, k + BLOCK_V, ... whatever the
    # row's alignment, then reduce: the reductions' inputs are a function of the row's logits
    # only (not of its position, the row count or the entropy flag), hence so are the results.
    lanes = (cols + lead) % BLOCK_V
    top = tl.gather(top, lanes, 0)
    s = tl.gather(s, lanes, 0)
    used = cols < vocab
    row_max = tl.max(tl.where(used, top, -float("inf")), axis=0)
    weights = tl.where(used, tl.exp2((top - row_max) * scale), 0.0)
    total = tl.sum(s * weights, axis=0)
    lse = row_max * inv_temperature + tl.log(total)
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = target != ignore_index
    local = target - vocab_start
    in_shard = valid & (local >= 0) & (local < vocab)
    target_logit = tl.load(
        logits_ptr + row_start + tl.where(in_shard, local, 0), mask=in_shard, other=0.0
    ).to(tl.float32)
    target_logit = tl.where(in_shard, target_logit * inv_temperature, 0.0)
    tl.store(stats_ptr + rows + row, lse)
    if FULL_VOCAB:
        # A target outside the vocabulary gives NaN: checked here, with no host sync.
        out_of_range = valid & ((target < 0) | (target >= total_vocab))
        logprob = tl.where(valid, target_logit - lse, 0.0)
        tl.store(stats_ptr + row, tl.where(out_of_range, float("nan"), logprob))
    else:
        tl.store(stats_ptr + row, target_logit)
    if WITH_ENTROPY:
        w = tl.gather(w, lanes, 0)
        weighted = tl.sum(w * weights, axis=0) * inv_temperature
        expected = weighted / tl.where(total > 0.0, total, 1.0)
        if FULL_VOCAB:
            tl.store(stats_ptr + 2 * rows + row, tl.where(valid, lse - expected, 0.0))
        tl.store(stats_ptr + 3 * rows + row, expected)


@jit
def _logits_grad(
    z, column, local, lse, grad_logprob, grad_entropy, expected, WITH_ENTROPY: tl.constexpr
):
    probs = tl.exp(z - lse)
    dz = tl.where(column == local, grad_logprob, 0.0) - grad_logprob * probs
    if WITH_ENTROPY:
        dz -= grad_entropy * probs * (tl.where(probs > 0.0, z, 0.0) - expected)
    return dz


@jit
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
    ALIGN: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # The gradient has the logits' strides, so both rows share one alignment.
    row = tl.program_id(0).to(tl.int64)
    row_start = row * row_stride
    lead = row_start % ALIGN
    aligned = tl.multiple_of(row_start - lead, ALIGN)
    base = logits_ptr + aligned
    out = grad_logits_ptr + aligned
    end = vocab + lead
    cols = tl.arange(0, BLOCK_V)
    target = tl.load(targets_ptr + row).to(tl.int64)
    # Ignored rows get zero coefficients, hence exactly zero gradient.
    valid = target != ignore_index
    local = target - vocab_start + lead
    lse = tl.load(lse_ptr + row)
    grad_logprob = tl.where(valid, tl.load(grad_logprob_ptr + row).to(tl.float32), 0.0)
    grad_entropy = 0.0
    expected = 0.0
    if WITH_ENTROPY:
        grad_entropy = tl.where(valid, tl.load(grad_entropy_ptr + row).to(tl.float32), 0.0)
        expected = tl.load(expected_ptr + row)
    out_dtype = grad_logits_ptr.dtype.element_ty
    mask = (cols >= lead) & (cols < end)
    z = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temperature
    dz = _logits_grad(z, cols, local, lse, grad_logprob, grad_entropy, expected, WITH_ENTROPY)
    tl.store(out + cols, round_to(dz * inv_temperature, out_dtype), mask=mask)
    full_end = (end // BLOCK_V) * BLOCK_V
    for start in tl.range(BLOCK_V, full_end, BLOCK_V):
        offs = start + cols
        z = tl.load(base + offs).to(tl.float32) * inv_temperature
        dz = _logits_grad(z, offs, local, lse, grad_logprob, grad_entropy, expected, WITH_ENTROPY)
        tl.store(out + offs, round_to(dz * inv_temperature, out_dtype))
    if (full_end >= BLOCK_V) & (full_end < end):
        offs = full_end + cols
        mask = offs < end
        z = tl.load(base + offs, mask=mask, other=-float("inf")).to(tl.float32) * inv_temperature
        dz = _logits_grad(z, offs, local, lse, grad_logprob, grad_entropy, expected, WITH_ENTROPY)
        tl.store(out + offs, round_to(dz * inv_temperature, out_dtype), mask=mask)


_FORWARD = CachedLauncher(_token_logprobs_fwd_kernel)


def _row_stride(logits: torch.Tensor) -> int:
    """Elements between rows: contiguous logits of any rank, or ``[rows, V]`` with strided rows."""
    return logits.shape[-1] if logits.is_contiguous() else logits.stride(0)


_BACKWARD = CachedLauncher(_token_logprobs_bwd_kernel)


def _forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: float,
    group: dist.ProcessGroup | None,
    with_entropy: bool,
    ignore_index: int,
    launch: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward and combine the shards' statistics.

    ``logits`` is contiguous or ``[rows, V]`` with unit stride in ``V``; ``targets`` is
    contiguous with one id per row. Returns ``(logprobs, entropy, lse, expected)``, float32
    shaped like ``targets`` each, the last two over
    the full vocabulary; without ``with_entropy``, ``entropy`` and ``expected`` alias ``lse``.
    ``launch`` overrides ``(BLOCK_V, warps, stages)`` (the tuner's sweep).
    """
    rank, world = group_rank_and_size(group)
    vocab = logits.shape[-1]
    rows = targets.numel()
    # Results take the targets' shape directly: no reshapes on the hot path.
    stats = logits.new_empty((4 if with_entropy else 2, *targets.shape), dtype=torch.float32)
    if rows > 0:
        block, warps = _block_and_warps(vocab, False)
        stages = FORWARD_STAGES
        if launch is not None:
            block, warps, stages = launch
        size = logits.element_size()
        # A view starting off a 16-byte boundary is launched from the boundary below it, so
        # each row's terms meet the same lanes as in a fresh tensor (see the kernel).
        first = (logits.data_ptr() % _ALIGN_BYTES) // size
        if first > logits.storage_offset():
            first = 0  # a storage that starts off the boundary: correct, only unaligned
        if first:
            logits = logits.as_strided(
                logits.shape, logits.stride(), logits.storage_offset() - first
            )
        _FORWARD(
            (rows,),
            (
                logits,
                targets,
                stats,
                rows,
                first,
                _row_stride(logits),
                vocab,
                rank * vocab,
                vocab * world,
                ignore_index,
                inv_temperature,
            ),
            {
                "WITH_ENTROPY": with_entropy,
                "FULL_VOCAB": world == 1,
                "ALIGN": _ALIGN_BYTES // size,
                "BLOCK_V": block,
                "NUM_STAGES": stages,
            },
            warps,
            logits.get_device(),
        )
    if world == 1:
        if with_entropy:
            logprobs, lse, entropy, expected = stats.unbind(0)
            return logprobs, entropy, lse, expected
        logprobs, lse = stats.unbind(0)
        return logprobs, lse, lse, lse
    lse, target_logit, global_expected = combine_shard_stats(
        stats[1], stats[0], stats[3] if with_entropy else None, group
    )
    valid = targets != ignore_index
    zeros = torch.zeros_like(lse)
    out_of_range = valid & ((targets < 0) | (targets >= vocab * world))
    logprobs = torch.where(valid, target_logit - lse, zeros)
    logprobs = torch.where(out_of_range, torch.full_like(lse, float("nan")), logprobs)
    if global_expected is None:
        return logprobs, lse, lse, lse
    return logprobs, torch.where(valid, lse - global_expected, zeros), lse, global_expected


def _backward(
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    expected: torch.Tensor,
    inv_temperature: float,
    vocab_start: int,
    ignore_index: int,
    launch: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Launch the backward: ``d(logits)`` with the logits' shape and strides.

    ``launch`` overrides ``(BLOCK_V, warps)`` (the tuner's sweep).
    """
    vocab = logits.shape[-1]
    rows = targets.numel()
    if logits.is_contiguous():
        grad_logits = torch.empty_like(logits)
    else:
        if logits.stride(0) < vocab:
            # Rows that share memory (an expanded tensor) cannot share a gradient buffer.
            logits = logits.contiguous()
        # The gradient keeps the logits' row stride, so both rows share one alignment.
        grad_logits = torch.empty_strided(
            logits.shape, logits.stride(), dtype=logits.dtype, device=logits.device
        )
    if not grad_logprobs.is_contiguous():
        grad_logprobs = grad_logprobs.contiguous()
    if grad_entropy is None:
        grad_entropy = grad_logprobs
    elif not grad_entropy.is_contiguous():
        grad_entropy = grad_entropy.contiguous()
    if rows > 0:
        block, warps = launch or _block_and_warps(vocab, True)
        _BACKWARD(
            (rows,),
            (
                logits,
                targets,
                lse,
                expected,
                grad_logprobs,
                grad_entropy,
                grad_logits,
                _row_stride(logits),
                vocab,
                vocab_start,
                ignore_index,
                inv_temperature,
            ),
            {
                "WITH_ENTROPY": grad_entropy is not grad_logprobs,
                "ALIGN": _ALIGN_BYTES // logits.element_size(),
                "BLOCK_V": block,
            },
            warps,
            logits.get_device(),
        )
    return grad_logits


class _TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, inv_temperature, group, with_entropy, ignore_index):  # type: ignore[override]
        logprobs, entropy, lse, expected = _forward(
            logits, targets, inv_temperature, group, with_entropy, ignore_index
        )
        ctx.save_for_backward(logits, targets, lse, expected)
        ctx.inv_temperature = inv_temperature
        ctx.with_entropy = with_entropy
        ctx.vocab_start = group_rank_and_size(group)[0] * logits.shape[-1]
        ctx.ignore_index = ignore_index
        return (logprobs, entropy) if with_entropy else logprobs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):  # type: ignore[override]
        logits, targets, lse, expected = ctx.saved_tensors
        with on_device_of(logits):
            grad_logits = _backward(
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


# --- torch.compile: the custom ops -----------------------------------------------------------


def _triton_dispatch(logits: torch.Tensor) -> bool:
    return logits.dtype != torch.float64 and use_triton(logits)


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@_compile.custom_op(
    "token_logprobs_fwd",
    "(Tensor logits, Tensor targets, float temperature, str group_name, bool with_entropy, "
    "int ignore_index, bool check_targets) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _token_logprobs_fwd_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    group_name: str,
    with_entropy: bool,
    ignore_index: int,
    check_targets: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    group = _compile.resolve_group(group_name)
    if check_targets:
        check_target_range(targets, logits.shape[-1] * group_rank_and_size(group)[1], ignore_index)
    if _triton_dispatch(logits):
        with on_device_of(logits):
            logprobs, entropy, lse, expected = _forward(
                as_rows(logits),
                targets.reshape(-1).contiguous(),
                1.0 / temperature,
                group,
                with_entropy,
                ignore_index,
            )
        logprobs = logprobs.reshape(targets.shape)
        entropy = entropy.reshape(targets.shape)
    else:
        parts = token_logprobs_parts(
            logits, targets, temperature, group, with_entropy, ignore_index
        )
        logprobs, entropy, lse, expected = parts  # type: ignore[assignment]
    # Outputs of a custom op may neither alias each other nor be None: copies and empty stand-ins.
    empty = logprobs.new_empty(0)
    return (
        logprobs.clone(),
        entropy.clone() if with_entropy else empty,
        lse.clone(),
        expected.clone() if with_entropy else empty.clone(),
    )


@_compile.custom_op(
    "token_logprobs_bwd",
    "(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, Tensor targets, Tensor lse, "
    "Tensor expected, float temperature, str group_name, int ignore_index) -> Tensor",
)
def _token_logprobs_bwd_op(
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
    group = _compile.resolve_group(group_name)
    if _triton_dispatch(logits):
        rank, _ = group_rank_and_size(group)
        with on_device_of(logits):
            grad = _backward(
                grad_logprobs.reshape(-1),
                grad_entropy.reshape(-1) if grad_entropy is not None else None,
                as_rows(logits),
                targets.reshape(-1).contiguous(),
                lse,
                expected,
                1.0 / temperature,
                rank * logits.shape[-1],
                ignore_index,
            )
        return grad.reshape(logits.shape).contiguous()
    # The torch dispatch differentiates the one reference instead of a second formula.
    with _compile.autograd_inside_op():
        leaf = logits.detach().requires_grad_()
        with_entropy = grad_entropy is not None
        logprobs, entropy, _, _ = token_logprobs_parts(
            leaf, targets, temperature, group, with_entropy, ignore_index
        )
        outputs, grads = [logprobs], [grad_logprobs]
        if entropy is not None and grad_entropy is not None:
            outputs.append(entropy)
            grads.append(grad_entropy)
        (grad,) = torch.autograd.grad(outputs, leaf, grads)
    return grad.contiguous()


@_token_logprobs_fwd_op.register_fake
def _token_logprobs_fwd_fake(
    logits, targets, temperature, group_name, with_entropy, ignore_index, check_targets
):
    dtype = _stats_dtype(logits.dtype)
    rows = targets.numel()
    logprobs = logits.new_empty(targets.shape, dtype=dtype)
    entropy = logits.new_empty(targets.shape if with_entropy else (0,), dtype=dtype)
    expected = logits.new_empty((rows,) if with_entropy else (0,), dtype=dtype)
    return logprobs, entropy, logits.new_empty((rows,), dtype=dtype), expected


@_token_logprobs_bwd_op.register_fake
def _token_logprobs_bwd_fake(grad_logprobs, grad_entropy, logits, targets, lse, expected, *args):
    return logits.new_empty(logits.shape)


def _setup_context(ctx, inputs, output):
    logits, targets, temperature, group_name, with_entropy, ignore_index, _ = inputs
    _, _, lse, expected = output
    ctx.save_for_backward(logits, targets, lse, expected)
    ctx.arguments = (temperature, group_name, ignore_index)
    ctx.with_entropy = with_entropy


def _op_backward(ctx, grad_logprobs, grad_entropy, _grad_lse, _grad_expected):
    logits, targets, lse, expected = ctx.saved_tensors
    grad_logits = _token_logprobs_bwd_op(
        grad_logprobs,
        grad_entropy if ctx.with_entropy else None,
        logits,
        targets,
        lse,
        expected if ctx.with_entropy else lse,
        *ctx.arguments,
    )
    return grad_logits, None, None, None, None, None, None


_token_logprobs_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


# --- public API ---------------------------------------------------------------------------------

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TARGET_DTYPES = (torch.int64, torch.int32)


def _plainly_valid(
    logits: object, targets: object, temperature: object, ignore_index: object
) -> bool:
    """Cheap check of the common valid call; False sends the call through the full checks."""
    return (
        type(temperature) is float
        and 0.0 < temperature < float("inf")
        and type(ignore_index) is int
        and isinstance(logits, torch.Tensor)
        and isinstance(targets, torch.Tensor)
        and logits.dtype in _KERNEL_DTYPES
        and targets.dtype in _TARGET_DTYPES
        and logits.dim() >= 1
        and logits.shape[-1] != 0
        and targets.shape == logits.shape[:-1]
        and targets.device == logits.device
    )


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    check_targets: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of the target tokens, ``log_softmax(logits / temperature)[target]``.

    The Triton path streams each row through a chunked online log-sum-exp, so no float32 copy
    of the logits is ever made, and its backward writes ``d(logits)`` into one logits-sized
    buffer. With ``group`` the logits are this rank's contiguous vocabulary shard (rank ``r`` of
    ``tp`` holds ids ``[r * V, (r + 1) * V)``); the per-row statistics are combined across the
    group in rank order and the backward needs no communication. The default call never waits
    for the GPU (no host synchronisation), so it overlaps with other work and is capturable in
    a CUDA graph.

    Args:
        logits: ``[..., V]`` logits (float16, bfloat16, float32; float64 on the reference), or
            this rank's vocabulary shard of them.
        targets: int64 or int32 global token ids shaped ``logits.shape[:-1]``.
        temperature: logits are divided by it before the softmax.
        group: tensor-parallel process group over which the vocabulary is sharded, or None.
        return_entropy: also return the entropy of each row's distribution.
        ignore_index: rows whose target equals it give 0 (and 0 entropy) and no gradient.
        check_targets: opt-in check that raises on targets outside the vocabulary; it reads a
            flag on the host (a sync on CUDA) and is skipped during CUDA graph capture. Without
            it (the default) such a target is detected on the device and gives a NaN
            log-probability, so a bad id never passes silently.

    Returns:
        float32 log-probabilities shaped like ``targets``; with ``return_entropy`` the pair
        ``(logprobs, entropy)``.

    Raises:
        KernelDtypeError: unsupported dtypes.
        KernelShapeError: ``targets`` does not match ``logits``.
        KernelDeviceError: tensors on different devices.
        KernelValueError: bad ``temperature``, or with ``check_targets`` a target outside the
            vocabulary.
        KernelBackendError: ``MCORE_KERNELS_BACKEND`` asks for a backend that cannot run.
    """
    if _compile.compiling():
        # The range check (a host sync) runs inside the op, when the compiled graph runs.
        check_token_logprobs_args(
            logits, targets, temperature, ignore_index, group=group, check_targets=False
        )
        logprobs, entropy, _, _ = _token_logprobs_fwd_op(
            logits,
            targets,
            float(temperature),
            _compile.group_name(group),
            return_entropy,
            ignore_index,
            check_targets,
        )
        return (logprobs, entropy) if return_entropy else logprobs
    if check_targets or not _plainly_valid(logits, targets, temperature, ignore_index):
        check_token_logprobs_args(
            logits, targets, temperature, ignore_index, group=group, check_targets=check_targets
        )
    if logits.dtype == torch.float64 or not use_triton(logits):
        return token_logprobs_reference(
            logits,
            targets,
            temperature=temperature,
            group=group,
            return_entropy=return_entropy,
            ignore_index=ignore_index,
        )
    if not logits.is_contiguous():
        logits = as_rows(logits)
    if not targets.is_contiguous():
        targets = targets.contiguous()
    inv_temperature = 1.0 / temperature
    with on_device_of(logits):
        if torch.is_grad_enabled() and logits.requires_grad:
            out = _TokenLogprobsFunction.apply(
                logits, targets, inv_temperature, group, return_entropy, ignore_index
            )
        else:
            logprobs, entropy, _, _ = _forward(
                logits, targets, inv_temperature, group, return_entropy, ignore_index
            )
            out = (logprobs, entropy) if return_entropy else logprobs
    # The results already have the targets' shape, also where strided logits became rows.
    return out
