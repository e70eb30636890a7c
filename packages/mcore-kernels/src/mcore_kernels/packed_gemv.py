"""Decode projections of 1-4 rows whose weight tiles stay packed in registers until used.

:func:`mcore_kernels.decode_gemv.decode_gemv` requests a program's weight tile before its
programmatic-dependent-launch wait, but the compiled kernel holds the tile twice over the wait
(as loaded and as float32), so few programs fit a multiprocessor: the gate/up projection of
the Qwen2.5-0.5B shape (1216 programs of ``[2 x 4, 896]``) takes 95 registers a thread, five
programs a multiprocessor, and only 660 programs have their weights in flight before the
previous kernel ends; the rest load theirs afterwards, a second wave. This kernel loads the
weight as 32-bit words (two bfloat16 values each), keeps them packed while it waits, and
unpacks each word next to its products (a shift or a mask makes a bfloat16 a float32): the
same tile takes 56 registers a thread, and 8-row programs (608 of them) 96, five a
multiprocessor: every program has its weights in flight before the wait. One H200, the
captured batch-1 step of that shape: 444.6-449.3 against 487.0-493.9 us with ``decode_gemv``
(docs/benchmarks/inference.md, session 15).

Each program owns ``block_n`` output columns and the whole reduction (``K`` up to
:data:`PACKED_GEMV_MAX_K`, one tile): under PDL it requests its weight rows (gate and up rows
with ``swiglu``) and the norm weight, waits, then per row of ``x``: the RMSNorm in float32
rounded to the dtype (as ``decode_gemv``'s prologue), the float32 products, one rounding, the
SwiGLU and the residual add (``decode_gemv``'s epilogue). Results are those of
:func:`mcore_kernels.reference.packed_gemv_reference` up to the order of the float32 sums.

Shapes: ``x`` ``[M, K]`` (``M`` at most :data:`PACKED_GEMV_MAX_ROWS`, rows contiguous),
``weight`` ``[N, K]`` contiguous, ``norm_weight`` ``[K]``, ``residual`` ``[M, N_out]``;
returns ``[M, N_out]`` (``N_out = N // 2`` with ``swiglu``). bfloat16 only, ``K`` even.

Dispatch: Triton on CUDA, the torch reference elsewhere (``MCORE_KERNELS_BACKEND`` overrides;
with ``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors). While ``torch.compile``
traces a call it becomes ``torch.ops.mcore_kernels.packed_gemv``.
"""

from __future__ import annotations

import dataclasses

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    CachedLauncher,
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    pdl_supported,
    round_to,
    tl,
    triton,
)
from mcore_kernels.decode_gemv import _check_args
from mcore_kernels.decode_gemv_epilogues import _epilogue
from mcore_kernels.errors import (
    KernelBackendError,
    KernelDtypeError,
    KernelShapeError,
    KernelValueError,
)
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import packed_gemv_reference

__all__ = [
    "PACKED_GEMV_MAX_K",
    "PACKED_GEMV_MAX_ROWS",
    "PackedGemvConfig",
    "packed_gemv",
    "packed_gemv_reference",
    "packed_gemv_supports",
]

