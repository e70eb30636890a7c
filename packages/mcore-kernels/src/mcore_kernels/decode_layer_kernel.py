"""Triton kernel of :mod:`mcore_kernels.decode_layer`: a decode step's attention (optional),
o projection, MLP and the next layer's q/k/v projection in one persistent launch.

Every program stays resident for the whole launch and works through the phases one after
the other; between two phases the programs meet at a grid barrier (:func:`_grid_barrier`: an
atomic arrival count that each program waits on), which replaces the end of one kernel and
the start of the next. Before waiting, a program requests its first weight tile of the coming
phase, so the weights stream while the previous phase finishes, as programmatic dependent
launch does across kernels. Each phase is one projection of :mod:`mcore_kernels.decode_gemv`'s
vector path (:func:`_projection_phase`), with the same prologues and epilogues.
"""

from __future__ import annotations

from mcore_kernels._triton_utils import CachedLauncher, gdc_launch_dependents, gdc_wait, jit, tl
from mcore_kernels.decode_gemv_epilogues import (
    _early_bias,
    _early_inputs,
    _epilogue,
    _rope_epilogue,
)
from mcore_kernels.decode_gemv_tiles import _accumulate, _load_tile, _row_scales
from mcore_kernels.decode_layer_attention import _attention_phase, _merged_attention

WAIT_NONE = 0
"""A phase that waits for nothing (the first phase of a plain launch)."""
WAIT_GDC = 1
"""A phase that waits for the previous kernel (the first phase under PDL)."""
WAIT_BARRIER = 2
"""A phase that waits for every program's previous phase (grid barrier)."""


