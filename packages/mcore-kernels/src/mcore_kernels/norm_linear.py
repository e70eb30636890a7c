"""RMSNorm, a linear layer and its epilogue in one tensor-core GEMM launch (decode at batch > 2).

At decode a decoder layer's q/k/v and gate/up projections are small GEMMs (tens to hundreds of
rows) surrounded by kernels that each move little data: the RMSNorm before the projection,
the RoPE and key/value cache write after q/k/v, the SwiGLU after gate/up. Each costs a launch
of a few microseconds on the step's critical path. :func:`norm_linear` computes

``y = epilogue(rms_norm(x) @ weight.T + bias)``

in one launch of a Triton GEMM whose programs each own ``BM`` rows and a tile of output
columns:

- the prologue reads its rows once to take their mean square, then normalises every tile of
  ``x`` as it is loaded (``bf16(h * rstd * norm_weight)`` in float32, the rounding of the
  unfused RMSNorm) before the tensor-core product;
- epilogue ``swiglu``: ``weight`` holds the gate rows then the up rows (``[2F, K]``); a program
  accumulates a tile of gate columns and the same tile of up columns and writes
  ``silu(gate) * up`` (``[M, F]``), with the gate and up values rounded to the activation dtype
  first, as the unfused GEMM output would be;
- epilogue ``rope`` (a :class:`~mcore_kernels.rotary_kv_write.RotaryCacheWrite`): ``weight``
  holds ``Hq`` query, ``Hkv`` key and ``Hkv`` value heads; a program owns one head and
  accumulates its two halves separately, so the "rotate half" RoPE is elementwise: queries are
  rotated and returned (``[M, Hq * D]``), keys rotated and stored in their cache slots, values
  stored as they are, with the roundings of :func:`~mcore_kernels.rotary_kv_write.rotary_kv_write`.

Values agree with the unfused ops (:func:`norm_linear_reference`) up to the order of the
float32 sums. Dispatch: Triton on CUDA, the torch reference on CPU;
``MCORE_KERNELS_BACKEND=torch|triton`` overrides (with ``TRITON_INTERPRET=1`` the Triton path
runs on CPU tensors, its products then in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mcore_kernels._backend import _interpreting, use_triton
from mcore_kernels._triton_utils import jit, next_power_of_2, tl, triton
from mcore_kernels.errors import KernelBackendError, KernelDtypeError, KernelShapeError
from mcore_kernels.reference import rms_norm_reference
from mcore_kernels.rotary_kv_write import RotaryCacheWrite, rotary_kv_write_reference

__all__ = [
    "NormLinearConfig",
    "norm_linear",
    "norm_linear_config",
    "norm_linear_reference",
    "norm_linear_triton",
]

_PLAIN, _SWIGLU, _ROPE = 0, 1, 2


@dataclass(kw_only=True, slots=True, frozen=True)
class NormLinearConfig:
    """Tile shape and launch options of the :func:`norm_linear_triton` GEMM.

    Raises:
        KernelShapeError: If a field is not a power of two in its range.
    """

    block_m: int = 64
    """Rows per program (16 or more: the tensor-core tile)."""
    block_n: int = 64
    """Output columns per program, as two halves of ``block_n // 2`` (with ``rope``, the head
    dimension)."""
    block_k: int = 64
    """Reduction depth per loop iteration."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Software-pipelining stages of the reduction loop."""

    def __post_init__(self) -> None:
        for name, low in (("block_m", 16), ("block_n", 32), ("block_k", 16), ("num_warps", 1)):
            value = getattr(self, name)
            if value < low or value & (value - 1):
                raise KernelShapeError(f"{name}={value}; expected a power of two >= {low}")
        if self.num_stages < 1:
            raise KernelShapeError(f"num_stages={self.num_stages}; expected at least 1")


def norm_linear_config(rows: int, columns: int, depth: int) -> NormLinearConfig:
    """Default tiles for ``rows`` x ``depth`` activations and ``columns`` weight rows.

    Args:
        rows: Rows ``M`` of the activations.
        columns: Rows ``N`` of the weight (before the SwiGLU halves them).
        depth: The reduction size ``K``.

    Returns:
        The configuration: 64-row tiles up to 256 rows, then 128 rows with 8 warps.
    """
    del columns, depth
    if rows <= 256:
        return NormLinearConfig()
    return NormLinearConfig(block_m=128, num_warps=8)


