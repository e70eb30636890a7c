"""The work of a decoder layer after its attention, and the next layer's q/k/v, in one launch.

At decode with one or two tokens a layer is a chain of small kernels (q/k/v projection,
attention, o projection, gate/up projection, down projection), each reading its predecessor's
output: the step time is set by that chain of kernel boundaries rather than by the bytes of
the weights (see ``docs/benchmarks/inference.md``). :func:`decode_layer_tail` runs

    h   = attention_out @ o_weight.T (+ o_bias) + residual
    act = silu(g) * u,  [g | u] = rms_norm(h, post_norm_weight) @ gate_up_weight.T
    out = act @ down_weight.T + h
    q   = rope(rms_norm(out, next.norm_weight) @ next.weight.T (+ next.bias))   (with ``next_qkv``)

as one persistent Triton kernel: its programs all stay resident and meet at a grid barrier
between the projections (see :mod:`mcore_kernels.decode_layer_kernel`), where
:func:`mcore_kernels.decode_gemv.decode_gemv` would end a kernel and start the next. With
``next_qkv`` the next layer's queries are rotated and returned and its keys and values written
to their cache slots (``decode_gemv(..., rope=...)``), so a layer is this launch plus the
attention.

Each projection computes what ``decode_gemv`` computes (float32 products, the same roundings
to the activation dtype at the same points); the sums run in another order than the default
``decode_gemv`` configuration at times, so results agree with it and with the torch reference
to float32 rounding of the sums. Up to 4 rows (``M``). Dispatch: Triton on CUDA, the torch
reference (the ``decode_gemv`` reference chain) on CPU; ``MCORE_KERNELS_BACKEND=torch|triton``
overrides (with ``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors with one program).
"""

from __future__ import annotations

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import triton
from mcore_kernels.decode_layer_config import (
    ATTENTION_SPLIT,
    MAX_ROWS,
    LayerAttention,
    LayerTailConfig,
    NextProjection,
)
from mcore_kernels.decode_layer_launch import _launch
from mcore_kernels.errors import KernelBackendError, KernelShapeError
from mcore_kernels.reference import decode_gemv_reference, paged_attention_reference
from mcore_kernels.rotary_kv_write import rotary_kv_write_reference

__all__ = [
    "ATTENTION_SPLIT",
    "MAX_ROWS",
    "LayerAttention",
    "LayerTailConfig",
    "NextProjection",
    "decode_layer",
    "decode_layer_tail",
]


def _check(
    attention_out: torch.Tensor,
    residual: torch.Tensor,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    post_norm_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    next_qkv: NextProjection | None,
) -> None:
    rows, hidden = residual.shape if residual.dim() == 2 else (-1, -1)
    if rows < 0 or attention_out.dim() != 2 or attention_out.shape[0] != rows:
        raise KernelShapeError(
            f"attention_out {tuple(attention_out.shape)}, residual {tuple(residual.shape)}; "
            "expected [M, A] and [M, hidden]"
        )
    if rows > MAX_ROWS:
        raise KernelShapeError(f"{rows} rows; expected at most {MAX_ROWS}")
    ffn = down_weight.shape[1] if down_weight.dim() == 2 else -1
    expected = {
        "o_weight": (o_weight, (hidden, attention_out.shape[1])),
        "post_norm_weight": (post_norm_weight, (hidden,)),
        "gate_up_weight": (gate_up_weight, (2 * ffn, hidden)),
        "down_weight": (down_weight, (hidden, ffn)),
    }
    if o_bias is not None:
        expected["o_bias"] = (o_bias, (hidden,))
    if next_qkv is not None:
        expected["next_qkv.norm_weight"] = (next_qkv.norm_weight, (hidden,))
        rope = next_qkv.rope
        width = (rope.num_q_heads + 2 * rope.num_kv_heads) * rope.head_dim
        expected["next_qkv.weight"] = (next_qkv.weight, (width, hidden))
        if next_qkv.bias is not None:
            expected["next_qkv.bias"] = (next_qkv.bias, (width,))
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise KernelShapeError(
                f"{name} has shape {tuple(tensor.shape)}; expected {list(shape)}"
            )
    for name, tensor in (("attention_out", attention_out), ("residual", residual)):
        if tensor.dtype != o_weight.dtype:
            raise KernelShapeError(f"{name} is {tensor.dtype}; expected {o_weight.dtype}")


