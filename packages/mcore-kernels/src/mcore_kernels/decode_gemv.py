"""Projections of a few rows (decode) as one weight-streaming kernel with fused pro- and epilogues.

At decode a projection multiplies ``M`` = 1..64 rows by a ``[N, K]`` weight: the time is the
time to read the weight once. cuBLAS runs these shapes as split-K GEMMs plus a reduction
kernel and reaches a fraction of the memory bandwidth; this kernel streams the weight in
``[BLOCK_N, BLOCK_K]`` tiles over enough programs to fill the GPU, and folds in the cheap work
around the projection so a decoder layer launches fewer kernels:

- prologue: RMSNorm of the input rows (``norm_weight``), computed by every program from the
  rows themselves (they are a few KiB), so the norm kernel before the projection disappears;
- epilogue: bias, SwiGLU over a ``[2F, K]`` gate-then-up weight (``swiglu=True``: the output
  is the ``[M, F]`` activation, the down projection reads it directly), and a residual add.

Each row's dot products run in float32; the result is rounded to the input dtype once (after
the bias, as cuBLAS's bias epilogue does), then SwiGLU and the residual add each round once as
the unfused ops do. Split-K (``split_k > 1``) writes float32 partials to a workspace; the last
program of each output tile (counted with an atomic ticket) sums them in a fixed order and runs
the epilogue, so the result does not depend on the arrival order and one launch suffices
(``reduce="second_pass"`` runs the sum in a second kernel instead, for comparison).

Decode-step extras: ``rope`` (a :class:`~mcore_kernels.rotary_kv_write.RotaryCacheWrite`)
makes a q/k/v projection also rotate its queries and keys and store keys and values in their
cache slots (tiles of (channel ``j``, channel ``j + D/2``) pairs, read like SwiGLU's gate and up
rows); under :func:`mcore_kernels.pdl.programmatic_dependent_launch` the programs request their
first weight tile before waiting for the previous kernel.

Layout: this module holds, top to bottom, the launch configurations and their choice per shape
(:func:`gemv_config`), the main loop's Triton building blocks, the kernels with their cached
launchers, the argument checks, the launch, the ``torch.library`` registration and the entry
point. The epilogues are in :mod:`~mcore_kernels.decode_gemv_epilogues`, shared with the fused
attention + output projection of :mod:`~mcore_kernels.decode_attention_gemv`.

Shapes: ``x`` ``[M, K]`` (last dimension contiguous), ``weight`` ``[N, K]`` contiguous,
``bias`` ``[N]``, ``norm_weight`` ``[K]``, ``residual`` ``[M, N_out]``; returns ``[M, N_out]``
with ``N_out = N`` (``N // 2`` with ``swiglu``).

Dispatch: Triton on CUDA, the torch reference on CPU; ``MCORE_KERNELS_BACKEND=torch|triton``
overrides (with ``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors).
"""

from __future__ import annotations

import dataclasses

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    CachedLauncher,
    TicketPool,
    device_limits,
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    pdl_supported,
    round_to,
    tl,
    triton,
)
from mcore_kernels.decode_gemv_epilogues import (
    _early_bias,
    _early_inputs,
    _epilogue,
    _rope_epilogue,
)
from mcore_kernels.errors import (
    KernelBackendError,
    KernelDtypeError,
    KernelShapeError,
    KernelValueError,
)
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import decode_gemv_reference
from mcore_kernels.rotary_kv_write import (
    RotaryCacheWrite,
    _flat_slots,
    rotary_kv_write_reference,
)

__all__ = [
    "EARLY_TAIL",
    "WHOLE_ROW_MAX_K",
    "WHOLE_ROW_WARPS",
    "GemvConfig",
    "block_rows",
    "decode_gemv",
    "decode_gemv_triton",
    "gemv_config",
]

# --- launch configurations ----------------------------------------------------------------------