@jit
def _backoff(nanoseconds: tl.constexpr):
    """Sleep about ``nanoseconds`` (``nanosleep``; inline PTX: CUDA only)."""
    tl.inline_asm_elementwise(
        "nanosleep.u32 $1;\n\tmov.u32 $0, 0;",
        "=r,r",
        [tl.full([1], nanoseconds, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@jit
def _stamp(timing_ptr, pid, slot: tl.constexpr, TIMING: tl.constexpr):
    """With ``TIMING``, store the GPU clock (ns) at ``timing[pid, slot]`` (inline PTX: CUDA)."""
    if TIMING:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;",
            "=l,r",
            [tl.full([1], 0, tl.int32)],
            dtype=tl.int64,
            is_pure=False,
            pack=1,
        )
        tl.store(timing_ptr + pid * 8 + slot + tl.arange(0, 1), now)


@jit
def _grid_barrier(counter_ptr, target, SLEEP: tl.constexpr):
    """Wait until ``target`` arrivals are counted at ``counter_ptr`` (this program's included).

    Every thread's stores come before the arrival (block barrier, then a release add at GPU
    scope); the program polls with acquire reads (atomic adds of zero), which make the other
    programs' stores visible. One H200, 1000 barriers of 132 or 264 programs: 0.9-1.1 us
    each; polling with volatile loads and one acquire at the end took 1.7-3.9 us.
    """
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while arrived < target:
        if SLEEP > 0:
            # Fewer polls queue at the counter's L2 address while the last programs arrive.
            _backoff(SLEEP)
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@jit
def _bulk_prefetch(addresses, size, active):
    """Request ``size`` bytes at each of ``addresses`` where ``active`` into L2.

    ``cp.async.bulk.prefetch.L2``: a hint served by the copy engine (Hopper and newer), one
    instruction per chunk; addresses and size 16-byte aligned. Inline PTX: CUDA only.
    """
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $3, 0;\n\t"
        "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,r,r",
        [addresses, size, active],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@jit
def _prefetch_share(ptr, nbytes, pid, programs, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Request this program's share of the ``nbytes`` bytes at ``ptr`` into L2.

    Chunks of ``CHUNK`` bytes (``nbytes >= CHUNK``; the last chunk ends at the tensor's end).
    ``LANES`` is the program's thread count, so each thread issues at most one request per
    pass: a lane tensor smaller than the program is replicated over its threads, and every
    copy would issue the request again (a 32-fold replication made such prefetches slower
    than none).
    """
    chunks = tl.cdiv(nbytes, CHUNK)
    share = tl.cdiv(chunks, programs)
    base = ptr.to(tl.pointer_type(tl.int8))
    lanes = tl.arange(0, LANES)
    sizes = tl.full([LANES], CHUNK, tl.int32)
    for start in range(0, share, LANES):
        index = pid * share + start + lanes
        active = (start + lanes < share) & (index < chunks)
        offset = tl.minimum(index.to(tl.int64) * CHUNK, nbytes - CHUNK)
        _bulk_prefetch(base + offset, sizes, active.to(tl.int32))


@jit
def _tile_rows(tile, N_OUT, stride_wn, ROPE: tl.constexpr, HALF: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """Output columns of ``tile``, their mask and the offsets of their (and the paired) rows."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    safe = tl.where(n_mask, offs_n, 0)
    if ROPE:
        first_rows = (safe // HALF) * (2 * HALF) + safe % HALF
        w_rows = first_rows.to(tl.int64) * stride_wn
        up_rows = (first_rows + HALF).to(tl.int64) * stride_wn
    else:
        w_rows = safe.to(tl.int64) * stride_wn
        up_rows = (safe + N_OUT).to(tl.int64) * stride_wn
    return offs_n, n_mask, w_rows, up_rows


@jit
def _projection_phase(
    x_ptr, w_ptr, bias_ptr, norm_ptr, res_ptr, out_ptr, eps,
    M, N_OUT, K, stride_xm, stride_wn, stride_rm, stride_om,
    cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin,
    stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head, NUM_Q_HEADS, NUM_KV_HEADS,
    counter_ptr, target, pid, programs,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WAIT: tl.constexpr, SLEEP: tl.constexpr,
):  # fmt: skip
    """One projection over tiles ``pid, pid + programs, ...`` of ``BLOCK_N`` output columns.

    ``BLOCK_K >= K``: a tile is one load. The first tile's weights, norm weight and bias are
    requested before the wait (``WAIT``), the inputs after it.
    """
    PAIRED: tl.constexpr = SWIGLU or ROPE
    dtype = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    offs_n, n_mask, w_rows, up_rows = _tile_rows(pid, N_OUT, stride_wn, ROPE, HALF, BLOCK_N)
    w, w_up = _load_tile(w_ptr, w_rows, up_rows, offs_k, K, PAIRED, True)
    gamma = (offs_k < K).to(tl.float32)
    if HAS_NORM:
        gamma = tl.load(norm_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    bias, bias_up = _early_bias(bias_ptr, offs_n, n_mask, N_OUT, HAS_BIAS, ROPE, SWIGLU, HALF)
    if WAIT == 1:
        gdc_wait()
    if WAIT == 2:
        _grid_barrier(counter_ptr, target, SLEEP)
    scales = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:
        scales = _row_scales(x_ptr, offs_m, m_mask, K, stride_xm, eps, BLOCK_M, BLOCK_K)
    tiles = tl.cdiv(N_OUT, BLOCK_N)
    for tile in range(pid, tiles, programs):
        res, cos, sin = _early_inputs(
            res_ptr, cos_ptr, sin_ptr, offs_m, offs_n, m_mask, n_mask, stride_rm,
            stride_cos, stride_sin, HAS_RESIDUAL, ROPE, HALF,
        )  # fmt: skip
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc, acc_up = _accumulate(
            acc, acc, w, w_up, x_ptr, w_ptr, norm_ptr, scales, offs_m, m_mask, w_rows,
            up_rows, offs_k, K, M, stride_xm, 0,
            HAS_NORM, PAIRED, BLOCK_M, False, True, "ieee", False, True, gamma, True,
        )  # fmt: skip
        if ROPE:
            _rope_epilogue(
                acc, acc_up, bias_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr,
                v_cache_ptr, stride_cos, stride_sin, stride_kc_slot, stride_kc_head,
                stride_vc_slot, stride_vc_head, offs_m, offs_n, m_mask, N_OUT, stride_om,
                NUM_Q_HEADS, NUM_KV_HEADS, HAS_BIAS, HALF, dtype, bias, bias_up, cos, sin, True,
            )  # fmt: skip
        else:
            _epilogue(
                acc, acc_up, bias_ptr, res_ptr, out_ptr, offs_m, offs_n, m_mask, N_OUT,
                stride_rm, stride_om, HAS_BIAS, HAS_RESIDUAL, SWIGLU, dtype, bias, bias_up,
                res, True,
            )  # fmt: skip
        # The next tile's weights and bias (a tile past the end reads row 0, never stored).
        offs_n, n_mask, w_rows, up_rows = _tile_rows(
            tile + programs, N_OUT, stride_wn, ROPE, HALF, BLOCK_N
        )
        w, w_up = _load_tile(w_ptr, w_rows, up_rows, offs_k, K, PAIRED, True)
        bias, bias_up = _early_bias(bias_ptr, offs_n, n_mask, N_OUT, HAS_BIAS, ROPE, SWIGLU, HALF)


@jit
def _merged_o_phase(
    part_acc_ptr, part_max_ptr, part_sum_ptr, lens_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,
    M, N_OUT, K, num_splits, NUM_Q_HEADS, stride_wn, stride_rm, stride_om,
    counter_ptr, target, pid, programs,
    HAS_BIAS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
    SLEEP: tl.constexpr,
):  # fmt: skip
    """The o projection (+ bias + residual) of attention rows merged from split partials."""
    dtype = out_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    offs_n, n_mask, w_rows, up_rows = _tile_rows(pid, N_OUT, stride_wn, False, 1, BLOCK_N)
    w, _ = _load_tile(w_ptr, w_rows, up_rows, offs_k, K, False, True)
    bias, bias_up = _early_bias(bias_ptr, offs_n, n_mask, N_OUT, HAS_BIAS, False, False, 1)
    _grid_barrier(counter_ptr, target, SLEEP)
    x = _merged_attention(
        part_acc_ptr, part_max_ptr, part_sum_ptr, lens_ptr, offs_m, m_mask, num_splits,
        NUM_Q_HEADS, dtype, HEAD_DIM, SPLIT, BLOCK_K, CHUNK,
    )  # fmt: skip
    tiles = tl.cdiv(N_OUT, BLOCK_N)
    for tile in range(pid, tiles, programs):
        res, _, _ = _early_inputs(
            res_ptr, res_ptr, res_ptr, offs_m, offs_n, m_mask, n_mask, stride_rm, 0, 0,
            True, False, 1,
        )  # fmt: skip
        acc = tl.sum(w.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)
        _epilogue(
            acc, acc, bias_ptr, res_ptr, out_ptr, offs_m, offs_n, m_mask, N_OUT, stride_rm,
            stride_om, HAS_BIAS, True, False, dtype, bias, bias_up, res, True,
        )  # fmt: skip
        offs_n, n_mask, w_rows, up_rows = _tile_rows(
            tile + programs, N_OUT, stride_wn, False, 1, BLOCK_N
        )
        w, _ = _load_tile(w_ptr, w_rows, up_rows, offs_k, K, False, True)
        bias, bias_up = _early_bias(bias_ptr, offs_n, n_mask, N_OUT, HAS_BIAS, False, False, 1)


@jit(do_not_specialize=("M", "num_splits", "stride_table"))
def _decode_layer_kernel(
    attn_ptr, res_ptr, o_w_ptr, o_b_ptr, h_ptr,
    post_norm_ptr, post_eps, gate_up_ptr, act_ptr, down_ptr, out_ptr,
    qkv_w_ptr, qkv_b_ptr, in_norm_ptr, in_eps, q_ptr,
    cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin,
    stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head, NUM_Q_HEADS, NUM_KV_HEADS,
    counter_ptr, M, ATTN, HIDDEN, FFN, PAIRS,
    ak_ptr, av_ptr, table_ptr, lens_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, scale,
    num_splits, stride_table, stride_akb, stride_aks, stride_akh, stride_avb, stride_avs,
    stride_avh, o_bytes, gate_up_bytes, down_bytes, qkv_bytes, timing_ptr,
    O_BIAS: tl.constexpr, NEXT: tl.constexpr, QKV_BIAS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_M: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr, BN_GU: tl.constexpr,
    BK_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr, BN_QKV: tl.constexpr,
    BK_QKV: tl.constexpr, USE_PDL: tl.constexpr, ATTEND: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, CHUNK: tl.constexpr, PREFETCH: tl.constexpr,
    PREFETCH_CHUNK: tl.constexpr, SLEEP: tl.constexpr, TIMING: tl.constexpr,
    THREADS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    _stamp(timing_ptr, pid, 0, TIMING)
    if USE_PDL:
        gdc_launch_dependents()
    if PREFETCH:
        # The layer's weights towards L2 in the order of use, while the programs wait for the
        # previous kernel and for each other: the memory streams them at its own pace and the
        # phases read them from L2.
        _prefetch_share(o_w_ptr, o_bytes, pid, programs, PREFETCH_CHUNK, THREADS)
        _prefetch_share(gate_up_ptr, gate_up_bytes, pid, programs, PREFETCH_CHUNK, THREADS)
        _prefetch_share(down_ptr, down_bytes, pid, programs, PREFETCH_CHUNK, THREADS)
        if NEXT:
            _prefetch_share(qkv_w_ptr, qkv_bytes, pid, programs, PREFETCH_CHUNK, THREADS)
    if ATTEND:
        # attention of the layer's queries (attn_ptr) over the paged cache: split partials
        if USE_PDL:
            gdc_wait()
        _stamp(timing_ptr, pid, 1, TIMING)
        _attention_phase(
            attn_ptr, ak_ptr, av_ptr, table_ptr, lens_ptr, part_acc_ptr, part_max_ptr,
            part_sum_ptr, scale, M, num_splits, stride_table, stride_akb, stride_aks,
            stride_akh, stride_avb, stride_avs, stride_avh, NUM_Q_HEADS, NUM_KV_HEADS, pid,
            programs, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, SPLIT,
        )  # fmt: skip
        _stamp(timing_ptr, pid, 2, TIMING)
        # h = merge(partials) @ o^T (+ bias) + residual
        _merged_o_phase(
            part_acc_ptr, part_max_ptr, part_sum_ptr, lens_ptr, o_w_ptr, o_b_ptr, res_ptr, h_ptr,
            M, HIDDEN, ATTN, num_splits, NUM_Q_HEADS, ATTN, HIDDEN, HIDDEN,
            counter_ptr, programs, pid, programs,
            O_BIAS, HEAD_DIM, SPLIT, BLOCK_M, BN_O, BK_O, CHUNK, SLEEP,
        )  # fmt: skip
    else:
        # h = attention @ o^T (+ bias) + residual
        _projection_phase(
            attn_ptr, o_w_ptr, o_b_ptr, post_norm_ptr, res_ptr, h_ptr, post_eps,
            M, HIDDEN, ATTN, ATTN, ATTN, HIDDEN, HIDDEN,
            cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin,
            stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head, NUM_Q_HEADS,
            NUM_KV_HEADS, counter_ptr, 0, pid, programs,
            O_BIAS, False, True, False, False, HALF, BLOCK_M, BN_O, BK_O, 1 if USE_PDL else 0, SLEEP,
        )  # fmt: skip
    base = 1 if ATTEND else 0
    _stamp(timing_ptr, pid, 3, TIMING)
    # act = swiglu(rms_norm(h) @ gate_up^T)
    _projection_phase(
        h_ptr, gate_up_ptr, o_b_ptr, post_norm_ptr, res_ptr, act_ptr, post_eps,
        M, FFN, HIDDEN, HIDDEN, HIDDEN, HIDDEN, FFN,
        cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin,
        stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head, NUM_Q_HEADS, NUM_KV_HEADS,
        counter_ptr, (base + 1) * programs, pid, programs,
        False, True, False, True, False, HALF, BLOCK_M, BN_GU, BK_GU, 2, SLEEP,
    )  # fmt: skip
    _stamp(timing_ptr, pid, 4, TIMING)
    # out = act @ down^T + h
    _projection_phase(
        act_ptr, down_ptr, o_b_ptr, post_norm_ptr, h_ptr, out_ptr, post_eps,
        M, HIDDEN, FFN, FFN, FFN, HIDDEN, HIDDEN,
        cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin,
        stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head, NUM_Q_HEADS, NUM_KV_HEADS,
        counter_ptr, (base + 2) * programs, pid, programs,
        False, False, True, False, False, HALF, BLOCK_M, BN_D, BK_D, 2, SLEEP,
    )  # fmt: skip
    _stamp(timing_ptr, pid, 5, TIMING)
    if NEXT:
        # q = rope(rms_norm(out) @ qkv^T (+ bias)); keys and values into their cache slots
        _projection_phase(
            out_ptr, qkv_w_ptr, qkv_b_ptr, in_norm_ptr, res_ptr, q_ptr, in_eps,
            M, PAIRS, HIDDEN, HIDDEN, HIDDEN, HIDDEN, NUM_Q_HEADS * 2 * HALF,
            cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin,
            stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head, NUM_Q_HEADS,
            NUM_KV_HEADS, counter_ptr, (base + 3) * programs, pid, programs,
            QKV_BIAS, True, False, False, True, HALF, BLOCK_M, BN_QKV, BK_QKV, 2, SLEEP,
        )  # fmt: skip
    _stamp(timing_ptr, pid, 6, TIMING)
    # The last program out resets the counters for the next launch (graph replays reuse them).
    done = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == programs - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed", scope="gpu")


_LAYER = CachedLauncher(_decode_layer_kernel)
_LAYER_PDL = CachedLauncher(_decode_layer_kernel, launch_pdl=True)
