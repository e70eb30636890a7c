"""Decode attention over a short paged context fused into the output projection that follows it.

At batch 1 a decoder layer is a chain of dependent launches (q/k/v projection, attention, o
projection, gate/up, down), and each link costs a few microseconds of dependent round trips
whatever it computes. The attention of one token over a short context is tiny (at 256
positions of the Qwen2.5-0.5B shape, 128 KiB of keys and values per layer), so
:func:`attention_o_proj` lets every program of the o projection recompute it from L2 instead
of waiting for an attention kernel: the attention becomes redundant L2 traffic, and the layer
loses one grid-wide dependency.

Each program of the launch owns ``block_n`` output columns of one token:

1. under programmatic dependent launch, before waiting for the previous kernel: request its
   share of the token's key and value rows into L2 (the history does not depend on that
   kernel), load its ``[block_n, Hq * D]`` weight tile and the bias;
2. attend every query head over the whole context, in tiles of positions, with the online
   softmax and the tensor-core products of
   :func:`mcore_kernels.paged_attention.paged_attention` (all key/value heads at once: the
   cache holds a position's heads side by side, so one ``[tile, Hkv * D]`` load serves them
   all, and each query row is zero outside its own head's channels, which adds exact zeros);
   the output rows are normalised and rounded to the query dtype exactly as the one-split
   attention kernel does;
3. write those ``[Hq, D]`` outputs to its own scratch row, read them back as the flat
   ``[Hq * D]`` input vector, and finish as :func:`mcore_kernels.decode_gemv.decode_gemv`
   does: float32 products, bias, one rounding, the residual add and one more rounding.

Every program computes the same attention bits and each output column is one program's
fixed-order sum: results do not depend on the launch, the grid or the arrival order.

Shapes: ``q`` ``[T, Hq, D]`` (rotated queries), ``k_cache``/``v_cache`` ``[num_blocks,
block_size, Hkv, D]`` with the last two dimensions contiguous, ``block_tables`` ``[T,
max_blocks]``, ``context_lens`` ``[T]``, ``weight`` ``[N, Hq * D]``, ``bias`` ``[N]``,
``residual`` ``[T, N]``; returns ``[T, N]``.

Dispatch: Triton on CUDA, the torch references on CPU (``MCORE_KERNELS_BACKEND`` overrides;
with ``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors).
"""

from __future__ import annotations

import math

import torch

from mcore_kernels._backend import _interpreting, use_triton
from mcore_kernels._triton_utils import (
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    pdl_supported,
    prefetch_l2,
    tl,
    triton,
)
from mcore_kernels._validation import check_paged_attention_args
from mcore_kernels.decode_gemv_epilogues import _epilogue
from mcore_kernels.errors import KernelBackendError, KernelDtypeError, KernelShapeError
from mcore_kernels.paged_attention import _attend_rows
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import decode_gemv_reference, paged_attention_reference

__all__ = [
    "ATTENTION_O_PROJ_BLOCK_N",
    "ATTENTION_O_PROJ_TILE",
    "ATTENTION_O_PROJ_WARPS",
    "attention_o_proj",
    "attention_o_proj_reference",
]

ATTENTION_O_PROJ_BLOCK_N = 16
"""Output columns per program (the launch has ``ceil(N / block_n)`` programs per token, each
reading the whole context once from L2)."""
ATTENTION_O_PROJ_WARPS = 8
"""Warps per program."""
ATTENTION_O_PROJ_TILE = 32
"""Context positions per attention step."""
ATTENTION_O_PROJ_STAGES = 2
"""Software-pipelining stages of the attention's tile loop (the paged attention kernel's)."""


PREFETCH_CHUNK = 16384
"""Bytes per bulk L2 prefetch request of the weights to come (``prefetch=``)."""


