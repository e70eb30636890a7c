"""The decode projection's Triton kernels: :func:`_gemv_kernel` (prologue, weight streaming,
epilogue, and the split-K ticket sum) and :func:`_sum_partials_kernel` (the split-K sum as a
second kernel), with their cached launchers and the split-K tickets."""

from __future__ import annotations

import torch

from mcore_kernels._triton_utils import CachedLauncher, gdc_launch_dependents, gdc_wait, jit, tl
from mcore_kernels.decode_gemv_epilogues import (
    _early_bias,
    _early_inputs,
    _epilogue,
    _rope_epilogue,
)
from mcore_kernels.decode_gemv_tiles import _accumulate, _load_tile, _row_scales


@jit(do_not_specialize=("M", "N_OUT", "SPLIT_K"))
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_ptr,
    res_ptr,
    out_ptr,
    ws_ptr,
    ticket_ptr,
    M,
    N_OUT,
    K,
    K_SPLIT,
    SPLIT_K,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    eps,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_cos,
    stride_sin,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    NUM_Q_HEADS,
    NUM_KV_HEADS,
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    ROPE: tl.constexpr,
    PAIRED: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr,
    STORE_PARTIALS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    K_ALIGNED: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY: tl.constexpr,
    EARLY_TAIL: tl.constexpr = False,
):
    if USE_PDL:
        # Let the next kernel's programs start (and prefetch their own weights) early.
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    dtype = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    # Rows past N_OUT read row 0 (never stored): the loads stay unmasked along N.
    if ROPE:
        # Columns are (first half, second half) channel pairs of the q/k/v heads.
        pair = tl.where(n_mask, offs_n, 0)
        first_rows = (pair // HALF) * (2 * HALF) + pair % HALF
        w_rows = first_rows.to(tl.int64) * stride_wn
        up_rows = (first_rows + HALF).to(tl.int64) * stride_wn
    else:
        w_rows = tl.where(n_mask, offs_n, 0).to(tl.int64) * stride_wn
        up_rows = (tl.where(n_mask, offs_n, 0) + N_OUT).to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    if K_ALIGNED:
        # K and K_SPLIT are multiples of 16: so is the end, and the tail's masks vectorise.
        k_end = tl.multiple_of(k_end, 16)
    k_full = k_begin + ((k_end - k_begin) // BLOCK_K) * BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    scales = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM or USE_PDL or EARLY_TAIL:
        # The first weight tile is requested before the norm's reduction over the rows, so
        # the two memory latencies overlap; with programmatic dependent launch it is requested
        # before waiting for the previous kernel (the weights do not depend on it, the rows do).
        first = k_begin + offs_k
        if k_full > k_begin:
            w, w_up = _load_tile(w_ptr, w_rows, up_rows, first, k_end, PAIRED, False)
        else:
            w, w_up = _load_tile(w_ptr, w_rows, up_rows, first, k_end, PAIRED, True)
        gamma = scales
        if EARLY and HAS_NORM:
            # Constants of the step (weights) before the wait, like the weight tile.
            gamma = tl.load(norm_ptr + first, mask=first < k_end, other=0.0).to(tl.float32)
        if EARLY:
            pre_bias, pre_bias_up = _early_bias(
                bias_ptr, offs_n, n_mask, N_OUT, HAS_BIAS, ROPE, SWIGLU, HALF
            )
        tail_w = w
        tail_w_up = w_up
        if EARLY_TAIL:
            # One full tile and a tail (set by the launcher): the tail's weights are requested
            # before the wait too, so the program holds its whole slice of the weight.
            tail_w, tail_w_up = _load_tile(
                w_ptr, w_rows, up_rows, k_full + offs_k, k_end, PAIRED, True
            )
        if USE_PDL:
            gdc_wait()
        if EARLY:
            # What the previous kernels wrote, requested at once after the wait (the
            # epilogue would otherwise request it after the products).
            pre_res, pre_cos, pre_sin = _early_inputs(
                res_ptr, cos_ptr, sin_ptr, offs_m, offs_n, m_mask, n_mask, stride_rm,
                stride_cos, stride_sin, HAS_RESIDUAL, ROPE, HALF,
            )  # fmt: skip
        if HAS_NORM:
            scales = _row_scales(x_ptr, offs_m, m_mask, K, stride_xm, eps, BLOCK_M, NORM_BLOCK)
        acc, acc_up = _accumulate(
            acc, acc_up, w, w_up, x_ptr, w_ptr, norm_ptr, scales, offs_m, m_mask, w_rows,
            up_rows, first, k_end, M, stride_xm, pid_m,
            HAS_NORM, PAIRED, BLOCK_M, USE_DOT, True, DOT_PRECISION, UPCAST_DOT, True,
            gamma, EARLY and HAS_NORM,
        )  # fmt: skip
        k_begin = tl.minimum(k_begin + BLOCK_K, k_end)
        k_full = tl.maximum(k_full, k_begin)
    for start in range(k_begin, k_full, BLOCK_K):
        acc, acc_up = _accumulate(
            acc, acc_up, acc, acc, x_ptr, w_ptr, norm_ptr, scales, offs_m, m_mask, w_rows,
            up_rows, start + offs_k, k_end, M, stride_xm, pid_m,
            HAS_NORM, PAIRED, BLOCK_M, USE_DOT, False, DOT_PRECISION, UPCAST_DOT, False,
            scales, False,
        )  # fmt: skip
    if EARLY_TAIL:
        acc, acc_up = _accumulate(
            acc, acc_up, tail_w, tail_w_up, x_ptr, w_ptr, norm_ptr, scales, offs_m, m_mask,
            w_rows, up_rows, k_full + offs_k, k_end, M, stride_xm, pid_m,
            HAS_NORM, PAIRED, BLOCK_M, USE_DOT, True, DOT_PRECISION, UPCAST_DOT, True,
            scales, False,
        )  # fmt: skip
    elif k_full < k_end:
        acc, acc_up = _accumulate(
            acc, acc_up, acc, acc, x_ptr, w_ptr, norm_ptr, scales, offs_m, m_mask, w_rows,
            up_rows, k_full + offs_k, k_end, M, stride_xm, pid_m,
            HAS_NORM, PAIRED, BLOCK_M, USE_DOT, True, DOT_PRECISION, UPCAST_DOT, False,
            scales, False,
        )  # fmt: skip
    if not HAS_SPLIT:
        if EARLY:
            if ROPE:
                _rope_epilogue(
                    acc, acc_up, bias_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr,
                    v_cache_ptr, stride_cos, stride_sin, stride_kc_slot, stride_kc_head,
                    stride_vc_slot, stride_vc_head, offs_m, offs_n, m_mask, N_OUT, stride_om,
                    NUM_Q_HEADS, NUM_KV_HEADS, HAS_BIAS, HALF, dtype,
                    pre_bias, pre_bias_up, pre_cos, pre_sin, True,
                )  # fmt: skip
            else:
                _epilogue(
                    acc, acc_up, bias_ptr, res_ptr, out_ptr, offs_m, offs_n, m_mask, N_OUT,
                    stride_rm, stride_om, HAS_BIAS, HAS_RESIDUAL, SWIGLU, dtype,
                    pre_bias, pre_bias_up, pre_res, True,
                )  # fmt: skip
        elif ROPE:
            _rope_epilogue(
                acc, acc_up, bias_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr,
                v_cache_ptr, stride_cos, stride_sin, stride_kc_slot, stride_kc_head,
                stride_vc_slot, stride_vc_head, offs_m, offs_n, m_mask, N_OUT, stride_om,
                NUM_Q_HEADS, NUM_KV_HEADS, HAS_BIAS, HALF, dtype,
                acc, acc, acc, acc, False,
            )  # fmt: skip
        else:
            _epilogue(
                acc, acc_up, bias_ptr, res_ptr, out_ptr, offs_m, offs_n, m_mask, N_OUT,
                stride_rm, stride_om, HAS_BIAS, HAS_RESIDUAL, SWIGLU, dtype,
                acc, acc, acc, False,
            )  # fmt: skip
    else:
        # Workspace [SPLIT_K, 2, M, N_OUT] float32: the gate (or only) partial, then the up one.
        tile = offs_m[:, None] * N_OUT + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        plane = M * N_OUT
        tl.store(ws_ptr + (pid_k * 2) * plane + tile, acc, mask=mask)
        if PAIRED:
            tl.store(ws_ptr + (pid_k * 2 + 1) * plane + tile, acc_up, mask=mask)
        if not STORE_PARTIALS:
            # Every thread's partial is written before the ticket (release) is taken.
            tl.debug_barrier()
            ticket = ticket_ptr + pid_m * tl.num_programs(0) + pid_n
            arrived = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                total_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in range(SPLIT_K):
                    total += tl.load(
                        ws_ptr + (s * 2) * plane + tile, mask=mask, other=0.0, cache_modifier=".cg"
                    )
                    if PAIRED:
                        total_up += tl.load(
                            ws_ptr + (s * 2 + 1) * plane + tile,
                            mask=mask,
                            other=0.0,
                            cache_modifier=".cg",
                        )
                if ROPE:
                    _rope_epilogue(
                        total, total_up, bias_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr,
                        k_cache_ptr, v_cache_ptr, stride_cos, stride_sin, stride_kc_slot,
                        stride_kc_head, stride_vc_slot, stride_vc_head, offs_m, offs_n, m_mask,
                        N_OUT, stride_om, NUM_Q_HEADS, NUM_KV_HEADS, HAS_BIAS, HALF, dtype,
                        total, total, total, total, False,
                    )  # fmt: skip
                else:
                    _epilogue(
                        total, total_up, bias_ptr, res_ptr, out_ptr, offs_m, offs_n, m_mask,
                        N_OUT, stride_rm, stride_om, HAS_BIAS, HAS_RESIDUAL, SWIGLU, dtype,
                        total, total, total, False,
                    )  # fmt: skip
                # Reset for the next launch (graph replays reuse the tickets).
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")


@jit(do_not_specialize=("M", "N_OUT", "SPLIT_K"))
def _sum_partials_kernel(
    ws_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    M,
    N_OUT,
    SPLIT_K,
    stride_rm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    mask = m_mask[:, None] & (offs_n < N_OUT)[None, :]
    tile = offs_m[:, None] * N_OUT + offs_n[None, :]
    plane = M * N_OUT
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    total_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(SPLIT_K):
        total += tl.load(ws_ptr + (s * 2) * plane + tile, mask=mask, other=0.0)
        if SWIGLU:
            total_up += tl.load(ws_ptr + (s * 2 + 1) * plane + tile, mask=mask, other=0.0)
    _epilogue(
        total, total_up, bias_ptr, res_ptr, out_ptr, offs_m, offs_n, m_mask, N_OUT,
        stride_rm, stride_om, HAS_BIAS, HAS_RESIDUAL, SWIGLU, out_ptr.dtype.element_ty,
        total, total, total, False,
    )  # fmt: skip


_GEMV = CachedLauncher(_gemv_kernel)
_GEMV_PDL = CachedLauncher(_gemv_kernel, launch_pdl=True)
_SUM_PARTIALS = CachedLauncher(_sum_partials_kernel)
_TICKETS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []
"""Ticket buffers replaced by larger ones, kept alive for the graphs that captured them."""


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters (one per output tile) that the ticket reduction leaves zeroed."""
    tickets = _TICKETS.get(device)
    if tickets is None or tickets.numel() < count:
        if tickets is not None:
            _RETIRED.append(tickets)
        tickets = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _TICKETS[device] = tickets
    return tickets
