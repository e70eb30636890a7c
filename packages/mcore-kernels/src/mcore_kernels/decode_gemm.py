"""Decode-step projections of tens to hundreds of rows as one tensor-core GEMM with the work
around the projection fused in.

A decode step of a dense model runs, per layer, four projections of ``M`` = one row per
sequence (64 to 512 at batch 64-512) plus a handful of small kernels around them: the RMSNorm
before the q/k/v and gate/up projections, the bias, SwiGLU between gate/up and down, the residual
adds. cuBLAS runs the projections well but cannot absorb that work, and each small kernel costs
1.5-2 us of a step even in a CUDA graph. :func:`decode_gemm` is a Triton GEMM (``tl.dot`` over
``BLOCK_M x BLOCK_N`` tiles, the reduction software-pipelined) with the prologues and epilogues of
:func:`mcore_kernels.decode_gemv.decode_gemv`, so a layer runs four projections, RoPE with the
cache write and the attention, and nothing else:

- prologue: RMSNorm of the input rows (``norm_weight``): every program computes the inverse
  RMS of its ``BLOCK_M`` rows from the rows themselves (a few KiB, in L2), then scales each
  input tile by it and the norm weight, rounded to the input dtype as the norm kernel rounds;
- epilogue: bias, SwiGLU over a ``[2F, K]`` gate-then-up weight (``swiglu=True``: each program
  computes matching gate and up columns and writes the ``[M, F]`` activation), and a residual
  add;
- split-K (:attr:`DecodeGemmConfig.split_k`) for projections with few output tiles (the down
  projection of a small model): float32 partials in a workspace, summed in split order by the
  last program of each tile (an atomic counter says which program is last; the sum never
  depends on the arrival order), then the epilogue: one launch, deterministic;
- under :func:`mcore_kernels.pdl.programmatic_dependent_launch` the programs start while the
  previous kernel runs and request their weights into L2 before they wait for it.

Values equal :func:`mcore_kernels.reference.decode_gemv_reference` up to the order of the
float32 sums. The order depends on the configuration (``block_k`` and ``split_k``) only, never on
the row count or on the other rows.

Configurations per shape and row count: :func:`decode_gemm_config` (measured on one H200, see
:mod:`mcore_kernels.decode_gemm_config`).

Measured on one H200 at the Qwen2.5-0.5B shapes, it beats cuBLAS only for small plain
projections at 64 rows (o: 3.83 against 4.25 us; q/k/v with RoPE + the cache write fused: 4.42
against 6.54 us for cuBLAS plus the RoPE kernel); the norm prologue costs about 5 us a launch
and the large projections run 1.5-3.6x slower than cuBLAS, so the inference engine keeps
cuBLAS (in its decode step even those two were slower, launched early under PDL).
"""

from __future__ import annotations

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import next_power_of_2, pdl_supported, triton
from mcore_kernels.decode_gemm_config import DecodeGemmConfig, decode_gemm_config
from mcore_kernels.decode_gemm_kernel import _DECODE_GEMM, _DECODE_GEMM_PDL
from mcore_kernels.decode_gemv import _check_args, _rope_args
from mcore_kernels.decode_gemv_kernel import _tickets
from mcore_kernels.errors import KernelBackendError, KernelShapeError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import decode_gemv_reference
from mcore_kernels.rotary_kv_write import RotaryCacheWrite, rotary_kv_write_reference

__all__ = ["DecodeGemmConfig", "decode_gemm", "decode_gemm_config"]


