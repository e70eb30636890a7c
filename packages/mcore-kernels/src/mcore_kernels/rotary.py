"""Rotary position embedding of queries or keys in one kernel, forward and backward.

The unfused rotation (Hugging Face's "rotate_half" layout) is two casts of the tables, four
products, a sum, a difference and a concatenation: seven passes over the heads forward and as
many backward. One program here rotates every head of one token: it reads the token's cosine
and sine once (float32), rotates in float32 and rounds once to the input dtype. The backward
is the same kernel rotating by the negative angle (the rotation is orthogonal), so nothing but
the tables is saved.

Numerics: one rounding per element where the unfused bf16 chain rounds after every product,
so results differ from it by at most about one bf16 unit in the last place; in float32 they
agree to rounding.

Eager calls go to the launcher through :class:`_RotaryFunction`; while ``torch.compile`` traces
a call it becomes the custom op ``torch.ops.mcore_kernels.rotary_embedding`` (its backward is
the same op by the negative angle). The torch reference is
:func:`mcore_kernels.reference.rotary_embedding_reference`.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import CachedLauncher, jit, next_power_of_2, on_device_of, tl
from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.reference import rotary_embedding_reference

__all__ = ["rotary_embedding"]


@jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    heads,
    x_token_stride,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SIGN: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    c = tl.load(cos_ptr + token * HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * HALF + d, mask=d_ok, other=0.0).to(tl.float32) * SIGN
    ok = (h[:, None] < heads) & d_ok[None, :]
    inner = h[:, None] * 2 * HALF + d[None, :]
    x1 = tl.load(x_ptr + token * x_token_stride + inner, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + token * x_token_stride + inner + HALF, mask=ok, other=0.0).to(tl.float32)
    base = token * heads * 2 * HALF + inner
    out1 = x1 * c[None, :] - x2 * s[None, :]
    out2 = x2 * c[None, :] + x1 * s[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + base, out1.to(dtype), mask=ok)
    tl.store(out_ptr + base + HALF, out2.to(dtype), mask=ok)


_ROTATE = CachedLauncher(_rotary_kernel)


def _rows_packed(x: torch.Tensor) -> bool:
    # [B, T, H, D] with packed heads and dims, tokens at one stride (x.stride(1)) also across
    # the batch: a slice of a fused QKV projection qualifies without a copy.
    heads, dim = x.shape[-2], x.shape[-1]
    if x.stride(-1) != 1 or (heads > 1 and x.stride(-2) != dim):
        return False
    return x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    if not use_triton(x):
        return rotary_embedding_reference(x, cos, sin if sign > 0 else -sin)
    heads, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    tokens = x.numel() // (heads * dim)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block_d = next_power_of_2(half)
    block_h = max(1, min(next_power_of_2(heads), 4096 // block_d))
    grid = (tokens, -(-heads // block_h))
    constexprs = {"HALF": half, "BLOCK_H": block_h, "BLOCK_D": block_d, "SIGN": sign}
    with on_device_of(x):
        args = (x, cos, sin, out, heads, x.stride(1))
        _ROTATE(grid, args, constexprs, 4, x.get_device())
    return out


class _RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad.contiguous(), cos, sin, -1.0), None, None


# --- torch.compile: the custom op --------------------------------------------------------------


@_compile.custom_op("rotary_embedding", "(Tensor x, Tensor cos, Tensor sin, float sign) -> Tensor")
def _rotary_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    return _rotate(x if _rows_packed(x) else x.contiguous(), cos, sin, sign)


@_rotary_op.register_fake
def _rotary_fake(x, cos, sin, sign):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    _, cos, sin, sign = inputs
    ctx.save_for_backward(cos, sin)
    ctx.sign = sign


def _op_backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return _rotary_op(grad, cos, sin, -ctx.sign), None, None, None


_rotary_op.register_autograd(_op_backward, setup_context=_setup_context)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to queries or keys (the "rotate_half" layout), fused forward and backward.

    Args:
        x: ``[B, T, H, D]`` queries or keys, ``D`` even; tokens may be strided (a slice of a
            fused projection), other layouts are copied to contiguous memory first.
        cos: ``[B, T, D // 2]`` cosines (float32; the tables are not differentiated).
        sin: ``[B, T, D // 2]`` sines.

    Returns:
        The rotated tensor, shaped and typed like ``x`` (computed in float32, rounded once).
        Under ``torch.compile`` the call is the opaque custom op
        ``torch.ops.mcore_kernels.rotary_embedding`` (with a registered backward).

    Raises:
        KernelShapeError: If the shapes do not match or ``D`` is odd.
        KernelDtypeError: If ``x`` is not floating point.
    """
    if x.dim() != 4 or x.shape[-1] % 2:
        raise KernelShapeError(f"x.shape={tuple(x.shape)} must be [B, T, H, D] with D even")
    expected = (*x.shape[:2], x.shape[-1] // 2)
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != expected:
            raise KernelShapeError(f"{name}.shape={tuple(table.shape)} must be {expected}")
    if not x.dtype.is_floating_point:
        raise KernelDtypeError(f"x.dtype={x.dtype} must be a floating-point dtype")
    cos = cos.float().contiguous()
    sin = sin.float().contiguous()
    if _compile.compiling():
        return _rotary_op(x, cos, sin, 1.0)
    result = _RotaryFunction.apply(x if _rows_packed(x) else x.contiguous(), cos, sin)
    assert isinstance(result, torch.Tensor)
    return result
