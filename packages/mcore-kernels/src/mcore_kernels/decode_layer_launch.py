"""Launching :mod:`mcore_kernels.decode_layer`'s persistent kernel: the grid of resident
programs, the barrier counters, the attention workspace and the L2 prefetch check."""

from __future__ import annotations

import functools

import torch

from mcore_kernels._triton_utils import device_limits, next_power_of_2, pdl_supported
from mcore_kernels.decode_gemv import _rope_args
from mcore_kernels.decode_layer_config import (
    ATTENTION_SPLIT,
    MERGE_CHUNK,
    PREFETCH_CHUNK_BYTES,
    LayerAttention,
    LayerTailConfig,
    NextProjection,
)
from mcore_kernels.decode_layer_kernel import _LAYER, _LAYER_PDL, _decode_layer_kernel
from mcore_kernels.pdl import pdl_enabled


def _prefetchable(*weights: torch.Tensor) -> bool:
    """Whether bulk L2 requests can cover every weight (Hopper+, 16-byte aligned, a chunk)."""
    return all(
        pdl_supported(w.device)
        and w.nbytes >= PREFETCH_CHUNK_BYTES
        and w.nbytes % 16 == 0
        and w.data_ptr() % 16 == 0
        for w in weights
    )


@functools.cache
def _resident_programs(
    device_index: int, regs: int, shared: int, num_warps: int, wanted_per_sm: int
) -> int:
    """Programs of a persistent launch that are all resident at once on the device."""
    properties = torch.cuda.get_device_properties(device_index)
    register_file = getattr(properties, "regs_per_multiprocessor", 65536)
    threads = getattr(properties, "max_threads_per_multi_processor", 2048)
    warp_registers = -(-max(regs, 1) * 32 // 256) * 256
    by_registers = register_file // (warp_registers * num_warps)
    by_threads = threads // (32 * num_warps)
    by_shared = (device_limits(torch.device("cuda", device_index))[1] // shared) if shared else 32
    per_sm = max(1, min(wanted_per_sm, by_registers, by_threads, by_shared, 32))
    return per_sm * properties.multi_processor_count


_TIMING: list[torch.Tensor] = []
"""Benchmarks only: an int64 ``[programs, 8]`` tensor here makes every launch store each
program's GPU clock at its start (0), after the PDL wait (1), after the attention phase (2),
after the o (3), gate/up (4) and down (5) phases and at its end (6)."""
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """Two zeroed int32 counters (barrier arrivals, exits) that every launch leaves zeroed."""
    counter = _COUNTERS.get(device)
    if counter is None:
        counter = _COUNTERS[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


def _launch(
    attention_out: torch.Tensor,
    attention: LayerAttention | None,
    residual: torch.Tensor,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    post_norm_weight: torch.Tensor,
    post_norm_eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    next_qkv: NextProjection | None,
    pdl: bool | None,
    config: LayerTailConfig,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, hidden = residual.shape
    attn_width = attention_out.shape[1]
    ffn = down_weight.shape[1]
    dtype, device = residual.dtype, residual.device
    h = torch.empty((rows, hidden), dtype=dtype, device=device)
    act = torch.empty((rows, ffn), dtype=dtype, device=device)
    out = torch.empty((rows, hidden), dtype=dtype, device=device)
    dummy = residual
    q: torch.Tensor | None = None
    pairs, half = 0, 1
    qkv_weight = qkv_bias = in_norm = dummy
    in_eps = 0.0
    rope_args = _rope_args(None, dummy)
    if next_qkv is not None:
        rope = next_qkv.rope
        q = torch.empty((rows, rope.num_q_heads * rope.head_dim), dtype=dtype, device=device)
        half = rope.head_dim // 2
        pairs = next_qkv.weight.shape[0] // 2
        qkv_weight = next_qkv.weight.contiguous()
        qkv_bias = next_qkv.bias if next_qkv.bias is not None else dummy
        in_norm = next_qkv.norm_weight
        in_eps = float(next_qkv.norm_eps)
        rope_args = _rope_args(rope, dummy)
    if rows == 0:
        return out, q
    attend_args, attend_constexprs = _attention_args(attention, attention_out, dummy)
    interpreting = not residual.is_cuda
    use_pdl = pdl_enabled(device) if pdl is None else pdl and pdl_supported(device)
    args = (
        attention_out,
        residual,
        o_weight,
        o_bias if o_bias is not None else dummy,
        h,
        post_norm_weight,
        post_norm_eps,
        gate_up_weight,
        act,
        down_weight,
        out,
        qkv_weight,
        qkv_bias,
        in_norm,
        in_eps,
        q if q is not None else dummy,
        *rope_args,
        _counter(device) if not interpreting else torch.zeros(2, dtype=torch.int32),
        rows,
        attn_width,
        hidden,
        ffn,
        pairs,
        *attend_args,
        o_weight.nbytes,
        gate_up_weight.nbytes,
        down_weight.nbytes,
        qkv_weight.nbytes,
        _TIMING[0] if _TIMING and not interpreting else dummy,
    )
    constexprs = {
        "O_BIAS": o_bias is not None,
        "NEXT": next_qkv is not None,
        "QKV_BIAS": next_qkv is not None and next_qkv.bias is not None,
        "HALF": half,
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
        **attend_constexprs,
        "PREFETCH": config.prefetch_l2
        and _prefetchable(
            o_weight, gate_up_weight, down_weight, *([qkv_weight] if next_qkv is not None else [])
        ),
        "PREFETCH_CHUNK": PREFETCH_CHUNK_BYTES,
        "SLEEP": 0 if interpreting else config.barrier_sleep_ns,
        "THREADS": 32 * config.num_warps,
        "TIMING": bool(_TIMING) and not interpreting,
    }
    if interpreting:
        # The interpreter runs programs one after the other: a grid barrier needs one program.
        _decode_layer_kernel[(1,)](*args, **constexprs, num_warps=config.num_warps)
        return out, q
    device_index = residual.get_device()
    programs = _programs(args, constexprs, config, device_index)
    launcher = _LAYER_PDL if use_pdl else _LAYER
    launcher((programs,), args, constexprs, config.num_warps, device_index)
    return out, q


_PROGRAMS: dict[tuple, int] = {}


def _programs(args: tuple, constexprs: dict, config: LayerTailConfig, device_index: int) -> int:
    """The grid of a launch: every program resident at once (compiles the kernel once)."""
    key = (device_index, config, *constexprs.values())
    programs = _PROGRAMS.get(key)
    if programs is None:
        options = {"launch_pdl": True} if constexprs["USE_PDL"] else {}
        compiled = _decode_layer_kernel.warmup(
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
        _PROGRAMS[key] = programs
    return programs


def _attention_args(
    attention: LayerAttention | None, q: torch.Tensor, dummy: torch.Tensor
) -> tuple[tuple, dict]:
    """The kernel's attention arguments and constexprs (dummies without attention)."""
    if attention is None:
        args = (dummy,) * 7 + (1.0, 1, 0) + (0,) * 6
        constexprs = {
            "ATTEND": False,
            "GROUP": 1,
            "GROUP_PAD": 16,
            "HEAD_DIM": 16,
            "BLOCK_SIZE": 1,
            "SPLIT": ATTENTION_SPLIT,
            "CHUNK": MERGE_CHUNK,
        }
        return args, constexprs
    keys, values = attention.k_cache, attention.v_cache
    _, block_size, kv_heads, head_dim = keys.shape
    tables = attention.block_tables
    rows = q.shape[0]
    q_heads = q.shape[1] // head_dim
    splits = -(-tables.shape[1] * block_size // ATTENTION_SPLIT)
    part_acc = torch.empty((rows, q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    part_max = torch.empty((rows, q_heads, splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    args = (
        keys,
        values,
        tables,
        attention.context_lens,
        part_acc,
        part_max,
        part_sum,
        float(attention.scale),
        splits,
        tables.stride(0),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
    )
    group = q_heads // kv_heads
    constexprs = {
        "ATTEND": True,
        "GROUP": group,
        "GROUP_PAD": max(16, next_power_of_2(group)),
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": block_size,
        "SPLIT": ATTENTION_SPLIT,
        "CHUNK": MERGE_CHUNK,
    }
    return args, constexprs
