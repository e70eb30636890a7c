"""Triton kernels of the fused MoE operations (launchers in :mod:`mcore_kernels.moe`).

All gathers read through an index and write each output element once: no atomics except the
integer expert counts of the router, whose result does not depend on the order of the adds.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mcore_kernels._triton_utils import gdc_launch_dependents, gdc_wait

__all__ = [
    "gather_rows_kernel",
    "router_backward_kernel",
    "router_kernel",
    "sum_rows_kernel",
    "swiglu_backward_kernel",
    "swiglu_forward_kernel",
    "weight_grad_kernel",
    "weighted_swiglu_backward_kernel",
    "weighted_swiglu_forward_kernel",
]


@triton.jit
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


@triton.jit
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


@triton.jit
def gather_rows_kernel(
    src_ptr,
    index_ptr,
    scale_ptr,
    out_ptr,
    num_rows,
    hidden,
    INDEX_DIV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[r] = src[index[r] // INDEX_DIV] (* scale[index[r]])``, zero where index < 0, for
    ``ROWS`` rows and ``BLOCK_H`` columns."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < num_rows
    col_ok = cols < hidden
    index = tl.load(index_ptr + rows, mask=row_ok, other=-1)
    valid = index >= 0
    source = tl.where(valid, index // INDEX_DIV, 0).to(tl.int64)
    values = tl.load(
        src_ptr + source[:, None] * hidden + cols[None, :],
        mask=valid[:, None] & col_ok[None, :],
        other=0.0,
    )
    if HAS_SCALE:
        # Index 0 always exists; invalid rows are zero already.
        scale = tl.load(scale_ptr + tl.where(valid, index, 0), mask=row_ok, other=0.0)
        values = (values.to(tl.float32) * scale.to(tl.float32)[:, None]).to(values.dtype)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :],
        values,
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def sum_rows_kernel(
    src_ptr,
    slots_ptr,
    weights_ptr,
    out_ptr,
    num_tokens,
    hidden,
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[t] = sum_j (w[t, j] *) src[slots[t * TOP_K + j]]`` over valid slots, in float32,
    for ``ROWS`` tokens and ``BLOCK_H`` columns."""
    tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_ok = tokens < num_tokens
    col_ok = cols < hidden
    acc = tl.zeros((ROWS, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(slots_ptr + tokens * TOP_K + j, mask=token_ok, other=-1)
        valid = slot >= 0
        row = tl.where(valid, slot, 0).to(tl.int64)
        values = tl.load(
            src_ptr + row[:, None] * hidden + cols[None, :],
            mask=valid[:, None] & col_ok[None, :],
            other=0.0,
        )
        values = values.to(tl.float32)
        if HAS_WEIGHTS:
            weight = tl.load(weights_ptr + tokens * TOP_K + j, mask=token_ok, other=0.0)
            values = values * weight.to(tl.float32)[:, None]
        acc += values
    tl.store(
        out_ptr + tokens.to(tl.int64)[:, None] * hidden + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=token_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def weight_grad_kernel(
    grad_ptr,
    y_ptr,
    slots_ptr,
    out_ptr,
    hidden,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[t, j] = dot(grad[t], y[slots[t * TOP_K + j]])`` (zero for dropped slots)."""
    token = tl.program_id(0)
    base = tl.arange(0, BLOCK_H)
    for j in tl.static_range(TOP_K):
        slot = tl.load(slots_ptr + token * TOP_K + j)
        valid = slot >= 0
        row = tl.where(valid, slot, 0).to(tl.int64)
        limit = tl.where(valid, hidden, 0)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            cols = start + base
            col_ok = cols < hidden
            g = tl.load(grad_ptr + token.to(tl.int64) * hidden + cols, mask=col_ok, other=0.0)
            y = tl.load(y_ptr + row * hidden + cols, mask=cols < limit, other=0.0)
            acc += g.to(tl.float32) * y.to(tl.float32)
        tl.store(out_ptr + token * TOP_K + j, tl.sum(acc, axis=0))


@triton.jit
def swiglu_forward_kernel(
    gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False
):
    """``out[m] = silu(gate_up[m, :F]) * gate_up[m, F:]`` for one row block of columns.

    ``USE_PDL``: launched with programmatic dependent launch; wait for the previous kernel (the
    gate/up GEMM) before reading its output or writing anything."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def swiglu_backward_kernel(gate_up_ptr, grad_ptr, out_ptr, width, BLOCK: tl.constexpr):
    """Gradient of :func:`swiglu_forward_kernel` with respect to ``gate_up``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=ok, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + row * width + cols, mask=ok, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    d_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = grad * silu
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * 2 * width + cols, d_gate.to(dtype), mask=ok)
    tl.store(out_ptr + row * 2 * width + width + cols, d_up.to(dtype), mask=ok)


@triton.jit
def weighted_swiglu_forward_kernel(gate_up_ptr, w_ptr, out_ptr, width, BLOCK: tl.constexpr):
    """``out[m] = w[m] * silu(gate_up[m, :F]) * gate_up[m, F:]`` for one row block of columns."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=ok, other=0.0).to(tl.float32)
    weight = tl.load(w_ptr + row).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up * weight
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def weighted_swiglu_backward_kernel(
    gate_up_ptr, w_ptr, grad_ptr, out_ptr, grad_w_ptr, width, BLOCK: tl.constexpr
):
    """Gradients of :func:`weighted_swiglu_forward_kernel` for one row: ``gate_up`` (``[2F]``)
    and the row weight (a float32 sum over the row's columns in one program: no atomics)."""
    row = tl.program_id(0).to(tl.int64)
    base = tl.arange(0, BLOCK)
    weight = tl.load(w_ptr + row).to(tl.float32)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    dtype = out_ptr.dtype.element_ty
    for start in range(0, width, BLOCK):
        cols = start + base
        ok = cols < width
        gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=ok, other=0.0).to(
            tl.float32
        )
        grad = tl.load(grad_ptr + row * width + cols, mask=ok, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        silu = gate * sig
        acc += grad * silu * up
        scaled = grad * weight
        d_gate = scaled * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(out_ptr + row * 2 * width + cols, d_gate.to(dtype), mask=ok)
        tl.store(out_ptr + row * 2 * width + width + cols, (scaled * silu).to(dtype), mask=ok)
    tl.store(grad_w_ptr + row, tl.sum(acc, axis=0))
