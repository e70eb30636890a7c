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

Layout: launch configurations in :mod:`~mcore_kernels.decode_gemv_config`, the main loop's
building blocks in :mod:`~mcore_kernels.decode_gemv_tiles`, the epilogues in
:mod:`~mcore_kernels.decode_gemv_epilogues`, the kernels in
:mod:`~mcore_kernels.decode_gemv_kernel`; this module checks the arguments and launches.

Shapes: ``x`` ``[M, K]`` (last dimension contiguous), ``weight`` ``[N, K]`` contiguous,
``bias`` ``[N]``, ``norm_weight`` ``[K]``, ``residual`` ``[M, N_out]``; returns ``[M, N_out]``
with ``N_out = N`` (``N // 2`` with ``swiglu``).

Dispatch: Triton on CUDA, the torch reference on CPU; ``MCORE_KERNELS_BACKEND=torch|triton``
overrides (with ``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors).
"""

from __future__ import annotations

import dataclasses

import torch

from mcore_kernels import _compile, decode_gemv_config
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import device_limits, next_power_of_2, pdl_supported, triton
from mcore_kernels.decode_gemv_config import (
    WHOLE_ROW_MAX_K,
    WHOLE_ROW_WARPS,
    GemvConfig,
    block_rows,
    gemv_config,
)
from mcore_kernels.decode_gemv_kernel import _GEMV, _GEMV_PDL, _SUM_PARTIALS, _gemv_kernel, _tickets
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
    "WHOLE_ROW_MAX_K",
    "WHOLE_ROW_WARPS",
    "GemvConfig",
    "decode_gemv",
    "decode_gemv_triton",
    "gemv_config",
]


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
    early_tail = (
        decode_gemv_config.EARLY_TAIL and split_k == 1 and config.block_k < k < 2 * config.block_k
    )
    second_pass = split_k > 1 and config.reduce == "second_pass"
    if second_pass and rope is not None:
        raise KernelValueError("rope with GemvConfig.reduce='second_pass'; expected 'ticket'")
    ws = x
    tickets = x
    if split_k > 1:
        ws = torch.empty((split_k, 2, rows, columns), dtype=torch.float32, device=x.device)
        tickets = _tickets(x.device, grid_n * grid_m)
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
