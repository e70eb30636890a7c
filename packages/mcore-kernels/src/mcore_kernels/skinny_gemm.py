"""``x @ weight.T`` for a few dozen rows with the weight on the tensor cores' wide side.

A decode step of 64 tokens multiplies a ``[64, K]`` activation by ``nn.Linear`` weights of
``N`` = 900 to 10 000 rows. A GEMM tiled the usual way puts the tokens on the MMA's M side
(64 or 128 rows per tile) and gets few tiles; here the product is computed transposed,
``out.T[N, M] = weight[N, K] @ x.T[K, M]``: each program owns ``BLOCK_N`` weight rows (the MMA's
M side) and every token (its N side), streams its weight slab through a deep pipeline of TMA
copies (``num_stages``) and writes ``out[M, N]`` row-major (the transpose happens in
registers, so the consumer sees the ordinary layout). With ``splits > 1`` the programs of one
output tile split K and store float32 partial products ``[splits, M, N]`` (the layout of
:func:`mcore_kernels.split_sum_rms_norm.split_k_partials`, summed by its norm kernel).

Under programmatic dependent launch (:mod:`mcore_kernels.pdl`) a program may request its weight
slab into L2 (``prefetch=True``) before it waits for the previous kernel: the weights never
depend on it.

Epilogues: a bias and a residual (``residual + x @ weight.T``, one rounding of the float32
sum, as ``torch.addmm`` with ``beta = 1``); for a q/k/v projection, RoPE and the key/value
cache write (``rope=``: each program owns one head of ``D`` weight rows, rounds the projection
(plus bias) to the activation dtype, rotates query and key heads as
:func:`mcore_kernels.rotary_kv_write.rotary_kv_write` does, stores keys and values in their
cache slots and returns the rotated queries): the projection and that kernel in one launch;
for a gate/up projection whose RMSNorm weight is folded into the weight, the normed SwiGLU
(``swiglu_norm_eps=``: each program multiplies its gate rows and the matching up rows and sums
the squares of the input tiles it streams for the row's ``rstd``;
:func:`mcore_kernels.normed_swiglu.normed_swiglu` of the rounded product).

Measured on one H200 (Qwen2.5-0.5B shapes, 64 rows, chains of 24 launches over distinct
weights): the q/k/v and o projections of 14-18 programs beat cuBLAS (4.00 against 4.79 us with
the bias, 3.82 against 5.65 for ``addmm`` with the residual); the gate/up, down and LM head
shapes only match it alone (``mcore_inference.fused_decode.SKINNY_GEMM`` uses q/k/v, o and
gate/up, which gains in the decode step from its early L2 prefetch).

Dispatch: Triton on CUDA tensors, the torch reference on the CPU (``MCORE_KERNELS_BACKEND``
overrides; under ``TRITON_INTERPRET=1`` use float16: the interpreter of Triton 3.9 hands
bfloat16 TMA loads to ``tl.dot`` as raw integers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    on_device_of,
    prefetch_l2,
    tl,
    triton,
)
from mcore_kernels._validation import flat_cache_slots as _flat_slots
from mcore_kernels.errors import (
    KernelBackendError,
    KernelDtypeError,
    KernelShapeError,
    KernelValueError,
)
from mcore_kernels.normed_swiglu import normed_swiglu_reference
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import skinny_gemm_reference
from mcore_kernels.rotary_kv_write import RotaryCacheWrite

__all__ = ["SkinnyGemmConfig", "skinny_gemm", "skinny_gemm_reference"]


@jit
def _rotate_half_contractable(x1, x2, cos, sin, DTYPE: tl.constexpr):
    """``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` rounded to ``DTYPE`` after each op, as
    written; the compiler may contract a product into the sum (one rounding fewer).

    The 1-64-row decode epilogues keep this form (session 16: the explicitly rounded
    ``rotate_half_rounded`` cost the 64-row decode step about 1.5 %), so their rotated keys may
    differ from ``rotary_kv_write``'s by one ulp; each batch size runs one kernel for every
    step, graphs and eager alike.
    """
    a = (x1 * cos).to(DTYPE).to(tl.float32)
    b = (x2 * sin).to(DTYPE).to(tl.float32)
    c = (x2 * cos).to(DTYPE).to(tl.float32)
    d = (x1 * sin).to(DTYPE).to(tl.float32)
    return (a - b).to(DTYPE), (c + d).to(DTYPE)


@jit
def _rope_epilogue(
    acc,
    head,
    m0,
    rows,
    q_ptr,
    bias_ptr,
    stride_q_row,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_cos,
    stride_sin,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
):
    """One head's ``[D, tokens]`` product: round (plus bias) like the projection output, then
    rotate and store the query, or rotate and store the key, or store the value."""
    dtype = q_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    channels = tl.arange(0, HEAD_DIM)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + head * HEAD_DIM + channels).to(tl.float32)[:, None]
    values = acc.to(dtype)
    tokens = m0 + tl.arange(0, BLOCK_M)[None, :]
    token_mask = tokens < rows
    half = tl.arange(0, HALF)[:, None]
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        pair = tl.permute(tl.reshape(values.to(tl.float32), (2, HALF, BLOCK_M)), (1, 2, 0))
        x1, x2 = tl.split(pair)
        cos = tl.load(cos_ptr + tokens * stride_cos + half, mask=token_mask, other=0.0)
        sin = tl.load(sin_ptr + tokens * stride_sin + half, mask=token_mask, other=0.0)
        cos = cos.to(dtype).to(tl.float32)
        sin = sin.to(dtype).to(tl.float32)
        first, second = _rotate_half_contractable(x1, x2, cos, sin, dtype)
        if head < NUM_Q_HEADS:
            q_target = q_ptr + tokens * stride_q_row + head * HEAD_DIM + half
            tl.store(q_target, first, mask=token_mask)
            tl.store(q_target + HALF, second, mask=token_mask)
        else:
            key_slots = tl.load(slot_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
            key_head = head - NUM_Q_HEADS
            k_target = k_cache_ptr + key_slots * stride_kc_slot + key_head * stride_kc_head + half
            cache_dtype = k_cache_ptr.dtype.element_ty
            tl.store(k_target, first.to(cache_dtype), mask=token_mask)
            tl.store(k_target + HALF, second.to(cache_dtype), mask=token_mask)
    else:
        value_slots = tl.load(slot_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
        value_head = head - NUM_Q_HEADS - NUM_KV_HEADS
        v_target = v_cache_ptr + value_slots * stride_vc_slot + value_head * stride_vc_head
        value_dtype = v_cache_ptr.dtype.element_ty
        tl.store(v_target + channels[:, None], values.to(value_dtype), mask=token_mask)


@jit
def skinny_gemm_kernel(
    w_desc,
    x_desc,
    w_ptr,
    out_ptr,
    bias_ptr,
    residual_ptr,
    rows,
    outputs,
    inputs,
    stride_out_split,
    stride_out_row,
    stride_residual_row,
    k_per_split,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_cos,
    stride_sin,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    norm_eps,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PARTIALS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    ROPE: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    SWIGLU: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    tile_n = tl.program_id(0)
    split = tl.program_id(1)
    tile_m = tl.program_id(2)
    n0 = tile_n * BLOCK_N
    m0 = tile_m * BLOCK_M
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, inputs)
    if USE_PDL:
        gdc_launch_dependents()
        if PREFETCH_LINES > 0:
            # The weights do not depend on the previous kernel: request this program's slab
            # (one address per 128-byte line; clamped to the slab) while it drains.
            lines = tl.arange(0, PREFETCH_LINES)
            line_rows = n0 + lines // (PREFETCH_LINES // BLOCK_N)
            line_cols = k_begin + (lines % (PREFETCH_LINES // BLOCK_N)) * 64
            line_cols = tl.minimum(line_cols, k_end - 1)
            line_rows = tl.minimum(line_rows, outputs - 1)
            prefetch_l2(w_ptr + line_rows.to(tl.int64) * inputs + line_cols)
        gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([n0, k])
        x = x_desc.load([m0, k])
        acc = tl.dot(w, tl.trans(x), acc)
        if SWIGLU:
            # The up rows of the same features, and the rows' sum of squares for the norm.
            w_up = w_desc.load([outputs + n0, k])
            acc_up = tl.dot(w_up, tl.trans(x), acc_up)
            h = x.to(tl.float32)
            squares += tl.sum(h * h, axis=1)
    result = tl.trans(acc)
    offs_m = m0 + tl.arange(0, BLOCK_M)[:, None]
    offs_n = n0 + tl.arange(0, BLOCK_N)[None, :]
    mask = (offs_m < rows) & (offs_n < outputs)
    if ROPE:
        _rope_epilogue(
            acc,
            tile_n,
            m0,
            rows,
            out_ptr,
            bias_ptr,
            stride_out_row,
            cos_ptr,
            sin_ptr,
            k_cache_ptr,
            v_cache_ptr,
            slot_ptr,
            stride_cos,
            stride_sin,
            stride_kc_slot,
            stride_kc_head,
            stride_vc_slot,
            stride_vc_head,
            BLOCK_N,
            BLOCK_M,
            HAS_BIAS,
            NUM_Q_HEADS,
            NUM_KV_HEADS,
        )
    elif SWIGLU:
        # normed_swiglu of the rounded products: silu(r * gate) * (r * up), r the row's rstd.
        rstd = 1.0 / tl.sqrt(squares / inputs + norm_eps)
        dtype = out_ptr.dtype.element_ty
        gate = result.to(dtype).to(tl.float32) * rstd[:, None]
        up = tl.trans(acc_up).to(dtype).to(tl.float32) * rstd[:, None]
        activation = gate / (1.0 + tl.exp(-gate)) * up
        target = out_ptr + offs_m * stride_out_row + offs_n
        tl.store(target, activation.to(dtype), mask=mask)
    elif PARTIALS:
        target = out_ptr + split * stride_out_split + offs_m * stride_out_row + offs_n
        tl.store(target, result, mask=mask)
    else:
        if HAS_BIAS:
            result += tl.load(bias_ptr + offs_n, mask=offs_n < outputs, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            residual = tl.load(
                residual_ptr + offs_m * stride_residual_row + offs_n, mask=mask, other=0.0
            )
            result += residual.to(tl.float32)
        target = out_ptr + offs_m * stride_out_row + offs_n
        tl.store(target, result.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, slots=True)
class SkinnyGemmConfig:
    """Tile shape of :func:`skinny_gemm`.

    Attributes:
        block_n: Weight rows per program (the MMA's M side: 64 or 128 for wgmma).
        block_k: Input columns per pipeline stage.
        num_stages: TMA copies in flight per program.
        num_warps: Warps per program.
        prefetch: Under PDL, request the program's weight slab into L2 before waiting.
    """

    block_n: int = 64
    block_k: int = 128
    num_stages: int = 6
    num_warps: int = 4
    prefetch: bool = False


_DTYPES = (torch.bfloat16, torch.float16)


def _split_bounds(inputs: int, splits: int, block_k: int) -> list[tuple[int, int]]:
    """K slices of a split product: whole ``block_k`` blocks, the same count per slice but
    the last."""
    blocks = -(-inputs // block_k)
    per_split = -(-blocks // splits) * block_k
    return [(s * per_split, min((s + 1) * per_split, inputs)) for s in range(splits)]


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    splits: int,
    *,
    triton_path: bool = True,
) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)}, weight.shape={tuple(weight.shape)}: expected [M, K] "
            "and [N, K]"
        )
    if (triton_path and x.dtype not in _DTYPES) or weight.dtype != x.dtype:
        raise KernelDtypeError(
            f"x.dtype={x.dtype}, weight.dtype={weight.dtype}: expected one of {_DTYPES}, equal"
        )
    if x.shape[1] % 8:
        raise KernelShapeError(f"x.shape={tuple(x.shape)}: K must be a multiple of 8 (TMA)")
    if splits < 1:
        raise KernelValueError(f"splits={splits}; expected at least 1")
    if splits > 1 and (bias is not None or residual is not None):
        raise KernelValueError("splits > 1 writes float32 partials: no bias or residual")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise KernelShapeError(f"bias.shape={tuple(bias.shape)}; expected ({weight.shape[0]},)")
    if residual is not None and residual.shape != (x.shape[0], weight.shape[0]):
        raise KernelShapeError(
            f"residual.shape={tuple(residual.shape)}; expected ({x.shape[0]}, {weight.shape[0]})"
        )


def _check_rope(
    rope: RotaryCacheWrite,
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    splits: int,
) -> None:
    heads = rope.num_q_heads + 2 * rope.num_kv_heads
    if residual is not None or splits != 1:
        raise KernelValueError("rope= takes no residual and one split")
    if weight.shape[0] != heads * rope.head_dim or rope.head_dim % 32:
        raise KernelShapeError(
            f"weight.shape={tuple(weight.shape)}: expected {heads} heads of "
            f"rope.head_dim={rope.head_dim} rows (a multiple of 32)"
        )
    rope.check(torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device="meta"))
    if rope.cos.stride(-1) != 1 or rope.sin.stride(-1) != 1:
        raise KernelShapeError("rope.cos and rope.sin must have a contiguous last dimension")


def _check_swiglu(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    splits: int,
    rope: RotaryCacheWrite | None,
) -> None:
    if bias is not None or residual is not None or rope is not None or splits != 1:
        raise KernelValueError("swiglu_norm_eps takes no bias, residual or rope and one split")
    if weight.shape[0] % 2:
        raise KernelShapeError(
            f"weight.shape={tuple(weight.shape)}: expected [2 * ffn, K] (gate then up rows)"
        )


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    splits: int = 1,
    rope: RotaryCacheWrite | None = None,
    swiglu_norm_eps: float | None = None,
    config: SkinnyGemmConfig | None = None,
) -> torch.Tensor:
    """``residual + x @ weight.T + bias`` with the weight rows on the MMA's M side.

    Args:
        x: ``[M, K]`` bf16 or fp16 activations (K a multiple of 8).
        weight: ``[N, K]`` weight of the same dtype (an ``nn.Linear`` weight).
        bias: Optional ``[N]`` bias.
        residual: Optional ``[M, N]`` added to the float32 product before its one rounding.
        splits: 1: the rounded ``[M, N]`` product; more: float32 partial products
            ``[splits, M, N]`` over K slices of whole ``config.block_k`` blocks (no bias or
            residual; sum them in slice order).
        rope: For a q/k/v projection (``N = (Hq + 2 Hkv) * D`` rows: query, key, value
            heads): rotate the query and key heads of the rounded product (plus bias) and
            store keys and values in their cache slots (one head per program: ``block_n``
            becomes ``D``); no residual, one split.
        swiglu_norm_eps: For a gate/up projection whose RMSNorm weight is folded into
            ``weight`` (``[2F, K]``, gate rows first): return
            :func:`mcore_kernels.normed_swiglu.normed_swiglu` of the rounded product with this
            epsilon, ``[M, F]`` (each program multiplies ``block_n`` gate and the same up rows
            and sums the squares of its input rows for the norm's ``rstd``); no bias, residual
            or rope, one split.
        config: Tile shape (None: :class:`SkinnyGemmConfig` defaults).

    Returns:
        ``[M, N]`` in the dtype of ``x``, float32 ``[splits, M, N]``, with ``rope`` the
        rotated queries ``[M, Hq * D]``, with ``swiglu_norm_eps`` the activation ``[M, N / 2]``.

    Raises:
        KernelShapeError: If the shapes do not match.
        KernelDtypeError: If a dtype is unsupported or the dtypes differ.
        KernelValueError: If ``splits`` is below 1, or above 1 with a bias or residual.
        KernelBackendError: If Triton is not installed.

    Dispatch: Triton on CUDA, :func:`skinny_gemm_reference` on CPU (``MCORE_KERNELS_BACKEND``
    overrides, as for the other kernels; the Triton path takes 16-bit dtypes only).
    """
    swiglu = swiglu_norm_eps is not None
    eps = 0.0 if swiglu_norm_eps is None else float(swiglu_norm_eps)
    if not use_triton(x, weight):
        _check(x, weight, bias, residual, splits, triton_path=False)
        if rope is not None:
            _check_rope(rope, x, weight, residual, splits)
        if swiglu:
            _check_swiglu(weight, bias, residual, splits, rope)
            return normed_swiglu_reference(skinny_gemm_reference(x, weight), x, eps)
        block_k = min((config or SkinnyGemmConfig()).block_k, max(16, next_power_of_2(x.shape[1])))
        return skinny_gemm_reference(
            x, weight, bias=bias, residual=residual, splits=splits, rope=rope, block_k=block_k
        )
    if triton is None:
        raise KernelBackendError("skinny_gemm needs triton")
    from triton.tools.tensor_descriptor import TensorDescriptor

    _check(x, weight, bias, residual, splits)
    config = config or SkinnyGemmConfig()
    rows, inputs = x.shape
    outputs = weight.shape[0]
    block_n = config.block_n
    if swiglu:
        _check_swiglu(weight, bias, residual, splits, rope)
        outputs //= 2
        out = torch.empty((rows, outputs), dtype=x.dtype, device=x.device)
    elif rope is not None:
        _check_rope(rope, x, weight, residual, splits)
        block_n = rope.head_dim
        out = torch.empty((rows, rope.num_q_heads * rope.head_dim), dtype=x.dtype, device=x.device)
    elif splits > 1:
        out = torch.empty((splits, rows, outputs), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((rows, outputs), dtype=x.dtype, device=x.device)
    if rows == 0 or outputs == 0:
        return out
    x = x if x.stride(-1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0 else x.contiguous()
    weight = weight.contiguous()
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    block_m = max(16, min(128, next_power_of_2(rows)))
    # Narrow inputs: no tile wider than the inputs (16 columns at least, TMA's minimum).
    block_k = min(config.block_k, max(16, next_power_of_2(inputs)))
    bounds = _split_bounds(inputs, splits, block_k)
    k_per_split = bounds[0][1] - bounds[0][0]
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    use_pdl = pdl_enabled(x.device)
    lines = 0
    if use_pdl and config.prefetch:
        lines = block_n * next_power_of_2(-(-k_per_split // 64))
    grid = (triton.cdiv(outputs, block_n), splits, triton.cdiv(rows, block_m))
    if rope is not None:
        keys = _flat_slots(rope.k_cache, "rope.k_cache")
        values = _flat_slots(rope.v_cache, "rope.v_cache")
        cos, sin, slots = rope.cos, rope.sin, rope.slot_mapping
        cache_strides = (keys.stride(0), keys.stride(1), values.stride(0), values.stride(1))
        heads = (rope.num_q_heads, rope.num_kv_heads)
    else:
        keys = values = cos = sin = slots = out
        cache_strides, heads = (0, 0, 0, 0), (0, 0)
    with on_device_of(x):
        skinny_gemm_kernel[grid](
            w_desc,
            x_desc,
            weight,
            out,
            bias if bias is not None else out,
            residual if residual is not None else out,
            rows,
            outputs,
            inputs,
            out.stride(0) if splits > 1 else 0,
            out.stride(-2),
            residual.stride(0) if residual is not None else 0,
            k_per_split,
            cos,
            sin,
            keys,
            values,
            slots,
            cos.stride(0),
            sin.stride(0),
            *cache_strides,
            eps,
            BLOCK_N=block_n,
            BLOCK_M=block_m,
            BLOCK_K=block_k,
            NUM_STAGES=config.num_stages,
            PARTIALS=splits > 1,
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None,
            PREFETCH_LINES=lines,
            ROPE=rope is not None,
            NUM_Q_HEADS=heads[0],
            NUM_KV_HEADS=heads[1],
            SWIGLU=swiglu,
            USE_PDL=use_pdl,
            num_warps=config.num_warps,
            **({"launch_pdl": True} if use_pdl else {}),
        )
    return out