@jit
def _prefetch_l2_bytes(ptr, nbytes, pid, programs, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Request this program's chunks of the ``nbytes`` bytes at ``ptr`` into L2.

    Chunk ``i`` goes to program ``i % programs``, one chunk per lane
    (``cp.async.bulk.prefetch.L2``: a hint served by the copy engine, Hopper and newer); lanes
    without a chunk are predicated off, so every chunk is requested exactly once. Inline PTX:
    CUDA only.
    """
    chunks = tl.cdiv(nbytes, CHUNK)
    base = ptr.to(tl.pointer_type(tl.int8))
    lanes = tl.arange(0, LANES)
    for start in range(0, tl.cdiv(chunks, programs), LANES):
        index = (start + lanes).to(tl.int64) * programs + pid
        offset = index * CHUNK
        size = tl.minimum(nbytes - offset, CHUNK).to(tl.int32)
        live = (index < chunks).to(tl.int32)
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $3, 0;\n\t"
            "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
            "=r,l,r,r",
            [base + offset, size, live],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@jit(do_not_specialize=("stride_table_token",))
def _attention_o_proj_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    ctx_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    scratch_ptr,
    next_a_ptr,
    next_a_bytes,
    next_b_ptr,
    next_b_bytes,
    scale,
    stride_q_token,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_v_block,
    stride_v_slot,
    stride_table_token,
    stride_wn,
    stride_rm,
    stride_om,
    N,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    ALIGN: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    LINES: tl.constexpr,
    LINE: tl.constexpr,
    PREFETCH_NEXT: tl.constexpr,
    CHUNK: tl.constexpr,
    LANES: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    token = tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    table = table_ptr + token.to(tl.int64) * stride_table_token
    context = tl.load(ctx_ptr + token).to(tl.int32)
    if PREFETCH:
        # This program's share of the token's key and value lines (the history was written by
        # earlier steps; the new position's row is read again after the wait).
        lanes = tl.arange(0, PREFETCH)
        for start in range(pid_n * PREFETCH, context * LINES, tl.num_programs(0) * PREFETCH):
            item = start + lanes
            valid = item < context * LINES
            position = tl.where(valid, item // LINES, 0)
            physical = tl.load(table + position // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            slot = position % BLOCK_SIZE
            line = (item % LINES) * LINE
            prefetch_l2(k_ptr + (physical * stride_k_block + slot * stride_k_slot) * ALIGN + line)
            prefetch_l2(v_ptr + (physical * stride_v_block + slot * stride_v_slot) * ALIGN + line)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, K_PAD)
    k_mask = offs_k < NUM_Q_HEADS * HEAD_DIM
    w_rows = tl.where(n_mask, offs_n, 0).to(tl.int64) * stride_wn
    # The weight tile and the bias do not depend on the previous kernel: requested first.
    w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :], mask=k_mask[None, :], other=0.0)
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if PREFETCH_NEXT:
        # The weights of the launches to come stream into L2 while this chain link waits.
        programs = tl.num_programs(0) * tl.num_programs(1)
        pid = token * tl.num_programs(0) + pid_n
        _prefetch_l2_bytes(next_a_ptr, next_a_bytes, pid, programs, CHUNK, LANES)
        _prefetch_l2_bytes(next_b_ptr, next_b_bytes, pid, programs, CHUNK, LANES)
    if USE_PDL:
        gdc_wait()
    offs_m = tl.zeros([1], tl.int32) + token
    m_mask = offs_m >= 0
    residual = tl.zeros([1, BLOCK_N], tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(
            res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=n_mask[None, :], other=0.0
        ).to(tl.float32)
    # Query row h holds head h's channels at its key/value head's place in the [Hkv * D] row
    # of a position, and zeros elsewhere.
    rows = tl.arange(0, ROWS)
    columns = tl.arange(0, WIDTH_PAD)
    channel = columns % HEAD_DIM
    own = ((rows // GROUP)[:, None] == (columns // HEAD_DIM)[None, :]) & (rows < NUM_Q_HEADS)[
        :, None
    ]
    own = own & (columns < WIDTH)[None, :]
    q = tl.load(
        q_ptr + token * stride_q_token + rows[:, None] * stride_q_head + channel[None, :],
        mask=own,
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    active = rows < NUM_Q_HEADS
    ctx_rows = tl.where(active, context, 0)
    _, running_sum, acc = _attend_rows(
        q, ctx_rows, active, table, k_ptr, v_ptr, 0,
        stride_k_block, stride_k_slot, 0, stride_v_block, stride_v_slot, 0,
        scale, 0, context,
        ROWS, WIDTH, WIDTH_PAD, BLOCK_SIZE, TILE, True, ALIGN, DOT_F32,
    )  # fmt: skip
    attended = (acc / tl.where(active, running_sum, 1.0)[:, None]).to(dtype)
    # Through this program's scratch row: the [Hq, Hkv * D] layout becomes the flat input.
    scratch = scratch_ptr + (token * tl.num_programs(0) + pid_n) * K_PAD
    tl.store(scratch + rows[:, None] * HEAD_DIM + channel[None, :], attended, mask=own)
    tl.debug_barrier()
    x = tl.load(scratch + offs_k, mask=k_mask, other=0.0)
    products = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    _epilogue(
        products[None, :], products[None, :], bias_ptr, res_ptr, out_ptr, offs_m, offs_n,
        m_mask, N, stride_rm, stride_om, HAS_BIAS, HAS_RESIDUAL, False, dtype,
        bias, bias, residual, True,
    )  # fmt: skip


def _prefetch_args(
    prefetch: tuple[torch.Tensor, torch.Tensor] | None, dummy: torch.Tensor
) -> tuple:
    if prefetch is None:
        return (dummy, 0, dummy, 0)
    args: list = []
    for tensor in prefetch:
        if not tensor.is_contiguous() or tensor.nbytes % 16 or tensor.data_ptr() % 16:
            raise KernelShapeError("prefetch tensors must be contiguous and 16-byte aligned")
        args += [tensor, tensor.nbytes]
    return tuple(args)


def attention_o_proj_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scale: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unfused ops in plain torch: paged attention, then the projection and residual add.

    Args:
        q: ``[T, Hq, D]`` rotated queries.
        k_cache: ``[num_blocks, block_size, Hkv, D]`` keys.
        v_cache: Values shaped like ``k_cache``.
        block_tables: ``[T, max_blocks]`` block table rows.
        context_lens: ``[T]`` attended positions per token.
        weight: ``[N, Hq * D]`` output projection.
        bias: Optional ``[N]`` bias.
        scale: Multiplier of the query-key products.
        residual: Optional ``[T, N]`` tensor added to the projection.

    Returns:
        ``[T, N]`` in the dtype of ``q``.
    """
    attended = paged_attention_reference(
        q, k_cache, v_cache, block_tables, context_lens, scale=scale
    )
    return decode_gemv_reference(attended.flatten(1), weight, bias, residual=residual)


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> None:
    check_paged_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    tokens, heads, head_dim = q.shape
    if weight.dim() != 2 or weight.shape[1] != heads * head_dim:
        raise KernelShapeError(
            f"weight has shape {tuple(weight.shape)}; expected [N, {heads * head_dim}]"
        )
    if weight.dtype != q.dtype:
        raise KernelDtypeError(f"weight {weight.dtype}; expected {q.dtype} like q")
    n = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise KernelShapeError(f"bias has shape {tuple(bias.shape)}; expected [{n}]")
    if residual is not None:
        if tuple(residual.shape) != (tokens, n):
            raise KernelShapeError(
                f"residual has shape {tuple(residual.shape)}; expected [{tokens}, {n}]"
            )
        if residual.dtype != q.dtype:
            raise KernelDtypeError(f"residual {residual.dtype}; expected {q.dtype} like q")


def attention_o_proj(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scale: float,
    residual: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    pdl: bool | None = None,
    prefetch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``residual + paged_attention(q, ...).flatten(1) @ weight.T + bias`` in one launch.

    For decode steps of a few tokens over short contexts (see the module docstring): every
    program reads the whole context of its token, so the launch moves ``ceil(N / block_n)``
    times the keys and values through L2. The attention's products and roundings are those of
    the paged attention kernel with one split; the projection's are those of ``decode_gemv``
    (float32 sums, rounded after the bias and again after the residual add).

    Args:
        q: ``[T, Hq, D]`` rotated queries (last dimension contiguous).
        k_cache: ``[num_blocks, block_size, Hkv, D]`` keys (last two dimensions contiguous).
        v_cache: Values shaped and laid out like ``k_cache``.
        block_tables: ``[T, max_blocks]`` block table row of each token.
        context_lens: ``[T]`` attended positions per token (each at least 1).
        weight: ``[N, Hq * D]`` contiguous output projection, in the dtype of ``q``.
        bias: Optional ``[N]`` bias.
        scale: Multiplier of the query-key products.
        residual: Optional ``[T, N]`` tensor added to the projection (rounded once more).
        block_n: Output columns per program (None: :data:`ATTENTION_O_PROJ_BLOCK_N`).
        num_warps: Warps per program (None: :data:`ATTENTION_O_PROJ_WARPS`).
        pdl: Launch with programmatic dependent launch where supported (None: inside
            :func:`mcore_kernels.pdl.programmatic_dependent_launch` only).
        prefetch: Two contiguous tensors (the weights of the launches to come) whose bytes
            the programs request into L2 before they wait (Hopper or newer; a hint, no value
            changes; ignored elsewhere).

    Returns:
        ``[T, N]`` in the dtype of ``q``.

    Raises:
        KernelShapeError: If the shapes or layouts do not match the above.
        KernelDtypeError: If the dtypes differ or are unsupported.
        KernelBackendError: If ``MCORE_KERNELS_BACKEND`` names a backend that cannot run here.
    """
    _check(q, k_cache, v_cache, block_tables, context_lens, weight, bias, residual)
    if not use_triton(q, k_cache, v_cache, weight):
        return attention_o_proj_reference(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            weight,
            bias,
            scale=scale,
            residual=residual,
        )
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    tokens, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(3) != 1 or cache.stride(2) != head_dim:
            raise KernelShapeError(
                f"{name} strides {cache.stride()}; expected contiguous [Hkv, D] per position"
            )
    if q.stride(2) != 1 or not weight.is_contiguous():
        raise KernelShapeError("q needs a contiguous last dimension and weight contiguity")
    if residual is not None and residual.stride(1) != 1:
        raise KernelShapeError(f"residual strides {residual.stride()}; expected stride 1 last")
    n = weight.shape[0]
    out = torch.empty((tokens, n), dtype=q.dtype, device=q.device)
    if tokens == 0 or n == 0:
        return out
    block_n = block_n or ATTENTION_O_PROJ_BLOCK_N
    num_warps = num_warps or ATTENTION_O_PROJ_WARPS
    k_pad = next_power_of_2(heads * head_dim)
    grid = (triton.cdiv(n, block_n), tokens)
    scratch = torch.empty((tokens, grid[0], k_pad), dtype=q.dtype, device=q.device)
    strides = (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    align = math.gcd(16, *strides)
    width = kv_heads * head_dim
    line = max(1, 128 // k_cache.element_size())
    use_pdl = pdl_enabled(q.device) if pdl is None else pdl and pdl_supported(q.device)
    interpreting = _interpreting()
    _attention_o_proj_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables.contiguous(),
        context_lens.contiguous(),
        weight,
        bias if bias is not None else weight,
        residual if residual is not None else out,
        out,
        scratch,
        *(next_args := _prefetch_args(prefetch, out)),
        float(scale),
        q.stride(0),
        q.stride(1),
        *(stride // align for stride in strides),
        block_tables.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        n,
        NUM_Q_HEADS=heads,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        ROWS=max(16, next_power_of_2(heads)),
        WIDTH=width,
        WIDTH_PAD=max(16, next_power_of_2(width)),
        K_PAD=k_pad,
        BLOCK_SIZE=block_size,
        TILE=ATTENTION_O_PROJ_TILE,
        ALIGN=align,
        DOT_F32=q.dtype == torch.float32 or interpreting,
        BLOCK_N=block_n,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        USE_PDL=use_pdl,
        PREFETCH=32 * num_warps if use_pdl else 0,
        LINES=triton.cdiv(width, line),
        LINE=line,
        PREFETCH_NEXT=next_args[1] > 0 and not interpreting and q.is_cuda,
        CHUNK=PREFETCH_CHUNK,
        LANES=32 * num_warps,
        num_warps=num_warps,
        num_stages=ATTENTION_O_PROJ_STAGES,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out
