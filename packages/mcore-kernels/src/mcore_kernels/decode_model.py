"""Every decoder layer of a decode step (one to four tokens) in one persistent launch.

:func:`decode_model` takes the first layer's rotated queries (its keys and values already in
the cache) and the residual stream, and runs, layer after layer, what
:func:`mcore_kernels.decode_layer.decode_layer` runs for one layer: the paged attention, the
o projection + residual, RMSNorm + gate/up + SwiGLU, down + residual and the next layer's
q/k/v projection with RoPE and the cache write. The programs meet at a grid barrier where a
kernel would end; there is no kernel boundary between layers (see
:mod:`mcore_kernels.decode_model_kernel`). Same values as the chain of ``decode_layer`` launches.

Dispatch: Triton on CUDA, the torch references on CPU; ``MCORE_KERNELS_BACKEND=torch|triton``
overrides (with ``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors with one program).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import next_power_of_2, pdl_supported, triton
from mcore_kernels.decode_layer import _reference
from mcore_kernels.decode_layer_config import (
    ATTENTION_SPLIT,
    MAX_ROWS,
    MERGE_CHUNK,
    PREFETCH_CHUNK_BYTES,
    LayerAttention,
    LayerTailConfig,
    NextProjection,
)
from mcore_kernels.decode_layer_launch import _counter, _prefetchable, _resident_programs
from mcore_kernels.decode_model_kernel import _MODEL, _MODEL_PDL, _decode_model_kernel
from mcore_kernels.errors import KernelBackendError, KernelShapeError, KernelValueError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import paged_attention_reference
from mcore_kernels.rotary_kv_write import RotaryCacheWrite

__all__ = ["DecoderLayerWeights", "decode_model"]


@dataclass(kw_only=True, slots=True, frozen=True)
class DecoderLayerWeights:
    """One decoder layer's weights as :func:`decode_model` reads them (all contiguous)."""

    qkv_weight: torch.Tensor
    """``[(Hq + 2 Hkv) * D, hidden]`` q, k then v projection weights."""
    qkv_bias: torch.Tensor | None
    """``[(Hq + 2 Hkv) * D]`` biases, or None (the same for every layer)."""
    input_norm_weight: torch.Tensor
    """``[hidden]`` weight of the RMSNorm before the attention."""
    o_weight: torch.Tensor
    """``[hidden, Hq * D]`` o projection weight."""
    o_bias: torch.Tensor | None
    """``[hidden]`` o projection bias, or None (the same for every layer)."""
    post_norm_weight: torch.Tensor
    """``[hidden]`` weight of the RMSNorm before the MLP."""
    gate_up_weight: torch.Tensor
    """``[2 F, hidden]`` gate rows then up rows."""
    down_weight: torch.Tensor
    """``[hidden, F]`` down projection weight."""


_TABLES: dict[tuple, torch.Tensor] = {}
"""Device tables of the layers' weight addresses, by those addresses (built once, outside
graph capture: a capture reuses the table of an earlier eager call)."""


def _weight_table(layers: Sequence[DecoderLayerWeights], dummy: torch.Tensor) -> torch.Tensor:
    rows = []
    for index, layer in enumerate(layers):
        following = layers[index + 1] if index + 1 < len(layers) else None
        rows.append(
            (
                layer.o_weight.data_ptr(),
                (layer.o_bias if layer.o_bias is not None else dummy).data_ptr(),
                layer.post_norm_weight.data_ptr(),
                layer.gate_up_weight.data_ptr(),
                layer.down_weight.data_ptr(),
                following.qkv_weight.data_ptr() if following else dummy.data_ptr(),
                following.qkv_bias.data_ptr()
                if following and following.qkv_bias is not None
                else dummy.data_ptr(),
                following.input_norm_weight.data_ptr() if following else dummy.data_ptr(),
            )
        )
    key = (dummy.device, *rows)
    table = _TABLES.get(key)
    if table is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise KernelValueError(
                "decode_model's weight table is built on the first call; call it once outside "
                "CUDA graph capture with the same weights"
            )
        table = torch.tensor(rows, dtype=torch.int64, device=dummy.device)
        _TABLES[key] = table
    return table


