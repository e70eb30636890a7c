"""Decode attention whose split-KV merge runs inside the output projection that follows it.

At batch 1 a decoder layer is a chain of dependent launches (q/k/v projection, attention, o
projection, gate/up, down), and each link costs a few microseconds of dependent round trips.
The paged attention kernel gives each key/value head of a token one program per split of 256
positions, which walks its split tile by tile: at a context of 160 that program is the
longest link of the layer, and the step's time grows with the context. :func:`attention_o_proj`
instead runs the split kernel with short splits (:data:`ATTENTION_O_PROJ_SPLIT` positions, one
tile each: one memory round trip per program whatever the context) and leaves the merge of the
splits to the o projection: every program of the projection merges the partial results of
all query heads of its token (a few KiB from L2) before its product, so the merge costs no
launch of its own.

Each program of the projection owns ``block_n`` output columns of one token:

1. under programmatic dependent launch, before waiting for the attention: load its
   ``[block_n, Hq * D]`` weight tile and the bias;
2. merge the splits of every query head in a fixed order (the paged attention's merge: only
   the splits that hold the context, in chunks of a fixed size), normalise and round to the
   query dtype, into its own scratch row;
3. read that row back as the flat ``[Hq * D]`` input and finish as
   :func:`mcore_kernels.decode_gemv.decode_gemv` does: float32 products, bias, one rounding,
   the residual add and one more rounding.

Every program computes the same attention bits and each output column is one program's
fixed-order sum: results depend on the split size, never on the launch, the grid, the table
width or the arrival order.

Shapes: ``q`` ``[T, Hq, D]`` (rotated queries), ``k_cache``/``v_cache`` ``[num_blocks,
block_size, Hkv, D]``, ``block_tables`` ``[T, max_blocks]``, ``context_lens`` ``[T]``,
``weight`` ``[N, Hq * D]``, ``bias`` ``[N]``, ``residual`` ``[T, N]``; returns ``[T, N]``.

Dispatch: Triton on CUDA, the torch references on CPU (``MCORE_KERNELS_BACKEND`` overrides;
with ``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors). While ``torch.compile`` traces
a call it becomes the ``torch.library`` op ``torch.ops.mcore_kernels.attention_o_proj``, which
runs the same dispatch when the graph runs. The torch reference,
:func:`mcore_kernels.reference.attention_o_proj_reference`, is re-exported here.
"""

from __future__ import annotations

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    pdl_supported,
    tl,
    triton,
)
from mcore_kernels._validation import check_paged_attention_args
from mcore_kernels.decode_gemv_epilogues import _epilogue
from mcore_kernels.errors import KernelBackendError, KernelDtypeError, KernelShapeError
from mcore_kernels.paged_attention import _merge_rows, paged_attention_partials
from mcore_kernels.pdl import pdl_enabled, programmatic_dependent_launch
from mcore_kernels.reference import attention_o_proj_reference

__all__ = [
    "ATTENTION_O_PROJ_BLOCK_N",
    "ATTENTION_O_PROJ_MERGE_CHUNK",
    "ATTENTION_O_PROJ_SPLIT",
    "ATTENTION_O_PROJ_WARPS",
    "attention_o_proj",
    "attention_o_proj_reference",
]

ATTENTION_O_PROJ_SPLIT = 32
"""Context positions per split of the attention (one tile of the split kernel each)."""
ATTENTION_O_PROJ_BLOCK_N = 16
"""Output columns per program of the projection (each merges every head's splits)."""
ATTENTION_O_PROJ_WARPS = 8
"""Warps per program of the projection."""
ATTENTION_O_PROJ_MERGE_CHUNK = 16
"""Splits the projection's merge reads at once (a fixed size: the sums depend only on the
token's context, never on the table width). One H200, the captured batch-1 step of the
Qwen2.5-0.5B shape: 514.9 against 521.6 us with 8 at a context of 160, 517.8 against 553.3 us
at 288 (10 splits: one chunk instead of two)."""