def decode_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
    config: DecodeGemmConfig | None = None,
    pdl: bool | None = None,
    rope: RotaryCacheWrite | None = None,
) -> torch.Tensor:
    """``[RMSNorm] -> x @ weight.T + bias -> [SwiGLU] -> [+ residual]`` as one Triton GEMM.

    Args:
        x: ``[M, K]`` input rows (last dimension contiguous).
        weight: ``[N, K]`` contiguous weight (gate rows then up rows with ``swiglu``).
        bias: Optional ``[N]`` bias.
        norm_weight: Optional ``[K]`` RMSNorm weight applied to ``x`` first.
        norm_eps: RMSNorm epsilon.
        swiglu: Return ``silu(gate) * up`` (``[M, N // 2]``).
        residual: Optional ``[M, N_out]`` tensor added to the result.
        config: Launch configuration; None picks :func:`decode_gemm_config`.
        pdl: Launch with programmatic dependent launch where the device supports it (None:
            inside :func:`mcore_kernels.pdl.programmatic_dependent_launch` only).
        rope: Fold RoPE and the key/value cache write into a q/k/v projection (as
            :func:`mcore_kernels.decode_gemv.decode_gemv` does): each program computes
            ``(j, j + D/2)`` channel pairs, rotates query and key heads, stores keys and values
            in their cache slots and returns only the rotated queries ``[M, Hq * D]``.

    Returns:
        ``[M, N_out]`` in the dtype of ``x`` (``N_out = N``, ``N // 2`` with ``swiglu``); the
        torch reference computes it where Triton does not run (CPU tensors without
        ``TRITON_INTERPRET=1``, or ``MCORE_KERNELS_BACKEND=torch``).

    Raises:
        KernelShapeError: If the shapes or strides do not match the layout above.
        KernelDtypeError: If the dtypes differ or are not floating point.
        KernelBackendError: If Triton is not installed.
    """
    n_out = _check_args(x, weight, bias, norm_weight, residual, swiglu, rope)
    if not use_triton(x):
        out = decode_gemv_reference(
            x, weight, bias, norm_weight=norm_weight, norm_eps=norm_eps, swiglu=swiglu,
            residual=residual,
        )  # fmt: skip
        if rope is None:
            return out
        q, key, value = rope.split(out)
        rotated = rotary_kv_write_reference(
            q, key, value, rope.cos, rope.sin, rope.k_cache, rope.v_cache, rope.slot_mapping
        )
        return rotated.flatten(-2)
    if triton is None:
        raise KernelBackendError("decode_gemm needs triton, which is not installed")
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
        config = decode_gemm_config(rows, columns, k, swiglu=swiglu or rope is not None)
    grid_n = triton.cdiv(columns, config.block_n)
    grid_m = triton.cdiv(rows, config.block_m)
    k_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(k, k_split)
    ws = x
    tickets = x
    if split_k > 1:
        ws = torch.empty((split_k, 2, rows, columns), dtype=torch.float32, device=x.device)
        tickets = _tickets(x.device, grid_n * grid_m)
    interpreting = not x.is_cuda
    use_pdl = pdl_enabled(x.device) if pdl is None else pdl and pdl_supported(x.device)
    args = (
        x,
        weight,
        bias if bias is not None else x,
        norm_weight if norm_weight is not None else x,
        residual if residual is not None else x,
        out,
        ws,
        tickets,
        rows,
        columns,
        k,
        k_split,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        float(norm_eps),
        *_rope_args(rope, x),
    )
    constexprs = {
        "HAS_BIAS": bias is not None,
        "HAS_NORM": norm_weight is not None,
        "HAS_RESIDUAL": residual is not None,
        "SWIGLU": swiglu,
        "ROPE": rope is not None,
        "PAIRED": swiglu or rope is not None,
        "HALF": rope.head_dim // 2 if rope is not None else 1,
        "SPLIT_K": split_k,
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "NORM_BLOCK": min(next_power_of_2(k), max(128, 4096 // config.block_m)),
        "EVEN_K": k_split % config.block_k == 0 and k % k_split == 0,
        "USE_PDL": use_pdl,
        "PREFETCH": use_pdl and config.prefetch,
        "LINE": 128 // x.element_size(),
        "UPCAST_DOT": interpreting,
        "num_stages": config.num_stages,
    }
    launcher = _DECODE_GEMM_PDL if use_pdl else _DECODE_GEMM
    launcher((grid_n, split_k, grid_m), args, constexprs, config.num_warps, x.get_device())
    return out