def decode_layer_tail(
    attention_out: torch.Tensor,
    residual: torch.Tensor,
    *,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None = None,
    post_norm_weight: torch.Tensor,
    post_norm_eps: float = 1e-6,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    next_qkv: NextProjection | None = None,
    pdl: bool | None = None,
    config: LayerTailConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o projection + residual, RMSNorm + gate/up + SwiGLU, down + residual, next q/k/v.

    Args:
        attention_out: ``[M, A]`` attention output of the layer (``M <= 4``).
        residual: ``[M, hidden]`` residual stream entering the layer.
        o_weight: ``[hidden, A]`` o projection weight.
        o_bias: Optional ``[hidden]`` o projection bias.
        post_norm_weight: ``[hidden]`` weight of the RMSNorm before the MLP.
        post_norm_eps: Its epsilon.
        gate_up_weight: ``[2 F, hidden]`` gate rows then up rows.
        down_weight: ``[hidden, F]`` down projection weight.
        next_qkv: The next layer's q/k/v projection to fold in, or None (the last layer).
        pdl: Launch with programmatic dependent launch where the device supports it (None:
            inside :func:`mcore_kernels.pdl.programmatic_dependent_launch` only).
        config: Launch configuration (None: :class:`LayerTailConfig`'s defaults).

    Returns:
        ``(out, q)``: the ``[M, hidden]`` residual stream leaving the layer and, with
        ``next_qkv``, the next layer's rotated queries ``[M, Hq * D]`` (its keys and values
        are in the cache), else None.

    Raises:
        KernelShapeError: If the shapes or dtypes do not match the layout above.
        KernelBackendError: If ``MCORE_KERNELS_BACKEND`` names an unknown backend or one that
            cannot run on these tensors, or Triton is missing.
    """
    _check(
        attention_out,
        residual,
        o_weight,
        o_bias,
        post_norm_weight,
        gate_up_weight,
        down_weight,
        next_qkv,
    )
    if not use_triton(attention_out, o_weight):
        return _reference(
            attention_out,
            residual,
            o_weight,
            o_bias,
            post_norm_weight,
            post_norm_eps,
            gate_up_weight,
            down_weight,
            next_qkv,
        )
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    return _launch(
        attention_out.contiguous(),
        None,
        residual.contiguous(),
        o_weight.contiguous(),
        o_bias,
        post_norm_weight,
        float(post_norm_eps),
        gate_up_weight.contiguous(),
        down_weight.contiguous(),
        next_qkv,
        pdl,
        config or LayerTailConfig(),
    )


def _reference(
    attention_out: torch.Tensor,
    residual: torch.Tensor,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    post_norm_weight: torch.Tensor,
    post_norm_eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    next_qkv: NextProjection | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chain of ``decode_gemv`` references (and ``rotary_kv_write``'s)."""
    h = decode_gemv_reference(attention_out, o_weight, o_bias, residual=residual)
    act = decode_gemv_reference(
        h, gate_up_weight, norm_weight=post_norm_weight, norm_eps=post_norm_eps, swiglu=True
    )
    out = decode_gemv_reference(act, down_weight, residual=h)
    if next_qkv is None:
        return out, None
    qkv = decode_gemv_reference(
        out,
        next_qkv.weight,
        next_qkv.bias,
        norm_weight=next_qkv.norm_weight,
        norm_eps=next_qkv.norm_eps,
    )
    rope = next_qkv.rope
    q, k, v = rope.split(qkv)
    rotated = rotary_kv_write_reference(
        q, k, v, rope.cos, rope.sin, rope.k_cache, rope.v_cache, rope.slot_mapping
    )
    return out, rotated.flatten(-2)


def _check_attention(attention: LayerAttention, q: torch.Tensor) -> None:
    keys, values = attention.k_cache, attention.v_cache
    if keys.dim() != 4 or values.shape != keys.shape:
        raise KernelShapeError(
            f"attention.k_cache {tuple(keys.shape)}, v_cache {tuple(values.shape)}; expected "
            "two [num_blocks, block_size, Hkv, D] caches"
        )
    head_dim, kv_heads = keys.shape[3], keys.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1) or keys.stride(3) != 1 or values.stride(3) != 1:
        raise KernelShapeError(
            f"attention caches of head dim {head_dim} (strides {keys.stride()}); expected a "
            "contiguous power of two >= 16"
        )
    if q.shape[1] % (head_dim * kv_heads):
        raise KernelShapeError(
            f"q has {q.shape[1]} columns; expected a multiple of {kv_heads} kv heads x {head_dim}"
        )
    rows = q.shape[0]
    tables, lens = attention.block_tables, attention.context_lens
    if tables.dim() != 2 or tables.shape[0] != rows or tables.dtype != torch.int32:
        raise KernelShapeError(
            f"attention.block_tables {tuple(tables.shape)} {tables.dtype}; expected int32 "
            f"[{rows}, max_blocks]"
        )
    if tuple(lens.shape) != (rows,) or lens.dtype != torch.int32:
        raise KernelShapeError(
            f"attention.context_lens {tuple(lens.shape)} {lens.dtype}; expected int32 [{rows}]"
        )