@jit(do_not_specialize=("num_splits",))
def _merge_o_proj_kernel(
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    ctx_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    scratch_ptr,
    num_splits,
    stride_wn,
    stride_rm,
    stride_om,
    N,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    K_PAD: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    token = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, K_PAD)
    k_mask = offs_k < NUM_Q_HEADS * HEAD_DIM
    w_rows = tl.where(n_mask, offs_n, 0).to(tl.int64) * stride_wn
    # The weight tile and the bias do not depend on the attention: requested first.
    w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :], mask=k_mask[None, :], other=0.0)
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_wait()
    offs_m = tl.zeros([1], tl.int32) + token
    m_mask = offs_m >= 0
    residual = tl.zeros([1, BLOCK_N], tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(
            res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=n_mask[None, :], other=0.0
        ).to(tl.float32)
    heads = tl.arange(0, ROWS)
    row_ok = heads < NUM_Q_HEADS
    context = tl.load(ctx_ptr + token).to(tl.int32)
    # Every head's merged output, rounded, into this program's scratch row ([Hq, D] flat).
    scratch = scratch_ptr + (token * tl.num_programs(0) + pid_n) * K_PAD
    _merge_rows(
        partial_out_ptr, partial_max_ptr, partial_sum_ptr, scratch, tl.zeros([ROWS], tl.int32) + token,
        heads, row_ok, tl.where(row_ok, context, 0), NUM_Q_HEADS, num_splits, 0, HEAD_DIM,
        ROWS, HEAD_DIM, HEAD_DIM_PAD, SPLIT_SIZE, CHUNK,
    )  # fmt: skip
    tl.debug_barrier()
    x = tl.load(scratch + offs_k, mask=k_mask, other=0.0)
    products = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    _epilogue(
        products[None, :], products[None, :], bias_ptr, res_ptr, out_ptr, offs_m, offs_n,
        m_mask, N, stride_rm, stride_om, HAS_BIAS, HAS_RESIDUAL, False, dtype,
        bias, bias, residual, True,
    )  # fmt: skip


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
    split_size: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``residual + paged_attention(q, ...).flatten(1) @ weight.T + bias`` in two launches.

    For decode steps of a few tokens (see the module docstring): the paged attention's split
    kernel over splits of ``split_size`` positions, then the projection, whose programs merge
    the splits first. The attention's products, merge and roundings are those of
    :func:`mcore_kernels.paged_attention.paged_attention` with that split size and the merge
    kernel; the projection's are those of ``decode_gemv`` (float32 sums, rounded after the
    bias and again after the residual add).

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
        split_size: Context positions per split, a multiple of the block size (None:
            :data:`ATTENTION_O_PROJ_SPLIT`).
        block_n: Output columns per program (None: :data:`ATTENTION_O_PROJ_BLOCK_N`).
        num_warps: Warps per program (None: :data:`ATTENTION_O_PROJ_WARPS`).
        pdl: Launch both kernels with programmatic dependent launch where supported (None:
            inside :func:`mcore_kernels.pdl.programmatic_dependent_launch` only).

    Returns:
        ``[T, N]`` in the dtype of ``q``.

    Raises:
        KernelShapeError: If the shapes or layouts do not match the above, or ``split_size``
            is not a positive multiple of the block size.
        KernelDtypeError: If the dtypes differ or are unsupported.
        KernelBackendError: If ``MCORE_KERNELS_BACKEND`` names a backend that cannot run here.
    """
    _check(q, k_cache, v_cache, block_tables, context_lens, weight, bias, residual)
    if _compile.compiling():
        return _attention_o_proj_op(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            weight,
            bias,
            float(scale),
            residual,
            split_size,
            block_n,
            num_warps,
            pdl,
        )
    return _attention_o_proj_run(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        weight,
        bias,
        scale,
        residual,
        split_size,
        block_n,
        num_warps,
        pdl,
    )


def _attention_o_proj_run(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    residual: torch.Tensor | None,
    split_size: int | None,
    block_n: int | None,
    num_warps: int | None,
    pdl: bool | None,
) -> torch.Tensor:
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
    if not weight.is_contiguous():
        raise KernelShapeError(f"weight strides {weight.stride()}; expected a contiguous weight")
    if residual is not None and residual.stride(1) != 1:
        raise KernelShapeError(f"residual strides {residual.stride()}; expected stride 1 last")
    n = weight.shape[0]
    out = torch.empty((tokens, n), dtype=q.dtype, device=q.device)
    if tokens == 0 or n == 0:
        return out
    split_size = split_size or ATTENTION_O_PROJ_SPLIT
    block_n = block_n or ATTENTION_O_PROJ_BLOCK_N
    num_warps = num_warps or ATTENTION_O_PROJ_WARPS
    use_pdl = pdl_enabled(q.device) if pdl is None else pdl and pdl_supported(q.device)
    with programmatic_dependent_launch(use_pdl):
        partial_out, partial_max, partial_sum = paged_attention_partials(
            q, k_cache, v_cache, block_tables, context_lens, scale=scale, split_size=split_size
        )
    k_pad = next_power_of_2(heads * head_dim)
    grid = (triton.cdiv(n, block_n), tokens)
    scratch = torch.empty((tokens, grid[0], k_pad), dtype=q.dtype, device=q.device)
    _merge_o_proj_kernel[grid](
        partial_out,
        partial_max,
        partial_sum,
        context_lens.contiguous(),
        weight,
        bias if bias is not None else weight,
        residual if residual is not None else out,
        out,
        scratch,
        partial_max.shape[2],
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        n,
        NUM_Q_HEADS=heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        ROWS=next_power_of_2(heads),
        K_PAD=k_pad,
        SPLIT_SIZE=split_size,
        CHUNK=ATTENTION_O_PROJ_MERGE_CHUNK,
        BLOCK_N=block_n,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        USE_PDL=use_pdl,
        num_warps=num_warps,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out


@_compile.custom_op(
    "attention_o_proj",
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
    "Tensor weight, Tensor? bias, float scale, Tensor? residual, int? split_size, int? block_n, "
    "int? num_warps, bool? pdl) -> Tensor",
)
def _attention_o_proj_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    residual: torch.Tensor | None,
    split_size: int | None,
    block_n: int | None,
    num_warps: int | None,
    pdl: bool | None,
) -> torch.Tensor:
    return _attention_o_proj_run(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        weight,
        bias,
        scale,
        residual,
        split_size,
        block_n,
        num_warps,
        pdl,
    )


@_attention_o_proj_op.register_fake
def _attention_o_proj_fake(q, k_cache, v_cache, block_tables, context_lens, weight, *rest):
    return q.new_empty((q.shape[0], weight.shape[0]))
