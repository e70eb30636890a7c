"""Per-token log-probabilities (and entropies) over a full or vocabulary-parallel vocabulary."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._token_logprobs_op import token_logprobs_via_op
from mcore_kernels._validation import check_token_logprobs_args
from mcore_kernels.reference import token_logprobs_reference

__all__ = ["token_logprobs"]


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    check_targets: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of the target tokens, ``log_softmax(logits / temperature)[target]``.

    The Triton path streams each row through a chunked online log-sum-exp, so no float32 copy
    of the logits is ever made, and its backward writes ``d(logits)`` into one logits-sized
    buffer. With ``group`` the logits are this rank's contiguous vocabulary shard (rank ``r`` of
    ``tp`` holds ids ``[r * V, (r + 1) * V)``); the per-row statistics are combined across the
    group in rank order and the backward needs no communication.

    Args:
        logits: ``[..., V]`` logits (float16, bfloat16, float32; float64 on the reference), or
            this rank's vocabulary shard of them.
        targets: int64 or int32 global token ids shaped ``logits.shape[:-1]``.
        temperature: logits are divided by it before the softmax.
        group: tensor-parallel process group over which the vocabulary is sharded, or None.
        return_entropy: also return the entropy of each row's distribution.
        ignore_index: rows whose target equals it give 0 (and 0 entropy) and no gradient.
        check_targets: raise on targets outside the vocabulary; this reads a flag on the host
            (a sync on CUDA) and is skipped during CUDA graph capture. With False, out-of-range
            targets give meaningless values instead of an error.

    Returns:
        float32 log-probabilities shaped like ``targets``; with ``return_entropy`` the pair
        ``(logprobs, entropy)``.

    Raises:
        KernelDtypeError: unsupported dtypes.
        KernelShapeError: ``targets`` does not match ``logits``.
        KernelDeviceError: tensors on different devices.
        KernelValueError: bad ``temperature`` or a target outside the vocabulary.
        KernelBackendError: ``MCORE_KERNELS_BACKEND`` asks for a backend that cannot run.
    """
    check_token_logprobs_args(
        logits,
        targets,
        temperature,
        ignore_index,
        group=group,
        # Under torch.compile the range check (a host sync) runs inside the op.
        check_targets=check_targets and not _compile.compiling(),
    )
    if _compile.compiling():
        if _compile.CUSTOM_OPS:
            return token_logprobs_via_op(
                logits,
                targets,
                temperature,
                _compile.group_name(group),
                return_entropy,
                ignore_index,
                check_targets,
            )
        return _compile.run_eagerly(
            token_logprobs,
            logits,
            targets,
            temperature=temperature,
            group=group,
            return_entropy=return_entropy,
            ignore_index=ignore_index,
            check_targets=check_targets,
        )
    if logits.dtype != torch.float64 and use_triton(logits, targets):
        from mcore_kernels._token_logprobs_triton import token_logprobs_triton

        return token_logprobs_triton(
            logits,
            targets,
            temperature=float(temperature),
            group=group,
            return_entropy=return_entropy,
            ignore_index=ignore_index,
        )
    return token_logprobs_reference(
        logits,
        targets,
        temperature=temperature,
        group=group,
        return_entropy=return_entropy,
        ignore_index=ignore_index,
        check_targets=False,  # checked above
    )
