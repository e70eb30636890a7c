"""Plain torch references of every kernel, with the signatures of the public functions.

They define the numerics the Triton kernels are tested against, run on any device, support
float64 (for ``torch.autograd.gradcheck``) and differentiate through torch autograd.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mcore_kernels._validation import (
    check_paged_attention_args,
    check_paged_mla_attention_args,
    check_rms_norm_args,
    check_rotary_kv_write_args,
    check_token_logprobs_args,
    flat_cache_slots,
)
from mcore_kernels._vocab_parallel import combine_shard_stats, group_rank_and_size
from mcore_kernels.errors import KernelShapeError

if TYPE_CHECKING:
    from mcore_kernels.rotary_kv_write import RotaryCacheWrite

__all__ = [
    "rms_norm_reference",
    "rms_norm_parts",
    "token_logprobs_reference",
    "token_logprobs_parts",
    "rotary_embedding_reference",
    "swiglu_pair_reference",
    "paged_attention_reference",
    "paged_mla_attention_reference",
    "rotary_kv_write_reference",
    "slice_after_reference",
    "merge_reference",
    "masked_update_reference",
    "decode_gemv_reference",
    "packed_gemv_reference",
    "greedy_feed_reference",
    "decode_step_metadata_reference",
    "attention_o_proj_reference",
    "row_argmax_reference",
    "normed_swiglu_reference",
    "split_sum_add_rms_norm_reference",
    "normed_qkv_reference",
    "gather_row_pairs_reference",
    "skinny_gemm_reference",
]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm in plain torch.

    ``h = x + residual`` is computed in the input dtype (as Hugging Face Llama/Qwen models do),
    then ``y = h * rsqrt(mean(h**2) + eps) * weight`` in float32 (float64 for float64 input) and
    cast once to the dtype of ``x``.

    Args:
        x: ``[..., hidden]`` input.
        weight: ``[hidden]`` scale.
        eps: added to the mean square before the reciprocal square root.
        residual: optional tensor shaped like ``x`` added to it first.

    Returns:
        ``y`` shaped like ``x``; with ``residual``, the pair ``(y, x + residual)``.

    Raises:
        KernelDtypeError: unsupported dtypes or a residual dtype different from ``x``.
        KernelShapeError: ``weight`` or ``residual`` do not match ``x``.
        KernelDeviceError: tensors on different devices.
        KernelValueError: ``eps`` negative or not finite.
    """
    check_rms_norm_args(x, weight, eps, residual)
    y, hidden, _ = rms_norm_parts(x, weight, eps, residual)
    return y if residual is None else (y, hidden)


