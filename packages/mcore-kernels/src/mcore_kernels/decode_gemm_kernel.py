"""The Triton kernel of :func:`mcore_kernels.decode_gemm.decode_gemm`: a tensor-core GEMM of
``BLOCK_M`` rows by ``BLOCK_N`` weight rows with the decode projection's RMSNorm prologue and its
bias / SwiGLU / residual (or RoPE + key/value cache write) epilogue, an optional split of the reduction summed in a fixed order
by the last program of each output tile, and an L2 prefetch of the program's weights before the
programmatic-dependent-launch wait."""

from __future__ import annotations

from mcore_kernels._triton_utils import (
    CachedLauncher,
    gdc_launch_dependents,
    gdc_wait,
    jit,
    prefetch_l2,
    round_to,
    tl,
)
from mcore_kernels.decode_gemv_epilogues import _epilogue, _rope_epilogue
from mcore_kernels.decode_gemv_tiles import _row_scales


@jit
def _prefetch_weights(w_ptr, w_rows, up_rows, k_begin, k_end, PAIRED: tl.constexpr,
                      LINE: tl.constexpr, LINES: tl.constexpr):  # fmt: skip
    """Request this program's weight rows ``[k_begin, k_end)`` into L2, ``LINE`` elements
    (128 bytes) per request, ``LINES`` requests per row at a time."""
    offs = tl.arange(0, LINES) * LINE
    for start in range(k_begin, k_end, LINES * LINE):
        k = tl.minimum(start + offs, k_end - 1)
        prefetch_l2(w_ptr + w_rows[:, None] + k[None, :])
        if PAIRED:
            prefetch_l2(w_ptr + up_rows[:, None] + k[None, :])


@jit
def _finish(acc, acc_up, bias_ptr, res_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr,
            v_cache_ptr, stride_cos, stride_sin, stride_kc_slot, stride_kc_head, stride_vc_slot,
            stride_vc_head, offs_m, offs_n, m_mask, N_OUT, stride_rm, stride_om, NUM_Q_HEADS,
            NUM_KV_HEADS, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
            SWIGLU: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
            DTYPE: tl.constexpr):  # fmt: skip
    """The epilogue of a finished ``[BLOCK_M, BLOCK_N]`` tile: RoPE with the cache write, or
    bias / SwiGLU / residual add, and the store."""
    if ROPE:
        _rope_epilogue(
            acc, acc_up, bias_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr,
            v_cache_ptr, stride_cos, stride_sin, stride_kc_slot, stride_kc_head,
            stride_vc_slot, stride_vc_head, offs_m, offs_n, m_mask, N_OUT, stride_om,
            NUM_Q_HEADS, NUM_KV_HEADS, HAS_BIAS, HALF, DTYPE,
            acc, acc, acc, acc, False,
        )  # fmt: skip
    else:
        _epilogue(
            acc, acc_up, bias_ptr, res_ptr, out_ptr, offs_m, offs_n, m_mask, N_OUT,
            stride_rm, stride_om, HAS_BIAS, HAS_RESIDUAL, SWIGLU, DTYPE,
            acc, acc, acc, False,
        )  # fmt: skip


@jit(do_not_specialize=("M",))
def _decode_gemm_kernel(
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
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    LINE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
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
    # Columns past N_OUT read weight row 0 (never stored): the weight loads stay unmasked.
    n_safe = tl.where(n_mask, offs_n, 0)
    if ROPE:
        # Columns are (first half, second half) channel pairs of the q/k/v heads.
        first_rows = (n_safe // HALF) * (2 * HALF) + n_safe % HALF
        w_rows = first_rows.to(tl.int64) * stride_wn
        up_rows = (first_rows + HALF).to(tl.int64) * stride_wn
    else:
        w_rows = n_safe.to(tl.int64) * stride_wn
        up_rows = (n_safe + N_OUT).to(tl.int64) * stride_wn
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    if PREFETCH:
        # The weights do not depend on the previous kernel: stream them into L2 while it runs.
        _prefetch_weights(w_ptr, w_rows, up_rows, k_begin, k_end, PAIRED, LINE, 8)
    if USE_PDL:
        gdc_wait()
    scales = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:
        scales = _row_scales(x_ptr, offs_m, m_mask, K, stride_xm, eps, BLOCK_M, NORM_BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    for start in range(k_begin, k_end, BLOCK_K):
        k = start + offs_k
        if EVEN_K:
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptr + w_rows[:, None] + k[None, :])
        else:
            k_mask = k < k_end
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + w_rows[:, None] + k[None, :], mask=k_mask[None, :], other=0.0)
        if HAS_NORM:
            # The RMSNorm output, rounded as the norm kernel rounds it, is the GEMM's input.
            if EVEN_K:
                gamma = tl.load(norm_ptr + k).to(tl.float32)
            else:
                gamma = tl.load(norm_ptr + k, mask=k < k_end, other=0.0).to(tl.float32)
            x = round_to(x.to(tl.float32) * scales[:, None] * gamma[None, :], dtype)
        if UPCAST_DOT:
            # The interpreter's tl.dot misreads bfloat16 operands; float32 ones are exact.
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        if PAIRED:
            if EVEN_K:
                w_up = tl.load(w_ptr + up_rows[:, None] + k[None, :])
            else:
                w_up = tl.load(
                    w_ptr + up_rows[:, None] + k[None, :], mask=(k < k_end)[None, :], other=0.0
                )
            if UPCAST_DOT:
                acc_up += tl.dot(
                    x.to(tl.float32), tl.trans(w_up.to(tl.float32)), input_precision="ieee"
                )
            else:
                acc_up = tl.dot(x, tl.trans(w_up), acc_up)
    if SPLIT_K == 1:
        _finish(
            acc, acc_up, bias_ptr, res_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr,
            v_cache_ptr, stride_cos, stride_sin, stride_kc_slot, stride_kc_head, stride_vc_slot,
            stride_vc_head, offs_m, offs_n, m_mask, N_OUT, stride_rm, stride_om, NUM_Q_HEADS,
            NUM_KV_HEADS, HAS_BIAS, HAS_RESIDUAL, SWIGLU, ROPE, HALF, dtype,
        )  # fmt: skip
    else:
        # Workspace [SPLIT_K, 2, M, N_OUT] float32: the gate (or only) partial, then the up one.
        tile = offs_m[:, None] * N_OUT + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        plane = M * N_OUT
        tl.store(ws_ptr + (pid_k * 2) * plane + tile, acc, mask=mask)
        if PAIRED:
            tl.store(ws_ptr + (pid_k * 2 + 1) * plane + tile, acc_up, mask=mask)
        # Every thread's partial is written before the ticket (release) is taken.
        tl.debug_barrier()
        ticket = ticket_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # The last program sums the partials in split order: the result does not depend
            # on which program arrived last.
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            total_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
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
            _finish(
                total, total_up, bias_ptr, res_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr,
                k_cache_ptr, v_cache_ptr, stride_cos, stride_sin, stride_kc_slot,
                stride_kc_head, stride_vc_slot, stride_vc_head, offs_m, offs_n, m_mask, N_OUT,
                stride_rm, stride_om, NUM_Q_HEADS, NUM_KV_HEADS, HAS_BIAS, HAS_RESIDUAL,
                SWIGLU, ROPE, HALF, dtype,
            )  # fmt: skip
            # Reset for the next launch (graph replays reuse the tickets).
            tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")


_DECODE_GEMM = CachedLauncher(_decode_gemm_kernel)
_DECODE_GEMM_PDL = CachedLauncher(_decode_gemm_kernel, launch_pdl=True)
