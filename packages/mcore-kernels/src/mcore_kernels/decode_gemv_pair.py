"""Two dependent decode projections of one or two rows in one launch (:func:`decode_gemv_pair`).

At batch 1 a decoder layer is a chain of dependent launches, and each link costs the wait for
the end of the previous grid on top of the memory round trips of the work itself. This kernel
runs two projections of the chain, the second reading the first's output, as one grid: the
first projection's programs come first and each, after storing its output columns, adds one
to a counter (release); the second's programs, dispatched after all of them, request their
weight tiles, wait until the counter reaches the first projection's program count (acquire
loads), and finish as :func:`mcore_kernels.decode_gemv.decode_gemv` does. No program waits on
a program dispatched after it, so the wait always ends.

Each projection is the vector path of ``decode_gemv`` (rows up to 2, one weight tile column
block per program, no split-K) with the same fused pro- and epilogues: the RMSNorm of the
input rows, bias, SwiGLU, the residual add, and for the second projection RoPE with the
key/value cache write (``second_rope``). Sums run in float32 in the order of
``decode_gemv``'s vector path; results equal the two ``decode_gemv`` calls up to the
reduction layout within a tile (the pair's warps per program).

Counters (:func:`pair_counters`): one int32 slot per call of a cycle of calls that run in
slot order ``0, 1, ..., S - 1, 0, 1, ...`` on one stream (``S >= 2``). The call of slot ``s``
counts in its slot and sets slot ``(s + 1) % S`` to zero for the next call: that slot's last
user finished before this call's programs passed their wait for the previous kernel, and its
next user starts counting only after this call has ended. A cycle that stops in the middle
(an error between two calls) leaves its counters set: zero them (``counters.zero_()``) before
the next call.

Dispatch: Triton on CUDA (``TRITON_INTERPRET=1`` runs it on CPU tensors); elsewhere, or with
``MCORE_KERNELS_BACKEND=torch``, the two ``decode_gemv`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    _INTERPRETED,
    CachedLauncher,
    device_limits,
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    pdl_supported,
    tl,
    triton,
)
from mcore_kernels.decode_gemv import _check_args, _rope_args, decode_gemv
from mcore_kernels.decode_gemv_config import gemv_config
from mcore_kernels.decode_gemv_epilogues import (
    _early_bias,
    _early_inputs,
    _epilogue,
    _rope_epilogue,
)
from mcore_kernels.decode_gemv_tiles import _accumulate, _load_tile, _row_scales
from mcore_kernels.errors import KernelBackendError, KernelShapeError, KernelValueError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.rotary_kv_write import RotaryCacheWrite

__all__ = [
    "PAIR_MAX_ROWS",
    "PAIR_SLOT_STRIDE",
    "PAIR_WAIT",
    "GemvStage",
    "decode_gemv_pair",
    "pair_counters",
]

PAIR_MAX_ROWS = 2
"""Most rows :func:`decode_gemv_pair` takes (the vector path of ``decode_gemv``)."""
PAIR_SLOT_STRIDE = 64
"""int32 elements between two counter slots (two 128-byte lines each: the first and the
second projection's counts)."""
PAIR_WAIT = "load"
"""How the second projection's programs wait: ``"load"`` (every thread polls with acquire
loads) or ``"atomic"`` (one thread per program polls with an acquire atomic add of 0)."""
_WAITS = ("load", "atomic")
PAIR_WAIT_SLEEP_NS = 0
"""Nanoseconds a waiting program sleeps between two polls of the counter (0: none)."""


@dataclass(frozen=True, slots=True)
class GemvStage:
    """One projection of a :func:`decode_gemv_pair` launch (``decode_gemv``'s arguments)."""

    weight: torch.Tensor
    """``[N, K]`` weight; ``K`` is the previous projection's output width."""
    bias: torch.Tensor | None = None
    """Optional ``[N]`` bias."""
    norm_weight: torch.Tensor | None = None
    """Optional RMSNorm weight applied to the input rows first."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    swiglu: bool = False
    """Gate-then-up SwiGLU (``[M, N // 2]`` output)."""
    residual: torch.Tensor | None = None
    """Optional ``[M, N_out]`` tensor added to the output."""
    rope: RotaryCacheWrite | None = None
    """RoPE and the key/value cache write folded in (the last projection only)."""


def pair_counters(slots: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed counters for a cycle of ``slots`` :func:`decode_gemv_pair` calls.

    Args:
        slots: Calls per cycle (>= 2).
        device: Device of the calls.

    Returns:
        An int32 tensor of ``slots * PAIR_SLOT_STRIDE`` zeros.

    Raises:
        KernelValueError: If ``slots`` < 2.
    """
    if slots < 2:
        raise KernelValueError(f"slots={slots}; expected >= 2 (a call zeroes the next slot)")
    return torch.zeros(slots * PAIR_SLOT_STRIDE, dtype=torch.int32, device=device)


@jit
def _load_acquire(pointers):
    """``ld.acquire.gpu`` of each pointer (every thread that holds one acquires)."""
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];",
        "=r,l",
        [pointers],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@jit
def _sleep(value, NS: tl.constexpr):
    """``value`` after ``nanosleep`` of about ``NS`` ns (fewer polls of a counter)."""
    return tl.inline_asm_elementwise(
        f"nanosleep.u32 {NS};\n\tmov.b32 $0, $1;",
        "=r,r",
        [value],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@jit
def _wait_count(arrive_ptr, target, WAIT_ATOMIC: tl.constexpr, SLEEP_NS: tl.constexpr):
    """Spin until the counter at ``arrive_ptr`` reaches ``target`` (acquire)."""
    if _INTERPRETED or WAIT_ATOMIC:
        seen = tl.atomic_add(arrive_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            if SLEEP_NS > 0:
                seen = _sleep(seen, SLEEP_NS)
            seen = tl.atomic_add(arrive_ptr, 0, sem="acquire", scope="gpu")
    else:
        pointers = arrive_ptr + tl.zeros([1], dtype=tl.int32)
        seen = tl.max(_load_acquire(pointers), axis=0)
        while seen < target:
            if SLEEP_NS > 0:
                seen = _sleep(seen, SLEEP_NS)
            seen = tl.max(_load_acquire(pointers), axis=0)


@jit
def _stage(
    pid_n,
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_ptr,
    res_ptr,
    out_ptr,
    M,
    N_OUT,
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
    wait_ptr,
    signal_ptr,
    reset_ptr,
    reset2_ptr,
    wait_target,
    K: tl.constexpr,
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
    NORM_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    WAIT: tl.constexpr,
    SIGNAL: tl.constexpr,
    RESET: tl.constexpr,
    WAIT_ATOMIC: tl.constexpr,
    SLEEP_NS: tl.constexpr,
):
    """One program of one projection: weights before the waits, then decode_gemv's vector
    path (first tile, middle tiles, masked tail) and epilogue; ``WAIT``: the counter wait
    before reading ``x``; ``SIGNAL``: count this program's stores, and (program 0) zero the
    next call's counter."""
    dtype = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    if ROPE:
        pair = tl.where(n_mask, offs_n, 0)
        first_rows = (pair // HALF) * (2 * HALF) + pair % HALF
        w_rows = first_rows.to(tl.int64) * stride_wn
        up_rows = (first_rows + HALF).to(tl.int64) * stride_wn
    else:
        w_rows = tl.where(n_mask, offs_n, 0).to(tl.int64) * stride_wn
        up_rows = (tl.where(n_mask, offs_n, 0) + N_OUT).to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    k_full: tl.constexpr = (K // BLOCK_K) * BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    scales = tl.zeros([BLOCK_M], dtype=tl.float32)
    first = offs_k
    # Everything that does not depend on the previous launches, before the waits.
    w, w_up = _load_tile(w_ptr, w_rows, up_rows, first, K, PAIRED, k_full == 0)
    gamma = scales
    if HAS_NORM:
        gamma = tl.load(norm_ptr + first, mask=first < K, other=0.0).to(tl.float32)
    pre_bias, pre_bias_up = _early_bias(
        bias_ptr, offs_n, n_mask, N_OUT, HAS_BIAS, ROPE, SWIGLU, HALF
    )
    tail_w = w
    tail_w_up = w_up
    if k_full == BLOCK_K and K > BLOCK_K:
        tail_w, tail_w_up = _load_tile(w_ptr, w_rows, up_rows, k_full + offs_k, K, PAIRED, True)
    if WAIT:
        _wait_count(wait_ptr, wait_target, WAIT_ATOMIC, SLEEP_NS)
    if USE_PDL:
        gdc_wait()
    if RESET:  # noqa: SIM102 - a constexpr and a runtime test
        if pid_n == 0:
            # The next call's counters: their last user has ended (see the module docstring).
            tl.atomic_xchg(reset_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(reset2_ptr, 0, sem="relaxed", scope="gpu")
    pre_res, pre_cos, pre_sin = _early_inputs(
        res_ptr, cos_ptr, sin_ptr, offs_m, offs_n, m_mask, n_mask, stride_rm,
        stride_cos, stride_sin, HAS_RESIDUAL, ROPE, HALF,
    )  # fmt: skip
    if HAS_NORM:
        scales = _row_scales(x_ptr, offs_m, m_mask, K, stride_xm, eps, BLOCK_M, NORM_BLOCK)
    k_end = K
    acc, acc_up = _accumulate(
        acc, acc_up, w, w_up, x_ptr, w_ptr, norm_ptr, scales, offs_m, m_mask, w_rows,
        up_rows, first, k_end, M, stride_xm, 0,
        HAS_NORM, PAIRED, BLOCK_M, False, k_full == 0, "ieee", False, True,
        gamma, HAS_NORM,
    )  # fmt: skip
    if k_full > BLOCK_K:
        for start in range(BLOCK_K, k_full, BLOCK_K):
            acc, acc_up = _accumulate(
                acc, acc_up, acc, acc, x_ptr, w_ptr, norm_ptr, scales, offs_m, m_mask, w_rows,
                up_rows, start + offs_k, k_end, M, stride_xm, 0,
                HAS_NORM, PAIRED, BLOCK_M, False, False, "ieee", False, False,
                scales, False,
            )  # fmt: skip
    if k_full < K and k_full > 0:
        acc, acc_up = _accumulate(
            acc, acc_up, tail_w, tail_w_up, x_ptr, w_ptr, norm_ptr, scales, offs_m, m_mask,
            w_rows, up_rows, k_full + offs_k, k_end, M, stride_xm, 0,
            HAS_NORM, PAIRED, BLOCK_M, False, True, "ieee", False, k_full == BLOCK_K,
            scales, False,
        )  # fmt: skip
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
    if SIGNAL:
        # Every thread's stores precede the count (release), as in decode_gemv's tickets.
        tl.debug_barrier()
        tl.atomic_add(signal_ptr, 1, sem="release", scope="gpu")


@jit
def _gemv_pair_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_ptr,
    res_ptr,
    mid_ptr,
    w2_ptr,
    bias2_ptr,
    norm2_ptr,
    res2_ptr,
    out_ptr,
    w3_ptr,
    bias3_ptr,
    norm3_ptr,
    res3_ptr,
    out3_ptr,
    M,
    N_MID,
    N_OUT,
    N_OUT3,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_mm,
    stride_wn2,
    stride_rm2,
    stride_om,
    stride_wn3,
    stride_rm3,
    stride_om3,
    eps,
    eps2,
    eps3,
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
    arrive_ptr,
    arrive2_ptr,
    reset_ptr,
    reset2_ptr,
    GRID_1,
    GRID_2,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    K2: tl.constexpr,
    HAS_BIAS2: tl.constexpr,
    HAS_NORM2: tl.constexpr,
    HAS_RESIDUAL2: tl.constexpr,
    SWIGLU2: tl.constexpr,
    ROPE2: tl.constexpr,
    PAIRED2: tl.constexpr,
    BLOCK_N2: tl.constexpr,
    BLOCK_K2: tl.constexpr,
    NORM_BLOCK2: tl.constexpr,
    THREE: tl.constexpr,
    K3: tl.constexpr,
    HAS_BIAS3: tl.constexpr,
    HAS_NORM3: tl.constexpr,
    HAS_RESIDUAL3: tl.constexpr,
    SWIGLU3: tl.constexpr,
    ROPE3: tl.constexpr,
    PAIRED3: tl.constexpr,
    BLOCK_N3: tl.constexpr,
    BLOCK_K3: tl.constexpr,
    NORM_BLOCK3: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr,
    WAIT_ATOMIC: tl.constexpr,
    SLEEP_NS: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if pid < GRID_1:
        _stage(
            pid, x_ptr, w_ptr, bias_ptr, norm_ptr, res_ptr, mid_ptr, M, N_MID, stride_xm,
            stride_wn, stride_rm, stride_mm, eps,
            x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, 0, 0, 0, 0, 0, 0, 0, 0,
            arrive_ptr, arrive_ptr, reset_ptr, reset2_ptr, 0,
            K, HAS_BIAS, HAS_NORM, HAS_RESIDUAL, SWIGLU, False, SWIGLU, 1, BLOCK_M, BLOCK_N,
            BLOCK_K, NORM_BLOCK, USE_PDL, False, True, True, WAIT_ATOMIC, SLEEP_NS,
        )  # fmt: skip
    elif pid < GRID_1 + GRID_2:
        _stage(
            pid - GRID_1, mid_ptr, w2_ptr, bias2_ptr, norm2_ptr, res2_ptr, out_ptr, M, N_OUT,
            stride_mm, stride_wn2, stride_rm2, stride_om, eps2,
            cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin,
            stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head, NUM_Q_HEADS,
            NUM_KV_HEADS,
            arrive_ptr, arrive2_ptr, reset_ptr, reset2_ptr, GRID_1,
            K2, HAS_BIAS2, HAS_NORM2, HAS_RESIDUAL2, SWIGLU2, ROPE2, PAIRED2, HALF,
            BLOCK_M, BLOCK_N2, BLOCK_K2, NORM_BLOCK2, USE_PDL, True, THREE, False, WAIT_ATOMIC, SLEEP_NS,
        )  # fmt: skip
    else:
        if THREE:
            _stage(
                pid - GRID_1 - GRID_2, out_ptr, w3_ptr, bias3_ptr, norm3_ptr, res3_ptr, out3_ptr,
                M, N_OUT3, stride_om, stride_wn3, stride_rm3, stride_om3, eps3,
                cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin,
                stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head, NUM_Q_HEADS,
                NUM_KV_HEADS,
                arrive2_ptr, arrive2_ptr, reset_ptr, reset2_ptr, GRID_2,
                K3, HAS_BIAS3, HAS_NORM3, HAS_RESIDUAL3, SWIGLU3, ROPE3, PAIRED3, HALF,
                BLOCK_M, BLOCK_N3, BLOCK_K3, NORM_BLOCK3, USE_PDL, True, False, False,
                WAIT_ATOMIC, SLEEP_NS,
            )  # fmt: skip


_PAIR = CachedLauncher(_gemv_pair_kernel)
_PAIR_PDL = CachedLauncher(_gemv_pair_kernel, launch_pdl=True)


def _stage_config(
    rows: int, columns: int, k: int, rope: bool, multiprocessors: int
) -> tuple[int, int, int]:
    """``(block_n, block_k, warps)`` of one projection: ``decode_gemv``'s own choice."""
    config = gemv_config(rows, columns, k, multiprocessors)
    block_n = max(1, config.block_n // 2) if rope else config.block_n
    return block_n, config.block_k, config.num_warps


def decode_gemv_pair(
    x: torch.Tensor,
    weight: torch.Tensor,
    second_weight: torch.Tensor,
    *,
    counters: torch.Tensor,
    slot: int,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
    second_bias: torch.Tensor | None = None,
    second_norm_weight: torch.Tensor | None = None,
    second_norm_eps: float = 1e-6,
    second_swiglu: bool = False,
    second_residual: torch.Tensor | None = None,
    second_rope: RotaryCacheWrite | None = None,
    third: GemvStage | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, ...]:
    """``y = decode_gemv(x, weight, ...)`` then ``decode_gemv(y, second_weight, ...)``, one launch.

    Args:
        x: ``[M, K]`` input rows, ``M <= PAIR_MAX_ROWS``.
        weight: ``[N, K]`` weight of the first projection.
        second_weight: ``[N2, N_out]`` weight of the second (its input is the first's output).
        counters: :func:`pair_counters` of the cycle of calls this one belongs to.
        slot: This call's slot in the cycle (see the module docstring).
        bias: Optional ``[N]`` bias of the first projection.
        norm_weight: Optional ``[K]`` RMSNorm weight applied to ``x`` first.
        norm_eps: Its epsilon.
        swiglu: The first projection is a gate-then-up SwiGLU (``[M, N // 2]`` output).
        residual: Optional ``[M, N_out]`` added to the first projection's output.
        second_bias: Optional bias of the second projection.
        second_norm_weight: Optional RMSNorm weight applied to the first's output.
        second_norm_eps: Its epsilon.
        second_swiglu: The second projection is a gate-then-up SwiGLU.
        second_residual: Optional residual added to the second projection's output.
        second_rope: RoPE and the key/value cache write folded into the second projection
            (``decode_gemv(..., rope=)``: it returns the rotated queries). Not with ``third``.
        third: A third projection of the second's output in the same launch (its programs
            wait on a second counter of the slot).
        pdl: Programmatic dependent launch (None: inside
            :func:`mcore_kernels.pdl.programmatic_dependent_launch` only).

    Returns:
        The projections' outputs (two, or three with ``third``), as the ``decode_gemv`` calls
        return them.

    Raises:
        KernelShapeError: If the shapes do not chain or ``M > PAIR_MAX_ROWS``.
        KernelValueError: If ``slot`` is outside the counters, ``second_rope`` comes with
            ``third``, or a ``rope`` with ``swiglu`` or a residual.
        KernelDtypeError: If a dtype is unsupported.
        KernelBackendError: If the Triton path is requested without Triton.
    """
    first = GemvStage(weight, bias, norm_weight, norm_eps, swiglu, residual)
    second = GemvStage(
        second_weight, second_bias, second_norm_weight, second_norm_eps, second_swiglu,
        second_residual, second_rope,
    )  # fmt: skip
    stages = [first, second] if third is None else [first, second, third]
    if x.shape[0] > PAIR_MAX_ROWS:
        raise KernelShapeError(f"x has {x.shape[0]} rows; expected at most {PAIR_MAX_ROWS}")
    if third is not None and second_rope is not None:
        raise KernelValueError("second_rope with a third projection; expected RoPE last")
    if first.rope is not None:
        raise KernelValueError("the first projection cannot take rope")
    inputs = x
    for index, stage in enumerate(stages):
        if index and (stage.weight.dim() != 2 or stage.weight.shape[1] != inputs.shape[1]):
            raise KernelShapeError(
                f"projection {index + 1} weight {tuple(stage.weight.shape)}; expected "
                f"[N, {inputs.shape[1]}] (the previous projection's outputs)"
            )
        width = _check_args(
            inputs, stage.weight.to("meta") if index else stage.weight, stage.bias,
            stage.norm_weight, stage.residual, stage.swiglu, stage.rope,
        )  # fmt: skip
        inputs = torch.empty((x.shape[0], width), dtype=x.dtype, device="meta")
    slots = counters.numel() // PAIR_SLOT_STRIDE
    if counters.dtype != torch.int32 or slots < 2 or not 0 <= slot < slots:
        raise KernelValueError(
            f"slot={slot} of int32 counters of {slots} slots; expected pair_counters(S >= 2) "
            "and 0 <= slot < S"
        )
    if not use_triton(x, weight):
        outputs = []
        inputs = x
        for stage in stages:
            inputs = decode_gemv(
                inputs, stage.weight, stage.bias, norm_weight=stage.norm_weight,
                norm_eps=stage.norm_eps, swiglu=stage.swiglu, residual=stage.residual, pdl=pdl,
                rope=stage.rope,
            )  # fmt: skip
            outputs.append(inputs)
        return tuple(outputs)
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    if PAIR_WAIT not in _WAITS:
        raise KernelValueError(f"PAIR_WAIT={PAIR_WAIT!r}; expected one of {_WAITS}")
    return _pair_triton(x, stages, counters, slot, slots, pdl)


def _stage_args(stage: GemvStage | None, rows: int, x: torch.Tensor, multiprocessors: int):  # type: ignore[no-untyped-def]
    """``(tensors, out, columns, strides, eps, constexprs, grid, warps)`` of one stage."""
    if stage is None:
        dummy = x
        return (dummy,) * 4, dummy, 0, (0, 0, 0), 0.0, _stage_constexprs(None, 1, 16, 16, 1), 0, 1
    k = x.shape[1]
    weight = stage.weight
    if not weight.is_contiguous():
        raise KernelShapeError("every projection's weight must be contiguous")
    if stage.residual is not None and stage.residual.stride(-1) != 1:
        raise KernelShapeError(
            f"residual strides {stage.residual.stride()}; expected stride 1 last"
        )
    n = weight.shape[0]
    columns = n // 2 if (stage.swiglu or stage.rope is not None) else n
    n_out = stage.rope.num_q_heads * stage.rope.head_dim if stage.rope is not None else columns
    out = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = _stage_config(
        rows, columns, k, stage.rope is not None, multiprocessors
    )
    block_m = min(4, next_power_of_2(rows))
    norm_block = (
        min(next_power_of_2(k), max(256, 8192 // block_m)) if stage.norm_weight is not None else 16
    )
    tensors = tuple(
        t if t is not None else x for t in (stage.bias, stage.norm_weight, stage.residual)
    )
    strides = (
        weight.stride(0),
        stage.residual.stride(0) if stage.residual is not None else 0,
        out.stride(0),
    )
    constexprs = _stage_constexprs(stage, k, block_n, block_k, norm_block)
    return (
        (weight, *tensors),
        out,
        columns,
        strides,
        float(stage.norm_eps),
        constexprs,
        triton.cdiv(columns, block_n),
        warps,
    )


def _stage_constexprs(
    stage: GemvStage | None, k: int, block_n: int, block_k: int, norm_block: int
) -> tuple:
    if stage is None:
        return (16, False, False, False, False, False, False, 1, 16, 16)
    rope = stage.rope is not None
    return (
        k,
        stage.bias is not None,
        stage.norm_weight is not None,
        stage.residual is not None,
        stage.swiglu,
        rope,
        stage.swiglu or rope,
        block_n,
        block_k,
        norm_block,
    )


def _pair_triton(
    x: torch.Tensor,
    stages: list[GemvStage],
    counters: torch.Tensor,
    slot: int,
    slots: int,
    pdl: bool | None,
) -> tuple[torch.Tensor, ...]:
    if x.stride(-1) != 1:
        raise KernelShapeError(f"x strides {x.stride()}; expected stride 1 last")
    rows = x.shape[0]
    multiprocessors = device_limits(x.device)[0]
    parts = []
    inputs = x
    for stage in stages:
        part = _stage_args(stage, rows, inputs, multiprocessors)
        parts.append(part)
        inputs = part[1]
    outputs = tuple(part[1] for part in parts)
    if rows == 0:
        return outputs
    three = len(stages) == 3
    if not three:
        parts.append(_stage_args(None, rows, x, multiprocessors))
    (t1, mid, n_mid, s1, eps1, c1, grid_1, w1) = parts[0]
    (t2, out2, n_out2, s2, eps2, c2, grid_2, w2) = parts[1]
    (t3, out3, n_out3, s3, eps3, c3, grid_3, w3) = parts[2]
    rope = next((stage.rope for stage in stages if stage.rope is not None), None)
    use_pdl = pdl_enabled(x.device) if pdl is None else pdl and pdl_supported(x.device)
    base = slot * PAIR_SLOT_STRIDE
    following = ((slot + 1) % slots) * PAIR_SLOT_STRIDE
    half = PAIR_SLOT_STRIDE // 2
    args = (
        x, *t1[:1], *t1[1:], mid,
        *t2[:1], *t2[1:], out2,
        *t3[:1], *t3[1:], out3,
        rows, n_mid, n_out2, n_out3,
        x.stride(0), s1[0], s1[1], s1[2],
        s2[0], s2[1], s2[2],
        s3[0], s3[1], s3[2],
        eps1, eps2, eps3,
        *_rope_args(rope, x),
        counters[base:], counters[base + half :], counters[following:],
        counters[following + half :],
        grid_1, grid_2,
    )  # fmt: skip
    names1 = (
        "K",
        "HAS_BIAS",
        "HAS_NORM",
        "HAS_RESIDUAL",
        "SWIGLU",
        None,
        None,
        "BLOCK_N",
        "BLOCK_K",
        "NORM_BLOCK",
    )
    constexprs = {name: value for name, value in zip(names1, c1, strict=True) if name}
    for suffix, values in (("2", c2), ("3", c3)):
        names = (
            "K",
            "HAS_BIAS",
            "HAS_NORM",
            "HAS_RESIDUAL",
            "SWIGLU",
            "ROPE",
            "PAIRED",
            "BLOCK_N",
            "BLOCK_K",
            "NORM_BLOCK",
        )
        constexprs.update({name + suffix: value for name, value in zip(names, values, strict=True)})
    constexprs.update(
        THREE=three,
        HALF=rope.head_dim // 2 if rope is not None else 1,
        BLOCK_M=min(4, next_power_of_2(rows)),
        USE_PDL=use_pdl,
        WAIT_ATOMIC=PAIR_WAIT == "atomic",
        SLEEP_NS=0 if not x.is_cuda else PAIR_WAIT_SLEEP_NS,
    )
    launcher = _PAIR_PDL if use_pdl else _PAIR
    grid = grid_1 + grid_2 + (grid_3 if three else 0)
    launcher((grid, 1, 1), args, constexprs, max(w1, w2, w3), x.get_device())
    return outputs