def rms_norm_parts(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's result and the statistics its backward depends on.

    Arguments are those of :func:`rms_norm_reference`, already validated.

    Args:
        x: ``[..., hidden]`` input.
        weight: ``[hidden]`` scale.
        eps: added to the mean square before the reciprocal square root.
        residual: optional tensor shaped like ``x``.

    Returns:
        ``(y, hidden, rstd)``: the output, the normalised input ``x + residual`` (``x`` itself
        without residual) and the reciprocal RMS of every row, ``[..., 1]`` in the compute dtype.
    """
    hidden = x if residual is None else x + residual
    compute = _compute_dtype(x.dtype)
    h = hidden.to(compute)
    rstd = torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = (h * rstd * weight.to(compute)).to(x.dtype)
    return y, hidden, rstd


def token_logprobs_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    check_targets: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of the target tokens (and entropies) in plain torch.

    Computes ``log_softmax(logits / temperature)[target]`` per row in float32 (float64 for
    float64 logits). With ``group``, ``logits`` is this rank's contiguous vocabulary shard (rank
    ``r`` of ``tp`` holds ids ``[r * V, (r + 1) * V)``) and ``targets`` are global ids.

    Args:
        logits: ``[..., V]`` logits, or this rank's shard of them.
        targets: integer ids shaped ``logits.shape[:-1]``.
        temperature: logits are divided by it before the softmax.
        group: tensor-parallel process group over which the vocabulary is sharded.
        return_entropy: also return the entropy of each row's distribution.
        ignore_index: rows whose target equals it give 0 (and 0 entropy) and no gradient.
        check_targets: raise on targets outside the vocabulary; this reads a flag on the host
            (a sync on CUDA) and is skipped during CUDA graph capture. Off by default: a target
            outside ``[0, vocab)`` that is not ``ignore_index`` gives a NaN log-probability.

    Returns:
        float32 (float64 for float64 logits) log-probabilities shaped like ``targets``; with
        ``return_entropy`` the pair ``(logprobs, entropy)``.

    Raises:
        KernelDtypeError: unsupported dtypes.
        KernelShapeError: ``targets`` does not match ``logits``.
        KernelDeviceError: tensors on different devices.
        KernelValueError: bad ``temperature`` or a target out of the vocabulary.
    """
    check_token_logprobs_args(
        logits,
        targets,
        temperature,
        ignore_index,
        group=group,
        check_targets=check_targets,
    )
    logprobs, entropy, _, _ = token_logprobs_parts(
        logits, targets, temperature, group, return_entropy, ignore_index
    )
    if not return_entropy:
        return logprobs
    assert entropy is not None
    return logprobs, entropy


def token_logprobs_parts(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    group: dist.ProcessGroup | None,
    return_entropy: bool,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The reference's results and the per-row statistics its backward depends on.

    Arguments are those of :func:`token_logprobs_reference`, already validated.

    Args:
        logits: ``[..., V]`` logits, or this rank's shard of them.
        targets: integer ids shaped ``logits.shape[:-1]``.
        temperature: logits are divided by it before the softmax.
        group: tensor-parallel process group over which the vocabulary is sharded.
        return_entropy: also compute the entropy and the expected logit.
        ignore_index: rows whose target equals it give 0.

    Returns:
        ``(logprobs, entropy, lse, expected)``: the first two shaped like ``targets``, the
        full-vocabulary log-sum-exp and expected logit of every row flattened to ``[N]``;
        ``entropy`` and ``expected`` are None without ``return_entropy``.
    """
    rank, world = group_rank_and_size(group)
    shard = logits.shape[-1]
    lead_shape = targets.shape
    z = logits.reshape(-1, shard).to(_compute_dtype(logits.dtype)) / temperature
    flat_targets = targets.reshape(-1).long()
    valid = flat_targets != ignore_index
    local_ids = flat_targets - rank * shard
    in_shard = valid & (local_ids >= 0) & (local_ids < shard)
    gathered = z.gather(1, local_ids.clamp(0, shard - 1).unsqueeze(1)).squeeze(1)
    target_logit = torch.where(in_shard, gathered, torch.zeros_like(gathered))
    # A row whose (shard of the) logits is all -inf has lse -inf; logsumexp's own gradient
    # there would be nan, so such rows take it from a harmless stand-in row instead.
    all_masked = z.amax(dim=-1) == -float("inf")
    stand_in = torch.where(all_masked.unsqueeze(1), torch.zeros_like(z), z)
    lse = torch.where(
        all_masked,
        torch.full_like(all_masked, -float("inf"), dtype=z.dtype),
        torch.logsumexp(stand_in, dim=-1),
    )
    expected = None
    if return_entropy:
        finite_lse = torch.isfinite(lse)
        safe_lse = torch.where(finite_lse, lse, torch.zeros_like(lse))
        probs = torch.exp(z - safe_lse.unsqueeze(1))
        # exp(-inf) * -inf would be nan (in the value and the gradient): masked logits
        # contribute nothing to the expectation.
        weighted = probs * torch.where(probs > 0, z, torch.zeros_like(z))
        expected = torch.where(finite_lse, weighted.sum(dim=-1), torch.zeros_like(lse))
    lse, target_logit, expected = combine_shard_stats(lse, target_logit, expected, group)
    zeros = torch.zeros_like(lse)
    # A target outside the vocabulary (checked on the device, no host sync) gives NaN.
    out_of_range = valid & ((flat_targets < 0) | (flat_targets >= shard * world))
    logprobs = torch.where(valid, target_logit - lse, zeros)
    logprobs = torch.where(out_of_range, torch.full_like(lse, float("nan")), logprobs)
    logprobs = logprobs.reshape(lead_shape)
    entropy = None
    if expected is not None:
        entropy = torch.where(valid, lse - expected, zeros).reshape(lead_shape)
    return logprobs, entropy, lse, expected


def rotary_embedding_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate the two halves of every head, computed in float32 and rounded once.

    The reference of :func:`mcore_kernels.rotary.rotary_embedding` (Hugging Face's
    "rotate_half" layout).

    Args:
        x: ``[..., T, H, D]`` queries or keys.
        cos: ``[..., T, D // 2]`` float32 cosines.
        sin: ``[..., T, D // 2]`` float32 sines.

    Returns:
        The rotated tensor, shaped and typed like ``x``.
    """
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def swiglu_pair_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` computed in float32 and rounded once to the input dtype.

    The reference of :func:`mcore_kernels.swiglu.swiglu_pair`.

    Args:
        gate: Output of the gate projection.
        up: Output of the up projection, shaped like ``gate``.

    Returns:
        The activation, shaped and typed like ``gate``.
    """
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def slice_after_reference(inp: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`slice_after` (reads ``pos`` on the host).

    Args:
        inp: ``[n, ...]`` source rows.
        pos: one-element integer tensor, the first row of ``inp`` to copy.
        out: ``[m, ...]`` destination, written in place.

    Returns:
        ``out``.
    """
    start = min(max(int(pos.reshape(()).item()), 0), inp.shape[0])
    count = min(inp.shape[0] - start, out.shape[0])
    if count > 0:
        out[:count].copy_(inp[start : start + count])
    return out


def merge_reference(
    a: torch.Tensor, b: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of :func:`merge` (reads ``pos`` on the host).

    Args:
        a: ``[n_a, ...]`` rows kept before ``pos``.
        b: ``[n_b, ...]`` rows written from ``pos`` on.
        pos: one-element integer tensor.
        out: destination, or None to write into ``a``.

    Returns:
        The destination tensor.
    """
    target = a if out is None else out
    start = min(max(int(pos.reshape(()).item()), 0), a.shape[0])
    if start > 0 and target is not a:
        target[:start].copy_(a[:start])
    count = min(b.shape[0], target.shape[0] - start)
    if count > 0:
        target[start : start + count].copy_(b[:count])
    return target


def masked_update_reference(
    states: torch.Tensor, idx: torch.Tensor, new_states: torch.Tensor
) -> torch.Tensor:
    """Torch reference of :func:`masked_update`.

    Args:
        states: ``[num_states, ...]`` table updated in place.
        idx: ``[k]`` slot of each new row, ``-1`` to skip it.
        new_states: ``[k, ...]`` rows to write.

    Returns:
        ``states``.
    """
    keep = (idx >= 0) & (idx < states.shape[0])
    states[idx[keep].long()] = new_states[keep]
    return states


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    split_size: int = 256,
) -> torch.Tensor:
    """Plain torch paged attention: gather each token's context and apply a masked softmax.

    Args:
        q: Query of the new tokens, ``[T, Hq, D]``.
        k_cache: Key cache, ``[num_blocks, block_size, Hkv, D]``.
        v_cache: Value cache, same shape as ``k_cache``.
        block_tables: Physical block of each logical block of each token, ``[T, max_blocks]``.
        context_lens: Number of attended positions per token, ``[T]``, each at least 1.
        scale: Softmax scale applied to the dot products.
        split_size: Accepted for signature parity with the Triton path; the reference does not
            split the context.

    Returns:
        The attention output, ``[T, Hq, D]`` in ``q.dtype``.

    Raises:
        KernelShapeError: If the shapes do not match the layout above.
        KernelDtypeError: If a dtype is unsupported.
    """
    check_paged_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    del split_size
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q.new_empty(q.shape)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    # Host sync is fine here: the reference is the CPU path and the test oracle.
    max_context = int(context_lens.max())
    used_blocks = -(-max_context // block_size)
    tables = block_tables[:, :used_blocks].long()
    length = used_blocks * block_size
    keys = k_cache[tables].reshape(num_tokens, length, num_kv_heads, head_dim).float()
    values = v_cache[tables].reshape(num_tokens, length, num_kv_heads, head_dim).float()
    group = num_q_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=2)
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("thd,tlhd->thl", q.float(), keys) * scale
    positions = torch.arange(length, device=q.device)
    visible = positions[None, :] < context_lens[:, None].to(q.device)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("thl,tlhd->thd", probs, values)
    return out.to(q.dtype)


def paged_mla_attention_reference(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    split_size: int = 256,
) -> torch.Tensor:
    """Plain torch absorbed MLA attention: gather each token's rows, masked softmax in fp32.

    Args:
        q_latent: ``[T, H, R]`` no-position queries mapped into latent space.
        q_rope: ``[T, H, P]`` rotated rotary queries.
        latent_cache: ``[num_blocks, block_size, R + P]`` cached ``c_kv`` and rotary keys.
        block_tables: Physical block of each logical block of each token, ``[T, max_blocks]``.
        context_lens: Number of attended positions per token, ``[T]``, each at least 1.
        scale: Softmax scale applied to the scores.
        split_size: Accepted for signature parity with the Triton path (unused).

    Returns:
        ``[T, H, R]`` in ``q_latent.dtype``.

    Raises:
        KernelShapeError: If the shapes do not match the layout above.
        KernelDtypeError: If a dtype is unsupported.
    """
    check_paged_mla_attention_args(q_latent, q_rope, latent_cache, block_tables, context_lens)
    del split_size
    num_tokens, _, rank = q_latent.shape
    if num_tokens == 0:
        return q_latent.new_empty(q_latent.shape)
    block_size = latent_cache.shape[1]
    # Host sync is fine here: the reference is the CPU path and the test oracle.
    used_blocks = -(-int(context_lens.max()) // block_size)
    rows = latent_cache[block_tables[:, :used_blocks].long()].float()
    rows = rows.reshape(num_tokens, used_blocks * block_size, -1)
    c_kv, k_rope = rows[..., :rank], rows[..., rank:]
    scores = torch.einsum("thr,tsr->ths", q_latent.float(), c_kv)
    scores = (scores + torch.einsum("thp,tsp->ths", q_rope.float(), k_rope)) * scale
    positions = torch.arange(rows.shape[1], device=rows.device)
    visible = positions[None, :] < context_lens[:, None].to(rows.device)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    out = torch.einsum("ths,tsr->thr", torch.softmax(scores, dim=-1), c_kv)
    return out.to(q_latent.dtype)


def rotary_kv_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Torch reference of :func:`rotary_kv_write` (the unfused ops it replaces).

    Args:
        q: ``[T, Hq, D]`` new queries.
        k: ``[T, Hkv, D]`` new keys.
        v: ``[T, Hkv, D]`` new values.
        cos: float32 ``[T, D // 2]`` RoPE cosines.
        sin: float32 ``[T, D // 2]`` RoPE sines.
        k_cache: One layer's key cache ``[num_blocks, block_size, Hkv, D]`` (written in place).
        v_cache: One layer's value cache, shaped like ``k_cache`` (written in place).
        slot_mapping: ``[T]`` flat cache slot of each token.

    Returns:
        The rotated queries ``[T, Hq, D]``.

    Raises:
        KernelShapeError: If the shapes do not match the layout above.
        KernelDtypeError: If a dtype is unsupported.
    """
    check_rotary_kv_write_args(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        c = cos.to(x.dtype)[:, None]
        s = sin.to(x.dtype)[:, None]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    slots = slot_mapping.long()
    flat_cache_slots(k_cache, "k_cache").index_copy_(0, slots, rotate(k).to(k_cache.dtype))
    flat_cache_slots(v_cache, "v_cache").index_copy_(0, slots, v.to(v_cache.dtype))
    return rotate(q)


def decode_gemv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[RMSNorm] -> x @ weight.T + bias -> [SwiGLU] -> [+ residual]`` in plain torch.

    The norm is :func:`rms_norm_reference`; the projection accumulates in float32 (float64 for
    float64 input) and rounds once to the dtype of ``x`` after the bias; SwiGLU
    (``silu(gate) * up`` of the gate half then the up half of the output, in float32) and the
    residual add each round once more.

    Args:
        x: ``[M, K]`` input rows.
        weight: ``[N, K]`` weight (gate rows then up rows with ``swiglu``).
        bias: Optional ``[N]`` bias.
        norm_weight: Optional ``[K]`` RMSNorm weight applied to ``x`` first.
        norm_eps: RMSNorm epsilon.
        swiglu: Return ``silu(gate) * up`` (``[M, N // 2]``).
        residual: Optional ``[M, N_out]`` tensor added to the result.

    Returns:
        ``[M, N_out]`` in the dtype of ``x``.

    Raises:
        KernelShapeError: If ``x`` and ``weight`` do not share ``K``.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise KernelShapeError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}; expected [M, K] and [N, K]"
        )
    dtype = x.dtype
    compute = _compute_dtype(dtype)
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, norm_eps)  # type: ignore[assignment]
    y = x.to(compute) @ weight.to(compute).T
    if bias is not None:
        y = y + bias.to(compute)
    y = y.to(dtype)
    if swiglu:
        gate, up = y.to(compute).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up).to(dtype)
    if residual is not None:
        y = (y.to(compute) + residual.to(compute)).to(dtype)
    return y


def packed_gemv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[RMSNorm] -> x @ weight.T -> [SwiGLU] -> [+ residual]``: the packed-weight decode
    projection (:mod:`mcore_kernels.packed_gemv`) in plain torch.

    The arithmetic of :func:`decode_gemv_reference` without a bias: the norm in float32
    rounded to the dtype of ``x``, float32 products rounded once, SwiGLU and the residual add
    rounded once more each.

    Args:
        x: ``[M, K]`` input rows.
        weight: ``[N, K]`` weight (gate rows then up rows with ``swiglu``).
        norm_weight: Optional ``[K]`` RMSNorm weight applied to ``x`` first.
        norm_eps: RMSNorm epsilon.
        swiglu: Return ``silu(gate) * up`` (``[M, N // 2]``).
        residual: Optional ``[M, N_out]`` tensor added to the result.

    Returns:
        ``[M, N_out]`` in the dtype of ``x``.

    Raises:
        KernelShapeError: If ``x`` and ``weight`` do not share ``K``.
    """
    return decode_gemv_reference(
        x, weight, norm_weight=norm_weight, norm_eps=norm_eps, swiglu=swiglu, residual=residual
    )


def row_argmax_reference(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`mcore_kernels.row_argmax.row_argmax`.

    Args:
        x: ``[rows, columns]`` float values.

    Returns:
        int64 ``[rows]``: ``torch.argmax(x, dim=-1)`` (the first index of the largest value,
        NaN counting as the largest).
    """
    return x.argmax(dim=-1)


def greedy_feed_reference(
    x: torch.Tensor, samples: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Torch reference of :func:`mcore_kernels.row_argmax.greedy_feed`.

    Args:
        x: ``[rows, columns]`` float values.
        samples: float64 ``[rows]``: receives the indices.
        tokens: int64 ``[rows]``: receives the indices.
        positions: int64 ``[rows]``: incremented by one.

    Returns:
        int64 ``[rows]``: ``torch.argmax(x, dim=-1)``.
    """
    index = x.argmax(dim=-1)
    samples.copy_(index)
    tokens.copy_(index)
    positions.add_(1)
    return index


def decode_step_metadata_reference(
    block_tables: torch.Tensor, positions: torch.Tensor, table_rows: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`mcore_kernels.decode_step_metadata.decode_step_metadata`.

    Args:
        block_tables: int32 ``[rows, W]`` block table.
        positions: Integer ``[T]`` position of each new token.
        table_rows: Integer ``[T]`` block-table row of each token's request.
        block_size: Positions per cache block.

    Returns:
        ``(slot_mapping, tables, context_lens)``: int64 ``[T]``, int32 ``[T, W]`` and int32
        ``[T]``.
    """
    tables = block_tables.index_select(0, table_rows)
    blocks = tables.gather(1, (positions // block_size)[:, None])[:, 0]
    slot_mapping = blocks.long() * block_size + positions % block_size
    return slot_mapping, tables, (positions + 1).to(torch.int32)


def attention_o_proj_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scale: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unfused ops in plain torch: paged attention, then the projection and residual add.

    Args:
        q: ``[T, Hq, D]`` rotated queries.
        k_cache: ``[num_blocks, block_size, Hkv, D]`` keys.
        v_cache: Values shaped like ``k_cache``.
        block_tables: ``[T, max_blocks]`` block table rows.
        context_lens: ``[T]`` attended positions per token.
        weight: ``[N, Hq * D]`` output projection.
        bias: Optional ``[N]`` bias.
        scale: Multiplier of the query-key products.
        residual: Optional ``[T, N]`` tensor added to the projection.

    Returns:
        ``[T, N]`` in the dtype of ``q``.
    """
    attended = paged_attention_reference(
        q, k_cache, v_cache, block_tables, context_lens, scale=scale
    )
    return decode_gemv_reference(attended.flatten(1), weight, bias, residual=residual)


def split_sum_add_rms_norm_reference(
    partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`split_sum_add_rms_norm` (same roundings, same sum order)."""
    total = partials[0]
    for part in partials[1:]:
        total = total + part
    hidden = (total.to(residual.dtype).float() + residual.float()).to(residual.dtype)
    h = hidden.float()
    rstd = 1.0 / torch.sqrt((h * h).sum(-1, keepdim=True) / h.shape[-1] + eps)
    return (h * rstd * weight.float()).to(residual.dtype), hidden


def normed_qkv_reference(
    qkv: torch.Tensor, x: torch.Tensor, eps: float, bias: torch.Tensor | None
) -> torch.Tensor:
    """``rstd(x) * qkv + bias`` in float32, rounded once to the dtype of ``qkv``.

    Args:
        qkv: ``[T, N]`` product of ``x`` with the norm-folded q/k/v weight.
        x: ``[T, H]`` rows the product was computed from.
        eps: The folded norm's epsilon.
        bias: ``[N]`` projection bias, or None.

    Returns:
        ``[T, N]`` in the dtype of ``qkv``: the projection of the normed rows.
    """
    h = x.float()
    rstd = 1.0 / torch.sqrt((h * h).sum(-1, keepdim=True) / h.shape[-1] + eps)
    out = qkv.float() * rstd
    if bias is not None:
        out = out + bias.float()
    return out.to(qkv.dtype)


def normed_swiglu_reference(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference of :func:`normed_swiglu` (float32 math, one rounding at the end).

    Args:
        gate_up: ``[M, 2F]`` product of ``x`` with the norm-folded gate then up weights.
        x: ``[M, H]`` rows the product was computed from.
        eps: The folded norm's epsilon.

    Returns:
        ``[M, F]`` in the dtype of ``gate_up``.
    """
    h = x.float()
    rstd = 1.0 / torch.sqrt((h * h).sum(-1, keepdim=True) / h.shape[-1] + eps)
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate * rstd
    up = up * rstd
    return (gate / (1.0 + torch.exp(-gate)) * up).to(gate_up.dtype)


def gather_row_pairs_reference(
    a: torch.Tensor, a_index: torch.Tensor, b: torch.Tensor, b_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`mcore_kernels.gather_rows.gather_row_pairs` (exact copies).

    Args:
        a: ``[rows_a, cols_a]`` table.
        a_index: Integer ``[T]`` rows of ``a``.
        b: ``[rows_b, cols_b]`` table.
        b_index: Integer ``[T]`` rows of ``b``.

    Returns:
        ``(a.index_select(0, a_index), b.index_select(0, b_index))``.
    """
    return a.index_select(0, a_index), b.index_select(0, b_index)


def skinny_gemm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    splits: int = 1,
    rope: RotaryCacheWrite | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Torch reference of :func:`skinny_gemm` (float32 products, the same roundings).

    Args:
        x: ``[M, K]`` activations.
        weight: ``[N, K]`` weight.
        bias: Optional ``[N]``.
        residual: Optional ``[M, N]`` added before the rounding.
        splits: Float32 partials over this many K slices of whole ``block_k`` blocks (see
            :func:`skinny_gemm`); 1: one rounded output.
        rope: RoPE and the cache write of a q/k/v projection (see :func:`skinny_gemm`).
        block_k: The K block of the slices (None: :class:`SkinnyGemmConfig`'s default).

    Returns:
        ``[M, N]`` in the dtype of ``x``, float32 ``[splits, M, N]``, or with ``rope`` the
        rotated queries ``[M, Hq * D]``.
    """
    from mcore_kernels.skinny_gemm import SkinnyGemmConfig, _split_bounds

    if rope is not None:
        qkv = skinny_gemm_reference(x, weight, bias=bias)
        q, k, v = rope.split(qkv)
        rotated = rotary_kv_write_reference(
            q, k, v, rope.cos, rope.sin, rope.k_cache, rope.v_cache, rope.slot_mapping
        )
        return rotated.flatten(1)
    if splits > 1:
        bounds = _split_bounds(x.shape[1], splits, block_k or SkinnyGemmConfig().block_k)
        return torch.stack([x[:, a:b].float() @ weight[:, a:b].float().T for a, b in bounds])
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    if residual is not None:
        out = out + residual.float()
    return out.to(x.dtype)


def rotary_paged_attention_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    num_q_heads: int,
    scale: float,
    norm_input: tuple[torch.Tensor, float] | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of :func:`mcore_kernels.rotary_paged_attention.rotary_paged_attention`.

    Finishes a norm-folded projection (:func:`normed_qkv_reference`) when ``norm_input`` is
    given, rotates and stores like :func:`rotary_kv_write_reference`, then attends like
    :func:`paged_attention_reference`.

    Args:
        qkv: ``[T, (Hq + 2 Hkv) * D]`` q/k/v projection output.
        cos: float32 ``[T, D // 2]`` RoPE cosines.
        sin: float32 ``[T, D // 2]`` RoPE sines.
        k_cache: One layer's key cache ``[num_blocks, block_size, Hkv, D]`` (written in place).
        v_cache: One layer's value cache, shaped like ``k_cache`` (written in place).
        slot_mapping: ``[T]`` flat cache slot of each token.
        block_tables: int32 ``[T, max_blocks]`` block table rows.
        context_lens: int32 ``[T]`` attended positions (the new token included).
        num_q_heads: Query heads ``Hq``.
        scale: Multiplier of the query-key products.
        norm_input: ``(x, eps)``: ``qkv`` is ``x @ (W * w).T`` of the residual rows ``x``.
        bias: ``[(Hq + 2 Hkv) * D]`` q/k/v bias (only with ``norm_input``), or None.

    Returns:
        ``[T, Hq, D]`` attention output in the dtype of ``qkv``.
    """
    num_kv_heads, head_dim = int(k_cache.shape[2]), int(k_cache.shape[3])
    if norm_input is not None:
        qkv = normed_qkv_reference(qkv, norm_input[0], norm_input[1], bias)
    q, k, v = qkv.split(
        [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    rotated = rotary_kv_write_reference(
        q.unflatten(-1, (-1, head_dim)),
        k.unflatten(-1, (-1, head_dim)),
        v.unflatten(-1, (-1, head_dim)),
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
    )
    return paged_attention_reference(
        rotated, k_cache, v_cache, block_tables, context_lens, scale=scale
    )