_REDUCES = ("ticket", "second_pass")
WHOLE_ROW_MAX_K = 8192
"""At 1-2 rows, projections of one weight row per program and at most this many inputs load
the whole row as one tile (see :func:`gemv_config`; 0: never): under PDL a program has its
whole weight in flight before it waits."""
WHOLE_ROW_WARPS = 8
"""Warps per program of those whole-row tiles wider than 4096 (4 up to 4096)."""
EARLY_TAIL = True
"""Programs whose reduction is one full ``block_k`` tile and a shorter tail (no split-K)
request both tiles at once, before the PDL wait (False: the tail after the first products)."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class GemvConfig:
    """Launch configuration of :func:`decode_gemv_triton`."""

    block_n: int = 16
    """Output columns (weight rows) per program; a power of two >= 16 with ``use_dot``."""
    block_k: int = 512
    """Reduction elements per loop iteration; a power of two >= 16."""
    split_k: int = 1
    """Programs sharing one output tile's reduction (float32 partials, summed in order)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int | None = None
    """Software-pipelining stages of the reduction loop (None: Triton's default)."""
    use_dot: bool = False
    """Tensor-core ``tl.dot`` over rows padded to 16 instead of one vector pass per row."""
    reduce: str = "ticket"
    """Split-K sum: ``"ticket"`` (last program of a tile, one launch) or ``"second_pass"``."""

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise KernelValueError(f"GemvConfig.{name}={value}; expected a power of two")
        if self.block_k < 16:
            raise KernelValueError(f"GemvConfig.block_k={self.block_k}; expected >= 16")
        if self.use_dot and self.block_n < 16:
            raise KernelValueError(
                f"GemvConfig.block_n={self.block_n} with use_dot; expected >= 16"
            )
        if self.num_stages is not None and self.num_stages < 1:
            raise KernelValueError(f"GemvConfig.num_stages={self.num_stages}; expected >= 1")
        if self.split_k < 1:
            raise KernelValueError(f"GemvConfig.split_k={self.split_k}; expected >= 1")
        if self.reduce not in _REDUCES:
            raise KernelValueError(f"GemvConfig.reduce={self.reduce!r}; expected one of {_REDUCES}")


def gemv_config(rows: int, out_features: int, in_features: int, multiprocessors: int) -> GemvConfig:
    """The launch configuration :func:`decode_gemv` uses for a shape.

    Chosen from a sweep on one H100 (``bench_decode_gemv.py --sweep``, the Qwen2.5-0.5B and
    Llama-3.2-1B projections at 1..64 rows, then ``--refine`` at 1 and 2 rows): up to 2 rows,
    vector passes without split-K over ``[4, 1024]`` weight tiles (``[2, 2048]`` for
    reductions of 2048 and more) were the fastest or within a few percent of it for every
    shape; on one H200 one weight row per program for narrow outputs over long reductions
    (fewer than ``8 x multiprocessors`` outputs, at least 2048 inputs); from 3 rows on,
    ``tl.dot`` tiles, narrow ones (16 columns) for narrow projections with a 4-way split-K
    over long reductions, wide ones (32 or 64 columns) for wide ones.

    Args:
        rows: ``M``, the rows of ``x``.
        out_features: ``N_out``, the output columns (``F`` for SwiGLU).
        in_features: ``K``.
        multiprocessors: The device's multiprocessor count (it caps the split).

    Returns:
        A :class:`GemvConfig`.
    """
    if rows <= 2:
        if in_features >= 2048:
            # Narrow outputs over long reductions (Qwen2.5-0.5B's down projection, 896 x
            # 4864): one weight row per program keeps about seven programs per multiprocessor
            # (H200: 6.1 against 7.3 us with two rows per program).
            block_n = 2 if out_features // 2 >= 4 * multiprocessors else 1
            if block_n == 1 and in_features <= WHOLE_ROW_MAX_K:
                # The whole weight row in flight before the PDL wait: one tile of the largest
                # power of two in the row plus the tail (both requested before the wait, see
                # EARLY_TAIL), 4 warps up to 4096 (H200, the captured batch-1 step of the
                # Qwen2.5-0.5B shape, down 896 x 4864: 534.1 against 547.3-552.8 us with one
                # 8192-wide tile over 8 warps).
                block_k = next_power_of_2(in_features)
                if block_k != in_features:
                    block_k //= 2
                warps = 4 if block_k <= 4096 else WHOLE_ROW_WARPS
                return GemvConfig(block_n=1, block_k=block_k, num_warps=warps)
            return GemvConfig(block_n=block_n, block_k=2048, num_warps=4)
        return GemvConfig(block_n=4, block_k=1024, num_warps=4)
    if out_features <= 4096:
        tiles = -(-out_features // 16) * -(-rows // block_rows(rows, True))
        split_k = 4 if in_features >= 4096 and tiles <= multiprocessors else 1
        return GemvConfig(block_n=16, block_k=256, split_k=split_k, num_warps=4, use_dot=True)
    block_n = 32 if out_features < 12288 else 64
    return GemvConfig(block_n=block_n, block_k=128, num_warps=4, use_dot=True)


def block_rows(rows: int, use_dot: bool) -> int:
    """Rows of ``x`` per program: up to 4 for the vector path, 16..64 for ``tl.dot`` tiles."""
    if use_dot:
        return min(64, max(16, next_power_of_2(rows)))
    return min(4, next_power_of_2(rows))


# --- Triton kernels: the main loop's building blocks, the kernels and their launchers -------------


@jit
def _row_scales(
    x_ptr, offs_m, m_mask, K, stride_xm, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
):
    """``rsqrt(mean(x**2) + eps)`` of every row (float32 ``[BLOCK_M]``)."""
    offs_k = tl.arange(0, BLOCK_K)
    sum_sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :],
            mask=m_mask[:, None] & (k < K)[None, :],
            other=0.0,
        ).to(tl.float32)
        sum_sq += x * x
    return 1.0 / tl.sqrt(tl.sum(sum_sq, axis=1) / K + eps)