PACKED_GEMV_MAX_K = 8192
"""Longest reduction held as one tile (longer ones: :func:`packed_gemv_supports` is False)."""
PACKED_GEMV_MAX_ROWS = 4
"""Most rows of ``x`` per call (the kernel unrolls a pass per row)."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class PackedGemvConfig:
    """Launch configuration of :func:`packed_gemv`."""

    block_n: int = 4
    """Output columns per program (weight rows; gate and up rows each with ``swiglu``)."""
    num_warps: int = 4
    """Warps per program."""

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise KernelValueError(f"PackedGemvConfig.{name}={value}; expected a power of two")


@jit
def _unpack(words):
    """The even (low half) and odd (high half) bfloat16 values of int32 ``words`` as float32."""
    low = (words << 16).to(tl.float32, bitcast=True)
    high = (words & -65536).to(tl.float32, bitcast=True)
    return low, high


@jit(do_not_specialize=("M",))
def _packed_gemv_kernel(
    x_ptr,
    w_ptr,
    norm_ptr,
    res_ptr,
    out_ptr,
    M,
    N_OUT,
    stride_xm,
    stride_rm,
    stride_om,
    eps,
    K: tl.constexpr,
    WORDS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    # Columns past N_OUT read row 0 (never stored): the loads stay unmasked along N.
    rows = tl.where(n_mask, offs_n, 0).to(tl.int64)
    HALF_K: tl.constexpr = K // 2
    words = tl.arange(0, WORDS)
    k_mask = words < HALF_K
    w_words = w_ptr.to(tl.pointer_type(tl.int32))
    # The weights (and the norm weight) do not depend on the previous kernel: requested first.
    w = tl.load(w_words + rows[:, None] * HALF_K + words[None, :], mask=k_mask[None, :], other=0)
    w_up = w
    if SWIGLU:
        w_up = tl.load(
            w_words + (rows + N_OUT)[:, None] * HALF_K + words[None, :],
            mask=k_mask[None, :],
            other=0,
        )
    gamma = words
    if HAS_NORM:
        gamma = tl.load(norm_ptr.to(tl.pointer_type(tl.int32)) + words, mask=k_mask, other=0)
    if USE_PDL:
        gdc_wait()
    x_words = x_ptr.to(tl.pointer_type(tl.int32))
    for r in tl.static_range(ROWS):
        # Rows past M re-read row M - 1; their results are never stored.
        m = tl.minimum(r, M - 1)
        x_low, x_high = _unpack(
            tl.load(x_words + m * (stride_xm // 2) + words, mask=k_mask, other=0)
        )
        if HAS_NORM:
            scale = 1.0 / tl.sqrt(tl.sum(x_low * x_low + x_high * x_high, axis=0) / K + eps)
            gamma_low, gamma_high = _unpack(gamma)
            x_low = round_to(x_low * scale * gamma_low, dtype).to(tl.float32)
            x_high = round_to(x_high * scale * gamma_high, dtype).to(tl.float32)
        w_low, w_high = _unpack(w)
        acc = tl.sum(w_low * x_low[None, :] + w_high * x_high[None, :], axis=1)
        acc_up = acc
        if SWIGLU:
            up_low, up_high = _unpack(w_up)
            acc_up = tl.sum(up_low * x_low[None, :] + up_high * x_high[None, :], axis=1)
        offs_m = tl.zeros([1], tl.int32) + r
        _epilogue(
            acc[None, :], acc_up[None, :], out_ptr, res_ptr, out_ptr, offs_m, offs_n,
            offs_m < M, N_OUT, stride_rm, stride_om, False, HAS_RESIDUAL, SWIGLU, dtype,
            acc, acc, acc, False,
        )  # fmt: skip


_LAUNCH = CachedLauncher(_packed_gemv_kernel)
_LAUNCH_PDL = CachedLauncher(_packed_gemv_kernel, launch_pdl=True)


def packed_gemv_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`packed_gemv` takes these operands (else use ``decode_gemv``).

    Args:
        x: ``[M, K]`` input rows.
        weight: ``[N, K]`` weight.

    Returns:
        True for bfloat16 operands of at most :data:`PACKED_GEMV_MAX_ROWS` rows, an even ``K``
        of at most :data:`PACKED_GEMV_MAX_K`, a contiguous weight and 4-byte aligned rows.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return False
    rows, k = x.shape
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and 1 <= rows <= PACKED_GEMV_MAX_ROWS
        and k % 2 == 0
        and 0 < k <= PACKED_GEMV_MAX_K
        and x.stride(1) == 1
        and x.stride(0) % 2 == 0
        and x.data_ptr() % 4 == 0
        and weight.is_contiguous()
        and weight.data_ptr() % 4 == 0
    )


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    swiglu: bool,
) -> int:
    # decode_gemv's argument checks without a bias (the same messages for the same inputs).
    return _check_args(x, weight, None, norm_weight, residual, swiglu)


def packed_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
    config: PackedGemvConfig | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """Triton path of :func:`packed_gemv` (fixed shapes, graph-safe).

    Args:
        x: ``[M, K]`` bfloat16 input rows.
        weight: ``[N, K]`` contiguous bfloat16 weight.
        norm_weight: Optional ``[K]`` RMSNorm weight applied to ``x`` first.
        norm_eps: RMSNorm epsilon.
        swiglu: Treat ``weight`` as gate rows then up rows and return ``silu(gate) * up``.
        residual: Optional ``[M, N_out]`` tensor added to the result.
        config: Launch configuration (None: :class:`PackedGemvConfig`'s defaults).
        pdl: Launch with programmatic dependent launch where supported (None: inside
            :func:`mcore_kernels.pdl.programmatic_dependent_launch` only).

    Returns:
        ``[M, N_out]`` bfloat16.

    Raises:
        KernelShapeError: If the shapes or layouts do not match the module's.
        KernelDtypeError: If the dtypes are not bfloat16 (or differ).
        KernelBackendError: If Triton is not installed.
    """
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    n_out = _check(x, weight, norm_weight, residual, swiglu)
    if not packed_gemv_supports(x, weight):
        if x.dtype != torch.bfloat16:
            raise KernelDtypeError(f"x {x.dtype}; expected bfloat16 (packed pairs)")
        raise KernelShapeError(
            f"x {tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)}; expected "
            f"1..{PACKED_GEMV_MAX_ROWS} rows with unit stride, an even K <= "
            f"{PACKED_GEMV_MAX_K} and a contiguous weight"
        )
    if residual is not None and residual.stride(1) != 1:
        raise KernelShapeError(f"residual strides {residual.stride()}; expected stride 1 last")
    config = config or PackedGemvConfig()
    rows, k = x.shape
    out = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    if n_out == 0:
        return out
    use_pdl = pdl_enabled(x.device) if pdl is None else pdl and pdl_supported(x.device)
    launcher = _LAUNCH_PDL if use_pdl else _LAUNCH
    launcher(
        (triton.cdiv(n_out, config.block_n),),
        (
            x,
            weight,
            norm_weight if norm_weight is not None else weight,
            residual if residual is not None else out,
            out,
            rows,
            n_out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            float(norm_eps),
        ),
        {
            "K": k,
            "WORDS": next_power_of_2(k // 2),
            "ROWS": rows,
            "BLOCK_N": config.block_n,
            "HAS_NORM": norm_weight is not None,
            "HAS_RESIDUAL": residual is not None,
            "SWIGLU": swiglu,
            "USE_PDL": use_pdl,
        },
        config.num_warps,
        x.get_device(),
    )
    return out


def packed_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
    config: PackedGemvConfig | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``[RMSNorm] -> x @ weight.T -> [SwiGLU] -> [+ residual]`` of 1-4 bfloat16 rows.

    The values of :func:`mcore_kernels.decode_gemv.decode_gemv` without a bias (up to the
    order of the float32 sums); see the module docstring for when it is faster.

    Args:
        x: ``[M, K]`` input rows (see :func:`packed_gemv_supports`).
        weight: ``[N, K]`` weight (gate rows then up rows with ``swiglu``).
        norm_weight: Optional ``[K]`` RMSNorm weight: ``x`` is normalised (float32, rounded to
            its dtype) before the projection.
        norm_eps: RMSNorm epsilon.
        swiglu: Return ``silu(gate) * up`` (``[M, N // 2]``) instead of the projection.
        residual: Optional ``[M, N_out]`` tensor added to the result (rounded once more).
        config: Launch configuration of the Triton path (None: :class:`PackedGemvConfig`'s
            defaults).
        pdl: Launch with programmatic dependent launch where the device supports it (None:
            inside :func:`mcore_kernels.pdl.programmatic_dependent_launch` only).

    Returns:
        ``[M, N_out]`` in the dtype of ``x``.

    Raises:
        KernelShapeError: If the shapes do not match, or the Triton path gets operands that
            :func:`packed_gemv_supports` rejects.
        KernelDtypeError: If the dtypes differ, or the Triton path gets another dtype than
            bfloat16.
        KernelBackendError: If ``MCORE_KERNELS_BACKEND`` names a backend that cannot run here.
    """
    _check(x, weight, norm_weight, residual, swiglu)
    config = config or PackedGemvConfig()
    if _compile.compiling():
        return _packed_gemv_op(
            x,
            weight,
            norm_weight,
            float(norm_eps),
            swiglu,
            residual,
            config.block_n,
            config.num_warps,
            pdl,
        )
    return _packed_gemv_run(x, weight, norm_weight, norm_eps, swiglu, residual, config, pdl)


def _packed_gemv_run(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    swiglu: bool,
    residual: torch.Tensor | None,
    config: PackedGemvConfig,
    pdl: bool | None,
) -> torch.Tensor:
    if use_triton(x, weight):
        return packed_gemv_triton(
            x,
            weight,
            norm_weight=norm_weight,
            norm_eps=norm_eps,
            swiglu=swiglu,
            residual=residual,
            config=config,
            pdl=pdl,
        )
    return packed_gemv_reference(
        x, weight, norm_weight=norm_weight, norm_eps=norm_eps, swiglu=swiglu, residual=residual
    )


@_compile.custom_op(
    "packed_gemv",
    "(Tensor x, Tensor weight, Tensor? norm_weight, float norm_eps, bool swiglu, "
    "Tensor? residual, int block_n, int num_warps, bool? pdl) -> Tensor",
)
def _packed_gemv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    swiglu: bool,
    residual: torch.Tensor | None,
    block_n: int,
    num_warps: int,
    pdl: bool | None,
) -> torch.Tensor:
    config = PackedGemvConfig(block_n=block_n, num_warps=num_warps)
    return _packed_gemv_run(x, weight, norm_weight, norm_eps, swiglu, residual, config, pdl)


@_packed_gemv_op.register_fake
def _packed_gemv_fake(x, weight, norm_weight, norm_eps, swiglu, residual, *rest):  # type: ignore[no-untyped-def]
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    return x.new_empty((x.shape[0], n))