def _check(
    q: torch.Tensor,
    residual: torch.Tensor,
    layers: Sequence[DecoderLayerWeights],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    if not layers:
        raise KernelValueError("decode_model got no layers; expected at least one")
    if k_cache.dim() != 5 or v_cache.shape != k_cache.shape or k_cache.shape[0] != len(layers):
        raise KernelShapeError(
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}; expected two "
            f"[{len(layers)}, num_blocks, block_size, Hkv, D] caches"
        )
    first = layers[0]
    for index, layer in enumerate(layers):
        for name in DecoderLayerWeights.__slots__:
            tensor, reference = getattr(layer, name), getattr(first, name)
            if (tensor is None) != (reference is None) or (
                tensor is not None
                and (tensor.shape != reference.shape or not tensor.is_contiguous())
            ):
                raise KernelShapeError(
                    f"layers[{index}].{name} differs from layers[0].{name} in presence or shape, "
                    "or is not contiguous; expected every layer alike and contiguous"
                )
    if q.dim() != 2 or residual.dim() != 2 or q.shape[0] != residual.shape[0]:
        raise KernelShapeError(
            f"q {tuple(q.shape)}, residual {tuple(residual.shape)}; expected [M, Hq * D] and "
            "[M, hidden]"
        )
    if q.shape[0] > MAX_ROWS:
        raise KernelShapeError(f"{q.shape[0]} rows; expected at most {MAX_ROWS}")


def decode_model(
    q: torch.Tensor,
    residual: torch.Tensor,
    *,
    layers: Sequence[DecoderLayerWeights],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
    norm_eps: float = 1e-6,
    pdl: bool | None = None,
    config: LayerTailConfig | None = None,
) -> torch.Tensor:
    """Every decoder layer of a decode step from the first layer's rotated queries on.

    Args:
        q: ``[M, Hq * D]`` rotated queries of the first layer (``M <= 4``); its keys and values
            are in the cache already.
        residual: ``[M, hidden]`` residual stream entering the first layer.
        layers: Every layer's weights, alike in shape.
        k_cache: ``[layers, num_blocks, block_size, Hkv, D]`` key cache (the later layers'
            keys of the step are written into it).
        v_cache: The value cache, shaped like ``k_cache``.
        block_tables: int32 ``[M, max_blocks]`` block tables of the tokens.
        context_lens: int32 ``[M]`` positions each token attends.
        slot_mapping: ``[M]`` flat cache slot of each token.
        cos: float32 ``[M, D // 2]`` RoPE cosines of the tokens' positions.
        sin: float32 ``[M, D // 2]`` RoPE sines.
        scale: Multiplier of the query-key products.
        norm_eps: Epsilon of every RMSNorm.
        pdl: As for :func:`mcore_kernels.decode_layer.decode_layer`.
        config: As for :func:`mcore_kernels.decode_layer.decode_layer`.

    Returns:
        ``[M, hidden]`` residual stream leaving the last layer (before the final norm).

    Raises:
        KernelShapeError: If the shapes do not match the layouts above.
        KernelValueError: If ``layers`` is empty or the weight table would first be built
            during CUDA graph capture.
        KernelBackendError: As for :func:`mcore_kernels.decode_layer.decode_layer`.
    """
    _check(q, residual, layers, k_cache, v_cache)
    num_q_heads = q.shape[1] // k_cache.shape[4]

    def rope(index: int) -> RotaryCacheWrite:
        return RotaryCacheWrite(
            cos=cos,
            sin=sin,
            k_cache=k_cache[index],
            v_cache=v_cache[index],
            slot_mapping=slot_mapping,
            num_q_heads=num_q_heads,
        )

    if not use_triton(q, residual):
        for index, layer in enumerate(layers):
            attention = LayerAttention(
                k_cache=k_cache[index],
                v_cache=v_cache[index],
                block_tables=block_tables,
                context_lens=context_lens,
                scale=scale,
            )
            head_dim = k_cache.shape[4]
            attended = paged_attention_reference(
                q.unflatten(-1, (-1, head_dim)),
                attention.k_cache,
                attention.v_cache,
                block_tables,
                context_lens,
                scale=scale,
            )
            following = None
            if index + 1 < len(layers):
                nxt = layers[index + 1]
                following = NextProjection(
                    weight=nxt.qkv_weight,
                    bias=nxt.qkv_bias,
                    norm_weight=nxt.input_norm_weight,
                    norm_eps=norm_eps,
                    rope=rope(index + 1),
                )
            residual, next_q = _reference(
                attended.flatten(-2),
                residual,
                layer.o_weight,
                layer.o_bias,
                layer.post_norm_weight,
                norm_eps,
                layer.gate_up_weight,
                layer.down_weight,
                following,
            )
            if next_q is not None:
                q = next_q
        return residual
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    return _launch(
        q.contiguous(),
        residual.contiguous(),
        layers,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        rope(0),
        float(scale),
        float(norm_eps),
        pdl,
        config or LayerTailConfig(),
    )