@jit
def _load_tile(w_ptr, w_rows, up_rows, k, k_end, PAIRED: tl.constexpr, MASKED: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile (and the paired tile: SwiGLU's up rows, RoPE's
    second halves) at ``k``."""
    k_mask = k < k_end
    if MASKED:
        w = tl.load(w_ptr + w_rows[:, None] + k[None, :], mask=k_mask[None, :], other=0.0)
    else:
        w = tl.load(w_ptr + w_rows[:, None] + k[None, :])
    w_up = w
    if PAIRED:
        if MASKED:
            w_up = tl.load(w_ptr + up_rows[:, None] + k[None, :], mask=k_mask[None, :], other=0.0)
        else:
            w_up = tl.load(w_ptr + up_rows[:, None] + k[None, :])
    return w, w_up


@jit
def _accumulate(
    acc,
    acc_up,
    w,
    w_up,
    x_ptr,
    w_ptr,
    norm_ptr,
    scales,
    offs_m,
    m_mask,
    w_rows,
    up_rows,
    k,
    k_end,
    M,
    stride_xm,
    pid_m,
    HAS_NORM: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_DOT: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PRELOADED: tl.constexpr,
    pre_gamma,
    PRE_GAMMA: tl.constexpr,
):
    """Add one ``BLOCK_K`` slice of the products to the accumulators (masked: the tail)."""
    dtype = x_ptr.dtype.element_ty
    k_mask = k < k_end
    if not PRELOADED:
        w, w_up = _load_tile(w_ptr, w_rows, up_rows, k, k_end, PAIRED, MASKED)
    gamma = k_mask.to(tl.float32)
    if HAS_NORM:
        if PRE_GAMMA:
            gamma = pre_gamma
        else:
            gamma = tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    if USE_DOT:
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if HAS_NORM:
            x = round_to(x.to(tl.float32) * scales[:, None] * gamma[None, :], dtype)
        if UPCAST_DOT:
            # The interpreter's tl.dot misreads bfloat16 operands; float32 ones are exact.
            x = x.to(tl.float32)
            w = w.to(tl.float32)
            w_up = w_up.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        if PAIRED:
            acc_up += tl.dot(x, tl.trans(w_up), input_precision=DOT_PRECISION)
    else:
        wf = w.to(tl.float32)
        wf_up = w_up.to(tl.float32)
        for row in tl.static_range(BLOCK_M):
            m = pid_m * BLOCK_M + row
            # Rows past M re-read row M - 1; their results are never stored.
            xr = tl.load(x_ptr + tl.minimum(m, M - 1) * stride_xm + k, mask=k_mask, other=0.0)
            if HAS_NORM:
                scale = tl.sum(tl.where(offs_m == m, scales, 0.0), axis=0)
                xr = round_to(xr.to(tl.float32) * scale * gamma, dtype)
            xf = xr.to(tl.float32)
            here = offs_m[:, None] == m
            acc = tl.where(here, acc + tl.sum(wf * xf[None, :], axis=1)[None, :], acc)
            if PAIRED:
                acc_up = tl.where(
                    here, acc_up + tl.sum(wf_up * xf[None, :], axis=1)[None, :], acc_up
                )
    return acc, acc_up


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
    pre_bias, pre_bias_up, pre_res, pre_cos, pre_sin = acc, acc, acc, acc, acc
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
        # Without EARLY the epilogues load the bias, residual and rotary tiles themselves (the
        # pre_* placeholders are not read).
        if ROPE:
            _rope_epilogue(
                acc, acc_up, bias_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr,
                v_cache_ptr, stride_cos, stride_sin, stride_kc_slot, stride_kc_head,
                stride_vc_slot, stride_vc_head, offs_m, offs_n, m_mask, N_OUT, stride_om,
                NUM_Q_HEADS, NUM_KV_HEADS, HAS_BIAS, HALF, dtype,
                pre_bias, pre_bias_up, pre_cos, pre_sin, EARLY,
            )  # fmt: skip
        else:
            _epilogue(
                acc, acc_up, bias_ptr, res_ptr, out_ptr, offs_m, offs_n, m_mask, N_OUT,
                stride_rm, stride_om, HAS_BIAS, HAS_RESIDUAL, SWIGLU, dtype,
                pre_bias, pre_bias_up, pre_res, EARLY,
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
_TICKETS = TicketPool()
"""Zeroed counters of the ticket reduction (this op's own: see ``TicketPool``)."""


# --- argument checks, launch, registration, entry point ------------------------------------------


def _check_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    swiglu: bool,
    rope: RotaryCacheWrite | None = None,
) -> int:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise KernelShapeError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}; expected [M, K] and [N, K]"
        )
    if x.dtype != weight.dtype or not x.dtype.is_floating_point:
        raise KernelDtypeError(f"x {x.dtype}, weight {weight.dtype}; expected one float dtype")
    n = weight.shape[0]
    if swiglu and n % 2:
        raise KernelShapeError(f"weight has {n} rows with swiglu=True; expected an even count")
    n_out = n // 2 if swiglu else n
    if bias is not None and tuple(bias.shape) != (n,):
        raise KernelShapeError(f"bias has shape {tuple(bias.shape)}; expected [{n}]")
    if norm_weight is not None and tuple(norm_weight.shape) != (x.shape[1],):
        raise KernelShapeError(
            f"norm_weight has shape {tuple(norm_weight.shape)}; expected [{x.shape[1]}]"
        )
    if residual is not None:
        if tuple(residual.shape) != (x.shape[0], n_out):
            raise KernelShapeError(
                f"residual has shape {tuple(residual.shape)}; expected [{x.shape[0]}, {n_out}]"
            )
        if residual.dtype != x.dtype:
            raise KernelDtypeError(f"residual {residual.dtype}; expected {x.dtype} like x")
    if rope is not None:
        heads = rope.num_q_heads + 2 * rope.num_kv_heads
        if swiglu or residual is not None:
            raise KernelValueError(
                "rope with swiglu or residual; expected a plain q/k/v projection"
            )
        if n != heads * rope.head_dim or rope.head_dim % 2:
            raise KernelShapeError(
                f"weight has {n} rows with rope of {rope.num_q_heads} query and "
                f"{rope.num_kv_heads} key/value heads of {rope.head_dim} channels; expected "
                f"{heads * rope.head_dim} rows and an even head dim"
            )
        rope.check(torch.empty((x.shape[0], n), dtype=x.dtype, device="meta"))
        return rope.num_q_heads * rope.head_dim
    return n_out