@jit
def _norm_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    M,
    N,
    K,
    eps,
    stride_xm,
    stride_wn,
    stride_om,
    stride_cos,
    stride_sin,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    up_offset,
    num_q_heads,
    num_kv_heads,
    BM: tl.constexpr,
    HALF: tl.constexpr,
    BK: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MODE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    lanes_k = tl.arange(0, BK)
    half = tl.arange(0, HALF)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    if NORM:
        squares = tl.zeros([BM], tl.float32)
        for k in range(0, K, BK):
            depth = k + lanes_k
            h = tl.load(
                x_rows + depth[None, :], mask=row_ok[:, None] & (depth < K)[None, :], other=0.0
            ).to(tl.float32)
            squares += tl.sum(h * h, axis=1)
        rstd = tl.rsqrt(squares / K + eps)
    # The two halves of the program's columns: weight rows cols_a and cols_b.
    if MODE == 1:
        cols_a = pid_n * HALF + half
        cols_b = up_offset + cols_a
        ok_a = cols_a < up_offset
        ok_b = ok_a
    else:
        cols_a = pid_n * (2 * HALF) + half
        cols_b = cols_a + HALF
        ok_a = cols_a < N
        ok_b = cols_b < N
    acc_a = tl.zeros([BM, HALF], tl.float32)
    acc_b = tl.zeros([BM, HALF], tl.float32)
    w_a = w_ptr + cols_a.to(tl.int64)[None, :] * stride_wn
    w_b = w_ptr + cols_b.to(tl.int64)[None, :] * stride_wn
    for k in range(0, K, BK):
        depth = k + lanes_k
        depth_ok = depth < K
        a = tl.load(x_rows + depth[None, :], mask=row_ok[:, None] & depth_ok[None, :], other=0.0)
        if NORM:
            g = tl.load(norm_ptr + depth, mask=depth_ok, other=0.0).to(tl.float32)
            a = (a.to(tl.float32) * rstd[:, None] * g[None, :]).to(x_ptr.dtype.element_ty)
        wa = tl.load(w_a + depth[:, None], mask=depth_ok[:, None] & ok_a[None, :], other=0.0)
        wb = tl.load(w_b + depth[:, None], mask=depth_ok[:, None] & ok_b[None, :], other=0.0)
        if DOT_F32:
            a32 = a.to(tl.float32)
            acc_a += tl.dot(a32, wa.to(tl.float32), input_precision="ieee")
            acc_b += tl.dot(a32, wb.to(tl.float32), input_precision="ieee")
        else:
            acc_a = tl.dot(a, wa, acc_a)
            acc_b = tl.dot(a, wb, acc_b)
    if HAS_BIAS:
        acc_a += tl.load(bias_ptr + cols_a, mask=ok_a, other=0.0).to(tl.float32)[None, :]
        acc_b += tl.load(bias_ptr + cols_b, mask=ok_b, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    # The unfused GEMM rounds its output to the activation dtype: so do the epilogues.
    acc_a = acc_a.to(dtype).to(tl.float32)
    acc_b = acc_b.to(dtype).to(tl.float32)
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_om
    if MODE == 0:
        tl.store(out_rows + cols_a[None, :], acc_a.to(dtype), mask=row_ok[:, None] & ok_a[None, :])
        tl.store(out_rows + cols_b[None, :], acc_b.to(dtype), mask=row_ok[:, None] & ok_b[None, :])
    elif MODE == 1:
        silu = acc_a / (1.0 + tl.exp(-acc_a))
        tl.store(
            out_rows + cols_a[None, :],
            (silu * acc_b).to(dtype),
            mask=row_ok[:, None] & ok_a[None, :],
        )
    else:
        head = pid_n
        if head < num_q_heads + num_kv_heads:
            # "Rotate half" RoPE, each product and the sum rounded to the activation dtype.
            c = tl.load(cos_ptr + rows[:, None] * stride_cos + half[None, :], mask=row_ok[:, None])
            s = tl.load(sin_ptr + rows[:, None] * stride_sin + half[None, :], mask=row_ok[:, None])
            c = c.to(dtype).to(tl.float32)
            s = s.to(dtype).to(tl.float32)
            first = (acc_a * c).to(dtype).to(tl.float32) - (acc_b * s).to(dtype).to(tl.float32)
            second = (acc_b * c).to(dtype).to(tl.float32) + (acc_a * s).to(dtype).to(tl.float32)
            if head < num_q_heads:
                tl.store(out_rows + cols_a[None, :], first.to(dtype), mask=row_ok[:, None])
                tl.store(out_rows + cols_b[None, :], second.to(dtype), mask=row_ok[:, None])
            else:
                slots = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)
                target = (
                    k_cache_ptr
                    + slots[:, None] * stride_kc_slot
                    + (head - num_q_heads) * stride_kc_head
                    + half[None, :]
                )
                k_dtype = k_cache_ptr.dtype.element_ty
                tl.store(target, first.to(dtype).to(k_dtype), mask=row_ok[:, None])
                tl.store(target + HALF, second.to(dtype).to(k_dtype), mask=row_ok[:, None])
        else:
            slots = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            target = (
                v_cache_ptr
                + slots[:, None] * stride_vc_slot
                + (head - num_q_heads - num_kv_heads) * stride_vc_head
                + half[None, :]
            )
            v_dtype = v_cache_ptr.dtype.element_ty
            tl.store(target, acc_a.to(v_dtype), mask=row_ok[:, None])
            tl.store(target + HALF, acc_b.to(v_dtype), mask=row_ok[:, None])


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    swiglu: bool,
    rope: RotaryCacheWrite | None,
) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise KernelShapeError(
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)}; expected [M, K] and [N, K]"
        )
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        raise KernelDtypeError(
            f"x is {x.dtype} and weight {weight.dtype}; expected one float dtype for both"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise KernelShapeError(f"bias {tuple(bias.shape)}; expected ({weight.shape[0]},)")
    if norm_weight is not None and tuple(norm_weight.shape) != (x.shape[1],):
        raise KernelShapeError(f"norm_weight {tuple(norm_weight.shape)}; expected ({x.shape[1]},)")
    if swiglu and (rope is not None or bias is not None or weight.shape[0] % 2):
        raise KernelShapeError(
            f"swiglu=True with weight rows {weight.shape[0]}, bias and rope; expected an even "
            "row count (gate rows, then up rows), no bias and no rope"
        )
    if rope is not None:
        heads = rope.num_q_heads + 2 * rope.k_cache.shape[2]
        head_dim = rope.k_cache.shape[3]
        if weight.shape[0] != heads * head_dim:
            raise KernelShapeError(
                f"weight has {weight.shape[0]} rows; expected (Hq + 2 Hkv) x D = {heads} x "
                f"{head_dim} for the rope epilogue"
            )
        if tuple(rope.cos.shape) != (x.shape[0], head_dim // 2):
            raise KernelShapeError(
                f"rope.cos {tuple(rope.cos.shape)}; expected ({x.shape[0]}, {head_dim // 2})"
            )


def norm_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
    rope: RotaryCacheWrite | None = None,
) -> torch.Tensor:
    """Torch reference of :func:`norm_linear`: the unfused ops it replaces.

    Args:
        x: ``[M, K]`` activations (the residual stream when ``norm_weight`` is given).
        weight: ``[N, K]`` weight.
        bias: ``[N]`` bias or None.
        norm_weight: ``[K]`` RMSNorm weight applied to ``x`` first, or None for no norm.
        norm_eps: RMSNorm epsilon.
        swiglu: ``weight`` holds gate then up rows; return ``silu(gate) * up``.
        rope: Rotate the query and key heads and store keys and values in the cache.

    Returns:
        ``[M, N]``, ``[M, N // 2]`` with ``swiglu``, ``[M, Hq * D]`` rotated queries with ``rope``.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are unsupported.
    """
    _check(x, weight, bias, norm_weight, swiglu, rope)
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, norm_eps)  # type: ignore[assignment]
    y = F.linear(x, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        return (F.silu(gate.float()) * up.float()).to(y.dtype)
    if rope is None:
        return y
    head_dim = rope.k_cache.shape[3]
    kv = rope.k_cache.shape[2] * head_dim
    q, k, v = (
        part.unflatten(-1, (-1, head_dim))
        for part in y.split((rope.num_q_heads * head_dim, kv, kv), dim=-1)
    )
    rotated = rotary_kv_write_reference(
        q, k, v, rope.cos, rope.sin, rope.k_cache, rope.v_cache, rope.slot_mapping
    )
    return rotated.flatten(-2)


def norm_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
    rope: RotaryCacheWrite | None = None,
    config: NormLinearConfig | None = None,
) -> torch.Tensor:
    """Triton path of :func:`norm_linear` (fixed launch shapes: graph-safe).

    Args:
        x: ``[M, K]`` activations, last dimension contiguous.
        weight: ``[N, K]`` weight, last dimension contiguous.
        bias: ``[N]`` bias or None.
        norm_weight: ``[K]`` RMSNorm weight, or None for no norm.
        norm_eps: RMSNorm epsilon.
        swiglu: See :func:`norm_linear`.
        rope: See :func:`norm_linear`; the head dimension must be a power of two >= 32.
        config: Tiles (None: :func:`norm_linear_config`).

    Returns:
        As :func:`norm_linear`.

    Raises:
        KernelShapeError: If the shapes do not fit or the config does not fit the rope heads.
        KernelDtypeError: If the dtypes are unsupported.
        KernelBackendError: If Triton is not installed.
    """
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    _check(x, weight, bias, norm_weight, swiglu, rope)
    rows, depth = x.shape
    columns = weight.shape[0]
    if config is None:
        config = norm_linear_config(rows, columns, depth)
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise KernelShapeError("x and weight must have a contiguous last dimension")
    mode = _SWIGLU if swiglu else _ROPE if rope is not None else _PLAIN
    half = config.block_n // 2
    out_columns = columns // 2 if swiglu else columns
    cos = sin = slots = k_cache = v_cache = x
    cache_strides = (0, 0, 0, 0)
    num_q_heads = num_kv_heads = 0
    if rope is not None:
        head_dim = rope.k_cache.shape[3]
        if head_dim < 32 or head_dim & (head_dim - 1):
            raise KernelShapeError(f"head dim {head_dim}; expected a power of two >= 32 for rope")
        half = head_dim // 2
        num_q_heads, num_kv_heads = rope.num_q_heads, rope.k_cache.shape[2]
        out_columns = num_q_heads * head_dim
        k_cache = rope.k_cache.view(-1, *rope.k_cache.shape[2:])
        v_cache = rope.v_cache.view(-1, *rope.v_cache.shape[2:])
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise KernelShapeError("the caches must have a contiguous last dimension")
        cos, sin, slots = rope.cos, rope.sin, rope.slot_mapping.contiguous()
        cache_strides = (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    out = torch.empty((rows, out_columns), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    tiles = -(-(columns // 2 if swiglu else columns) // (half if swiglu else 2 * half))
    grid = (tiles, -(-rows // config.block_m))
    _norm_linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,
        norm_weight if norm_weight is not None else x,
        out,
        cos,
        sin,
        k_cache,
        v_cache,
        slots,
        rows,
        columns,
        depth,
        float(norm_eps),
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        cos.stride(0),
        sin.stride(0),
        *cache_strides,
        columns // 2,
        num_q_heads,
        num_kv_heads,
        BM=config.block_m,
        HALF=half,
        BK=min(config.block_k, max(16, next_power_of_2(depth))),
        NORM=norm_weight is not None,
        HAS_BIAS=bias is not None,
        MODE=mode,
        DOT_F32=x.dtype == torch.float32 or _interpreting(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def norm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
    rope: RotaryCacheWrite | None = None,
) -> torch.Tensor:
    """``epilogue(rms_norm(x) @ weight.T + bias)`` in one launch, dispatched to Triton or torch.

    Args:
        x: ``[M, K]`` activations (the residual stream when ``norm_weight`` is given).
        weight: ``[N, K]`` weight.
        bias: ``[N]`` bias or None.
        norm_weight: ``[K]`` RMSNorm weight applied to ``x`` first, or None for no norm.
        norm_eps: RMSNorm epsilon.
        swiglu: ``weight`` holds the gate rows then the up rows; return ``silu(gate) * up``
            (``[M, N // 2]``; no bias, no rope).
        rope: Treat the output as ``Hq`` query, ``Hkv`` key and ``Hkv`` value heads: rotate
            queries and keys (RoPE), store keys and values in their cache slots and return the
            rotated queries ``[M, Hq * D]``.

    Returns:
        The epilogue's output (see above), in the dtype of ``x``.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are unsupported.
        KernelBackendError: If ``MCORE_KERNELS_BACKEND`` names an unknown backend or one that
            cannot run on these tensors.
    """
    if use_triton(x, weight):
        return norm_linear_triton(
            x, weight, bias, norm_weight=norm_weight, norm_eps=norm_eps, swiglu=swiglu, rope=rope
        )
    return norm_linear_reference(
        x, weight, bias, norm_weight=norm_weight, norm_eps=norm_eps, swiglu=swiglu, rope=rope
    )