def _launch(
    q: torch.Tensor,
    residual: torch.Tensor,
    layers: Sequence[DecoderLayerWeights],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    rope: RotaryCacheWrite,
    scale: float,
    norm_eps: float,
    pdl: bool | None,
    config: LayerTailConfig,
) -> torch.Tensor:
    from mcore_kernels.decode_gemv import _rope_args

    count = len(layers)
    rows, hidden = residual.shape
    first = layers[0]
    attn_width = q.shape[1]
    ffn = first.down_weight.shape[1]
    _, _, block_size, kv_heads, head_dim = k_cache.shape
    q_heads = attn_width // head_dim
    dtype, device = residual.dtype, residual.device
    h = torch.empty((count, rows, hidden), dtype=dtype, device=device)
    act = torch.empty((count, rows, ffn), dtype=dtype, device=device)
    out = torch.empty((count, rows, hidden), dtype=dtype, device=device)
    qs = torch.empty((max(count - 1, 1), rows, attn_width), dtype=dtype, device=device)
    splits = -(-block_tables.shape[1] * block_size // ATTENTION_SPLIT)
    part_acc = torch.empty(
        (count, rows, q_heads, splits, head_dim), dtype=torch.float32, device=device
    )
    part_max = torch.empty((count, rows, q_heads, splits), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    interpreting = not residual.is_cuda
    table = _weight_table(layers, residual)
    rope_args = _rope_args(rope, residual)
    cos, sin, slots = rope_args[0], rope_args[1], rope_args[2]
    use_pdl = pdl_enabled(device) if pdl is None else pdl and pdl_supported(device)
    args = (
        q,
        residual,
        table,
        count,
        h,
        act,
        out,
        qs,
        part_acc,
        part_max,
        part_sum,
        k_cache,
        v_cache,
        k_cache.stride(0),
        v_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3),
        block_tables,
        context_lens,
        block_tables.stride(0),
        splits,
        scale,
        cos,
        sin,
        slots,
        cos.stride(0),
        sin.stride(0),
        norm_eps,
        norm_eps,
        _counter(device) if not interpreting else torch.zeros(2, dtype=torch.int32),
        rows,
        attn_width,
        hidden,
        ffn,
        first.qkv_weight.shape[0] // 2,
        q_heads,
        kv_heads,
        first.o_weight.nbytes,
        first.gate_up_weight.nbytes,
        first.down_weight.nbytes,
        first.qkv_weight.nbytes,
    )
    group = q_heads // kv_heads
    constexprs = {
        "O_BIAS": first.o_bias is not None,
        "QKV_BIAS": first.qkv_bias is not None,
        "HALF": head_dim // 2,
        "BLOCK_M": next_power_of_2(rows),
        "BN_O": config.block_n_o,
        "BK_O": max(16, next_power_of_2(attn_width)),
        "BN_GU": config.block_n_gate_up,
        "BK_GU": max(16, next_power_of_2(hidden)),
        "BN_D": config.block_n_down,
        "BK_D": max(16, next_power_of_2(ffn)),
        "BN_QKV": config.block_n_qkv,
        "BK_QKV": max(16, next_power_of_2(hidden)),
        "USE_PDL": use_pdl,
        "GROUP": group,
        "GROUP_PAD": max(16, next_power_of_2(group)),
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": block_size,
        "SPLIT": ATTENTION_SPLIT,
        "CHUNK": MERGE_CHUNK,
        "PREFETCH": config.prefetch_l2
        and not interpreting
        and _prefetchable(
            first.o_weight, first.gate_up_weight, first.down_weight, first.qkv_weight
        ),
        "PREFETCH_CHUNK": PREFETCH_CHUNK_BYTES,
        "SLEEP": 0 if interpreting else config.barrier_sleep_ns,
        "THREADS": 32 * config.num_warps,
    }
    if interpreting:
        _decode_model_kernel[(1,)](*args, **constexprs, num_warps=config.num_warps)
        return out[-1]
    device_index = residual.get_device()
    options: dict = {"launch_pdl": True} if use_pdl else {}
    programs = _PROGRAMS.get((device_index, config, *constexprs.values()))
    if programs is None:
        compiled = _decode_model_kernel.warmup(
            *args, **constexprs, grid=(1,), num_warps=config.num_warps, **options
        )
        compiled._init_handles()
        programs = _resident_programs(
            device_index,
            int(compiled.n_regs),
            int(compiled.metadata.shared),
            config.num_warps,
            config.programs_per_sm,
        )
        _PROGRAMS[(device_index, config, *constexprs.values())] = programs
    launcher = _MODEL_PDL if use_pdl else _MODEL
    launcher((programs,), args, constexprs, config.num_warps, device_index)
    return out[-1]


_PROGRAMS: dict[tuple, int] = {}