def decode_layer(
    q: torch.Tensor,
    residual: torch.Tensor,
    *,
    attention: LayerAttention,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None = None,
    post_norm_weight: torch.Tensor,
    post_norm_eps: float = 1e-6,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    next_qkv: NextProjection | None = None,
    pdl: bool | None = None,
    config: LayerTailConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode layer from its rotated queries on: attention, then :func:`decode_layer_tail`.

    The attention (``softmax(q k^T * scale) v`` over each token's cached context, the step's
    keys and values already in the cache) runs as the kernel's first phase: work items of
    :data:`ATTENTION_SPLIT` positions per (token, key/value head) store float32 partials, and
    the o projection's programs merge the rows they need; one launch per layer.

    Args:
        q: ``[M, Hq * D]`` rotated queries of the layer (``M <= 4``).
        residual: ``[M, hidden]`` residual stream entering the layer.
        attention: The layer's cache, block tables, context lengths and scale.
        o_weight: ``[hidden, Hq * D]`` o projection weight.
        o_bias: Optional ``[hidden]`` o projection bias.
        post_norm_weight: ``[hidden]`` weight of the RMSNorm before the MLP.
        post_norm_eps: Its epsilon.
        gate_up_weight: ``[2 F, hidden]`` gate rows then up rows.
        down_weight: ``[hidden, F]`` down projection weight.
        next_qkv: The next layer's q/k/v projection to fold in, or None (the last layer).
        pdl: As for :func:`decode_layer_tail`.
        config: As for :func:`decode_layer_tail`.

    Returns:
        ``(out, next_q)`` as :func:`decode_layer_tail` returns them.

    Raises:
        KernelShapeError: If the shapes or dtypes do not match the layouts above.
        KernelBackendError: As for :func:`decode_layer_tail`.
    """
    _check(q, residual, o_weight, o_bias, post_norm_weight, gate_up_weight, down_weight, next_qkv)
    _check_attention(attention, q)
    if not use_triton(q, o_weight):
        head_dim = attention.k_cache.shape[3]
        attended = paged_attention_reference(
            q.unflatten(-1, (-1, head_dim)),
            attention.k_cache,
            attention.v_cache,
            attention.block_tables,
            attention.context_lens,
            scale=attention.scale,
        )
        return _reference(
            attended.flatten(-2),
            residual,
            o_weight,
            o_bias,
            post_norm_weight,
            post_norm_eps,
            gate_up_weight,
            down_weight,
            next_qkv,
        )
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    return _launch(
        q.contiguous(),
        attention,
        residual.contiguous(),
        o_weight.contiguous(),
        o_bias,
        post_norm_weight,
        float(post_norm_eps),
        gate_up_weight.contiguous(),
        down_weight.contiguous(),
        next_qkv,
        pdl,
        config or LayerTailConfig(),
    )
