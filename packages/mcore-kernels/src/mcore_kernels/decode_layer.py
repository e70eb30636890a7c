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

import functools
from dataclasses import dataclass

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import device_limits, next_power_of_2, pdl_supported, triton
from mcore_kernels.decode_gemv import _rope_args
from mcore_kernels.decode_layer_kernel import _LAYER, _LAYER_PDL, _decode_layer_kernel
from mcore_kernels.errors import KernelBackendError, KernelShapeError, KernelValueError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import decode_gemv_reference, paged_attention_reference
from mcore_kernels.rotary_kv_write import RotaryCacheWrite, rotary_kv_write_reference

__all__ = [
    "ATTENTION_SPLIT",
    "MAX_ROWS",
    "LayerAttention",
    "LayerTailConfig",
    "NextProjection",
    "decode_layer",
    "decode_layer_tail",
]

MAX_ROWS = 4
"""Most rows (tokens) :func:`decode_layer_tail` and :func:`decode_layer` take."""
ATTENTION_SPLIT = 64
"""Context positions per work item of :func:`decode_layer`'s attention."""
PREFETCH_CHUNK_BYTES = 16384
"""Bytes per bulk L2 request of :class:`LayerTailConfig`'s ``prefetch_l2``."""
MERGE_CHUNK = 2
"""Splits merged per step of the running maximum (4 needs more registers than two programs
per multiprocessor allow at 8 warps)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LayerAttention:
    """The layer's paged decode attention that :func:`decode_layer` folds in."""

    k_cache: torch.Tensor
    """The layer's key cache ``[num_blocks, block_size, Hkv, D]`` (``D`` a power of two >= 16)."""
    v_cache: torch.Tensor
    """The layer's value cache, shaped like ``k_cache``."""
    block_tables: torch.Tensor
    """int32 ``[M, max_blocks]`` physical block of each logical block of each token."""
    context_lens: torch.Tensor
    """int32 ``[M]`` positions each token attends (its own included; at least 1)."""
    scale: float
    """Multiplier of the query-key products."""


@dataclass(kw_only=True, slots=True, frozen=True)
class NextProjection:
    """The next layer's q/k/v projection that :func:`decode_layer_tail` folds in."""

    weight: torch.Tensor
    """``[(Hq + 2 Hkv) * D, hidden]`` q, k then v projection weights (contiguous)."""
    bias: torch.Tensor | None
    """``[(Hq + 2 Hkv) * D]`` biases, or None."""
    norm_weight: torch.Tensor
    """``[hidden]`` weight of the next layer's input RMSNorm."""
    norm_eps: float
    """Its epsilon."""
    rope: RotaryCacheWrite
    """RoPE tables, the next layer's key/value cache and the tokens' slots."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LayerTailConfig:
    """Launch configuration of :func:`decode_layer_tail`."""

    programs_per_sm: int = 2
    """Resident programs per multiprocessor (capped by what the compiled kernel fits)."""
    num_warps: int = 8
    """Warps per program."""
    block_n_o: int = 4
    """Output columns per tile of the o projection."""
    block_n_gate_up: int = 8
    """Output columns (gate/up row pairs) per tile of the gate/up projection."""
    block_n_down: int = 2
    """Output columns per tile of the down projection."""
    block_n_qkv: int = 4
    """Channel pairs per tile of the q/k/v projection."""
    max_registers: int = 0
    """Register cap per thread of :func:`mcore_kernels.decode_model.decode_model`'s kernel
    (``maxnreg``; 0: the compiler's choice): 128 at 8 warps fits two programs per
    multiprocessor at the cost of spills."""
    barrier_sleep_ns: int = 0
    """Nanoseconds a program sleeps between polls of a grid barrier (0: none)."""
    prefetch_l2: bool = True
    """Request the layer's weights into L2 at the start (bulk requests, Hopper and newer;
    ignored elsewhere and where a weight is not 16-byte aligned or smaller than a chunk)."""

    def __post_init__(self) -> None:
        if self.max_registers < 0:
            raise KernelValueError(
                f"LayerTailConfig.max_registers={self.max_registers}; expected >= 0"
            )
        if self.barrier_sleep_ns < 0:
            raise KernelValueError(
                f"LayerTailConfig.barrier_sleep_ns={self.barrier_sleep_ns}; expected >= 0"
            )
        if self.programs_per_sm < 1:
            raise KernelValueError(
                f"LayerTailConfig.programs_per_sm={self.programs_per_sm}; expected >= 1"
            )
        for name in ("num_warps", "block_n_o", "block_n_gate_up", "block_n_down", "block_n_qkv"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise KernelValueError(f"LayerTailConfig.{name}={value}; expected a power of two")


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