def decode_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    pdl: bool | None = None,
    rope: RotaryCacheWrite | None = None,
) -> torch.Tensor:
    """Triton path of :func:`decode_gemv` (fixed shapes, graph-safe).

    Args:
        x: ``[M, K]`` input rows (last dimension contiguous).
        weight: ``[N, K]`` contiguous weight.
        bias: Optional ``[N]`` bias.
        norm_weight: Optional ``[K]`` RMSNorm weight applied to ``x`` first.
        norm_eps: RMSNorm epsilon.
        swiglu: Treat ``weight`` as gate rows then up rows and return ``silu(gate) * up``.
        residual: Optional ``[M, N_out]`` tensor added to the result.
        config: Launch configuration; None picks :func:`gemv_config`.
        pdl: Launch with programmatic dependent launch where the device supports it: the
            programs start while the previous kernel runs, load their first weight tile, and
            wait for that kernel before they read ``x``, ``residual`` or write anything (None:
            inside :func:`mcore_kernels.pdl.programmatic_dependent_launch` only).
        rope: Fold RoPE and the key/value cache write into a q/k/v projection (see
            :func:`decode_gemv`).

    Returns:
        ``[M, N_out]`` in the dtype of ``x`` (with ``rope``, the rotated queries).

    Raises:
        KernelShapeError: If the shapes do not match the layout above.
        KernelDtypeError: If a dtype is unsupported.
        KernelBackendError: If Triton is not installed.
    """
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    n_out = _check_args(x, weight, bias, norm_weight, residual, swiglu, rope)
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise KernelShapeError(
            f"x strides {x.stride()}, weight strides {weight.stride()}; expected a contiguous "
            "last dimension of x and a contiguous weight"
        )
    if residual is not None and residual.stride(1) != 1:
        raise KernelShapeError(f"residual strides {residual.stride()}; expected stride 1 last")
    rows, k = x.shape
    out = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    if rows == 0 or n_out == 0:
        return out
    # Output columns of the tiles: with rope, (first half, second half) channel pairs.
    columns = n_out if rope is None else weight.shape[0] // 2
    if config is None:
        config = gemv_config(rows, columns, k, device_limits(x.device)[0])
        if rope is not None and not config.use_dot:
            # A pair is two weight rows: as many rows per program as the plain projection.
            config = dataclasses.replace(config, block_n=max(1, config.block_n // 2))
    block_m = block_rows(rows, config.use_dot)
    grid_n = triton.cdiv(columns, config.block_n)
    grid_m = triton.cdiv(rows, block_m)
    k_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(k, k_split)
    # One full tile and a masked tail: both requested at once (before the PDL wait).
    early_tail = EARLY_TAIL and split_k == 1 and config.block_k < k < 2 * config.block_k
    second_pass = split_k > 1 and config.reduce == "second_pass"
    if second_pass and rope is not None:
        raise KernelValueError("rope with GemvConfig.reduce='second_pass'; expected 'ticket'")
    ws = x
    tickets = x
    if split_k > 1:
        ws = torch.empty((split_k, 2, rows, columns), dtype=torch.float32, device=x.device)
        tickets = _TICKETS.get(x.device, grid_n * grid_m)
    dummy = x
    interpreting = not x.is_cuda
    device_index = x.get_device()
    use_pdl = pdl_enabled(x.device) if pdl is None else pdl and pdl_supported(x.device)
    args = (
        x,
        weight,
        bias if bias is not None else dummy,
        norm_weight if norm_weight is not None else dummy,
        residual if residual is not None else dummy,
        out,
        ws,
        tickets,
        rows,
        columns,
        k,
        k_split,
        split_k,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        float(norm_eps),
        *_rope_args(rope, dummy),
    )
    constexprs = {
        "HAS_BIAS": bias is not None,
        "HAS_NORM": norm_weight is not None,
        "HAS_RESIDUAL": residual is not None,
        "SWIGLU": swiglu,
        "ROPE": rope is not None,
        "PAIRED": swiglu or rope is not None,
        "HALF": rope.head_dim // 2 if rope is not None else 1,
        "BLOCK_M": block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "HAS_SPLIT": split_k > 1,
        "USE_DOT": config.use_dot,
        "STORE_PARTIALS": second_pass,
        "DOT_PRECISION": "ieee" if x.dtype == torch.float32 or interpreting else "tf32",
        "UPCAST_DOT": interpreting,
        # The whole row in one pass where it fits: the prologue adds one load latency.
        "NORM_BLOCK": min(next_power_of_2(k), max(256, 8192 // block_m))
        if norm_weight is not None
        else 16,
        "K_ALIGNED": k % 16 == 0,
        "USE_PDL": use_pdl,
        # The norm weight and bias with the first weight tile (before the PDL wait), the
        # residual or the RoPE tables right after it, instead of in the epilogue. One H200,
        # batch-1 decode of the Qwen2.5-0.5B shape: 1634 against 1580 tok/s.
        "EARLY": split_k == 1 and (norm_weight is not None or use_pdl),
        "EARLY_TAIL": early_tail,
    }
    if config.num_stages is None:
        launcher = _GEMV_PDL if use_pdl else _GEMV
        launcher((grid_n, split_k, grid_m), args, constexprs, config.num_warps, device_index)
    else:
        options = {"launch_pdl": True} if use_pdl else {}
        _gemv_kernel[(grid_n, split_k, grid_m)](
            *args,
            **constexprs,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **options,
        )
    if second_pass:
        _SUM_PARTIALS(
            (grid_n, grid_m),
            (
                ws,
                bias if bias is not None else dummy,
                residual if residual is not None else dummy,
                out,
                rows,
                n_out,
                split_k,
                residual.stride(0) if residual is not None else 0,
                out.stride(0),
            ),
            {
                "HAS_BIAS": bias is not None,
                "HAS_RESIDUAL": residual is not None,
                "SWIGLU": swiglu,
                "BLOCK_M": block_m,
                "BLOCK_N": config.block_n,
            },
            4,
            device_index,
        )
    return out


def _rope_args(rope: RotaryCacheWrite | None, dummy: torch.Tensor) -> tuple:
    """The kernel's RoPE arguments (pointers, strides, head counts); dummies without rope."""
    if rope is None:
        return (dummy,) * 5 + (0,) * 8
    keys = _flat_slots(rope.k_cache, "k_cache")
    values = _flat_slots(rope.v_cache, "v_cache")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise KernelShapeError("k_cache and v_cache must have a contiguous last dimension")
    if rope.cos.stride(-1) != 1 or rope.sin.stride(-1) != 1:
        raise KernelShapeError("rope.cos and rope.sin must have a contiguous last dimension")
    return (
        rope.cos,
        rope.sin,
        rope.slot_mapping.contiguous(),
        keys,
        values,
        rope.cos.stride(0),
        rope.sin.stride(0),
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        rope.num_q_heads,
        rope.num_kv_heads,
    )


def decode_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
    pdl: bool | None = None,
    rope: RotaryCacheWrite | None = None,
) -> torch.Tensor:
    """``[RMSNorm] -> x @ weight.T + bias -> [SwiGLU] -> [+ residual]`` of a few rows.

    Args:
        x: ``[M, K]`` input rows.
        weight: ``[N, K]`` weight (gate rows then up rows with ``swiglu``).
        bias: Optional ``[N]`` bias.
        norm_weight: Optional ``[K]`` RMSNorm weight: ``x`` is normalised (float32, rounded to
            its dtype) before the projection.
        norm_eps: RMSNorm epsilon.
        swiglu: Return ``silu(gate) * up`` (``[M, N // 2]``) instead of the projection.
        residual: Optional ``[M, N_out]`` tensor added to the result (rounded once more).
        pdl: Launch the Triton kernel with programmatic dependent launch where the device
            supports it (Hopper or newer): it then overlaps the previous kernel's tail. The
            result is the same; every earlier kernel's writes are visible to it. None: inside
            :func:`mcore_kernels.pdl.programmatic_dependent_launch` only.
        rope: Treat ``weight`` as a q/k/v projection (``Hq`` query, then ``Hkv`` key, then
            ``Hkv`` value heads of ``D`` rows) and fold
            :func:`~mcore_kernels.rotary_kv_write.rotary_kv_write` in: the queries and keys are
            rotated, the keys and values stored in their cache slots, and the rotated queries
            (``[M, Hq * D]``) returned; the same values as the projection followed by
            ``rotary_kv_write``. Not with ``swiglu`` or ``residual``; not under
            ``torch.compile``.

    Returns:
        ``[M, N_out]`` in the dtype of ``x`` (with ``rope``, the rotated queries).

    Raises:
        KernelShapeError: If the shapes do not match the layout above.
        KernelDtypeError: If a dtype is unsupported.
        KernelValueError: If ``rope`` comes with ``swiglu`` or ``residual``.
        KernelBackendError: If ``MCORE_KERNELS_BACKEND`` names an unknown backend or one that
            cannot run on these tensors.
    """
    _check_args(x, weight, bias, norm_weight, residual, swiglu, rope)
    if rope is not None:
        return _decode_gemv_rope(x, weight, bias, norm_weight, norm_eps, pdl, rope)
    if _compile.compiling():
        return _decode_gemv_op(x, weight, bias, norm_weight, float(norm_eps), swiglu, residual)
    return _decode_gemv_run(x, weight, bias, norm_weight, norm_eps, swiglu, residual, pdl)


def _decode_gemv_run(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    swiglu: bool,
    residual: torch.Tensor | None,
    pdl: bool | None = None,
) -> torch.Tensor:
    if use_triton(x, weight):
        return decode_gemv_triton(
            x,
            weight,
            bias,
            norm_weight=norm_weight,
            norm_eps=norm_eps,
            swiglu=swiglu,
            residual=residual,
            pdl=pdl,
        )
    return decode_gemv_reference(
        x,
        weight,
        bias,
        norm_weight=norm_weight,
        norm_eps=norm_eps,
        swiglu=swiglu,
        residual=residual,
    )


def _decode_gemv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    pdl: bool | None,
    rope: RotaryCacheWrite,
) -> torch.Tensor:
    if use_triton(x, weight):
        return decode_gemv_triton(
            x,
            weight,
            bias,
            norm_weight=norm_weight,
            norm_eps=norm_eps,
            pdl=pdl,
            rope=rope,
        )
    qkv = decode_gemv_reference(x, weight, bias, norm_weight=norm_weight, norm_eps=norm_eps)
    q, k, v = rope.split(qkv)
    rotated = rotary_kv_write_reference(
        q, k, v, rope.cos, rope.sin, rope.k_cache, rope.v_cache, rope.slot_mapping
    )
    return rotated.flatten(-2)


@_compile.custom_op(
    "decode_gemv",
    "(Tensor x, Tensor weight, Tensor? bias, Tensor? norm_weight, float norm_eps, bool swiglu, "
    "Tensor? residual) -> Tensor",
)
def _decode_gemv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    swiglu: bool,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    return _decode_gemv_run(x, weight, bias, norm_weight, norm_eps, swiglu, residual)


def _decode_gemv_fake(x, weight, bias, norm_weight, norm_eps, swiglu, residual):  # type: ignore[no-untyped-def]
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    return x.new_empty((x.shape[0], n))


_decode_gemv_op.register_fake(_decode_gemv_fake)
