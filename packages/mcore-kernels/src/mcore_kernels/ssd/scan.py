"""Mamba-2 chunked scan (SSD): Triton forward and backward kernels, autograd function, API.

One program handles one (sequence, head, block of head-dim rows) and walks the sequence's
chunks in order, keeping its rows of the ``[P, N]`` state in registers. Inside a chunk of ``L`` tokens, with ``a`` the running sum of
``dt * A``, the output is the masked quadratic form ``(C B^T * exp(a_l - a_s) [s <= l]) (x dt)``
plus the carried state's contribution ``exp(a_l) C_l S``; the state then moves on by
``exp(a_last) S + sum_s exp(a_last - a_s) dt_s x_s B_s^T``. Chunks start at each sequence's
first token, so packed sequences never mix and need no mask (``cu_seqlens``).

The forward saves the state at the start of every chunk (float32, ``[chunks, H, P, N]``); the
backward walks the chunks in reverse, recomputes the chunk's quadratic form from the saved
state and carries the gradient of the state backwards. ``B`` and ``C`` gradients are written
per head and head-dim block and summed over the heads of a group and the blocks afterwards;
``dt``, ``A`` and ``D`` gradients per block (and sequence) and summed. All arithmetic is float32 (inputs are upcast after loading and
matrix products run with ``input_precision="ieee"``), so results agree with the float32
reference to rounding.

Eager calls go to the launchers (through ``_SSDScanFunction`` when a gradient is needed); while
``torch.compile`` traces a call it becomes the custom op ``torch.ops.mcore_kernels.ssd_scan_fwd``
with the registered backward ``ssd_scan_bwd``. The torch reference is
:func:`mcore_kernels.ssd.reference.ssd_scan_reference`.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import jit, next_power_of_2, on_device_of, tl
from mcore_kernels.ssd._checks import check_scan_args, default_cu_seqlens
from mcore_kernels.ssd.reference import ssd_scan_reference

__all__ = ["MAX_KERNEL_CHUNK", "ssd_scan", "ssd_scan_triton"]


MAX_KERNEL_CHUNK = 64
"""Longest chunk a kernel program holds: a larger ``chunk_size`` runs in chunks of this size
(same result up to rounding), which keeps the ``[chunk, chunk]`` and ``[chunk, N]`` tiles of
the backward within registers and shared memory at ``P = 64``, ``N = 128``."""


# --- Triton kernels ---------------------------------------------------------------------------


@jit
def _program_ids(cu_ptr, HEADS_PER_GROUP: tl.constexpr):
    """``(seq, head, p_block, group, start, end)``: this program's sequence, head, block of
    state rows and group, and the sequence's tokens ``[start, end)``."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p_block = tl.program_id(2)
    group = head // HEADS_PER_GROUP
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    return seq, head, p_block, group, start, end


@jit
def _state_tile(
    seq, head, p_block, heads, head_dim, state_size, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr
):
    """``(offs_p, offs_n, mask_pn, state_off, pn_off)``: the program's rows and columns of the
    ``[P, N]`` state; ``state_off + pn_off`` addresses its tile of a ``[S, H, P, N]`` state."""
    offs_p = p_block * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_pn = (offs_p < head_dim)[:, None] & (offs_n < state_size)[None, :]
    state_off = (seq * heads + head) * head_dim * state_size
    pn_off = offs_p[:, None] * state_size + offs_n[None, :]
    return offs_p, offs_n, mask_pn, state_off, pn_off


@jit
def _head_params(a_ptr, d_ptr, head, HAS_D: tl.constexpr):
    """``(decay_rate, skip)``: ``A[head]`` and ``D[head]`` (0 without ``D``) in float32."""
    decay_rate = tl.load(a_ptr + head).to(tl.float32)
    skip = 0.0
    if HAS_D:
        skip = tl.load(d_ptr + head).to(tl.float32)
    return decay_rate, skip


@jit
def _load_state_tile(
    ptr, offsets, mask, LOAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr
):
    """A float32 ``[BLOCK_P, BLOCK_N]`` state tile: loaded when ``LOAD``, else zeros."""
    if LOAD:
        tile = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    else:
        tile = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    return tile


@jit
def _load_chunk(inputs, sizes, tile, c0, end, CHUNK: tl.constexpr):
    """Loads the chunk of tokens ``[c0, min(c0 + CHUNK, end))`` in float32.

    ``inputs`` is ``(x_ptr, dt_ptr, b_ptr, c_ptr)``, ``sizes`` is ``(heads, head_dim,
    state_size, groups)`` and ``tile`` is ``(head, group, offs_p, offs_n, decay_rate)``.
    Returns ``(rows, mask_l, x_off, mask_lp, mask_ln, x, dt, b, c, a, is_last, a_last)``:
    token indices and masks, the offsets of ``x`` (also those of ``y`` and ``dy``), the
    loaded ``x``, ``dt``, ``B``, ``C``, the running sum ``a`` of ``dt * A``, the mask of the
    chunk's last token and ``a`` there.
    """
    x_ptr, dt_ptr, b_ptr, c_ptr = inputs
    heads, head_dim, state_size, groups = sizes
    head, group, offs_p, offs_n, decay_rate = tile
    rows = c0 + tl.arange(0, CHUNK)
    mask_l = rows < end
    x_off = (rows[:, None] * heads + head) * head_dim + offs_p[None, :]
    mask_lp = mask_l[:, None] & (offs_p < head_dim)[None, :]
    x = tl.load(x_ptr + x_off, mask=mask_lp, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + rows * heads + head, mask=mask_l, other=0.0).to(tl.float32)
    bc_off = (rows[:, None] * groups + group) * state_size + offs_n[None, :]
    mask_ln = mask_l[:, None] & (offs_n < state_size)[None, :]
    b = tl.load(b_ptr + bc_off, mask=mask_ln, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + bc_off, mask=mask_ln, other=0.0).to(tl.float32)
    a = tl.cumsum(dt * decay_rate, axis=0)
    is_last = rows == tl.minimum(end, c0 + CHUNK) - 1
    a_last = tl.sum(tl.where(is_last, a, 0.0), axis=0)
    return rows, mask_l, x_off, mask_lp, mask_ln, x, dt, b, c, a, is_last, a_last


@jit
def ssd_fwd_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    y_ptr,
    init_ptr,
    final_ptr,
    chunk_states_ptr,
    cu_ptr,
    chunk_offsets_ptr,
    heads,
    head_dim,
    state_size,
    groups,
    HEADS_PER_GROUP: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_INIT: tl.constexpr,
    STORE_CHUNK_STATES: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Forward of one (sequence, head, head-dim block): outputs and chunk-start states."""
    seq, head, p_block, group, start, end = _program_ids(cu_ptr, HEADS_PER_GROUP)
    offs_p, offs_n, mask_pn, state_off, pn_off = _state_tile(
        seq, head, p_block, heads, head_dim, state_size, BLOCK_P, BLOCK_N
    )
    decay_rate, skip = _head_params(a_ptr, d_ptr, head, HAS_D)
    state = _load_state_tile(init_ptr + state_off, pn_off, mask_pn, HAS_INIT, BLOCK_P, BLOCK_N)
    inputs = (x_ptr, dt_ptr, b_ptr, c_ptr)
    sizes = (heads, head_dim, state_size, groups)
    tile = (head, group, offs_p, offs_n, decay_rate)
    offs_l = tl.arange(0, CHUNK)
    chunk_base = 0
    if STORE_CHUNK_STATES:
        chunk_base = tl.load(chunk_offsets_ptr + seq).to(tl.int64)
    num_chunks = tl.cdiv(end - start, CHUNK)
    causal = offs_l[:, None] >= offs_l[None, :]
    for ci in range(0, num_chunks):
        if STORE_CHUNK_STATES:
            cs_off = ((chunk_base + ci) * heads + head) * head_dim * state_size
            tl.store(chunk_states_ptr + cs_off + pn_off, state, mask=mask_pn)
        _rows, mask_l, x_off, mask_lp, _mask_ln, x, dt, b, c, a, _is_last, a_last = _load_chunk(
            inputs, sizes, tile, start + ci * CHUNK, end, CHUNK
        )
        xdt = x * dt[:, None]
        scores = tl.dot(c, tl.trans(b), input_precision="ieee")
        diff = tl.where(causal, a[:, None] - a[None, :], 0.0)
        weights = tl.where(causal, scores * tl.exp(diff), 0.0)
        y = tl.dot(weights, xdt, input_precision="ieee")
        y += tl.exp(a)[:, None] * tl.dot(c, tl.trans(state), input_precision="ieee")
        if HAS_D:
            y += skip * x
        tl.store(y_ptr + x_off, y, mask=mask_lp)
        decay = tl.where(mask_l, tl.exp(a_last - a), 0.0)
        state = tl.exp(a_last) * state + tl.dot(
            tl.trans(xdt * decay[:, None]), b, input_precision="ieee"
        )
    tl.store(final_ptr + state_off + pn_off, state, mask=mask_pn)


@jit
def ssd_bwd_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    dy_ptr,
    dfinal_ptr,
    chunk_states_ptr,
    cu_ptr,
    chunk_offsets_ptr,
    dx_ptr,
    ddt_ptr,
    db_ptr,
    dc_ptr,
    da_ptr,
    dd_ptr,
    dinit_ptr,
    num_tokens,
    num_seqs,
    heads,
    head_dim,
    state_size,
    groups,
    HEADS_PER_GROUP: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_DFINAL: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Backward of one (sequence, head, head-dim block), chunks in reverse order."""
    seq, head, p_block, group, start, end = _program_ids(cu_ptr, HEADS_PER_GROUP)
    offs_p, offs_n, mask_pn, state_off, pn_off = _state_tile(
        seq, head, p_block, heads, head_dim, state_size, BLOCK_P, BLOCK_N
    )
    decay_rate, skip = _head_params(a_ptr, d_ptr, head, HAS_D)
    dstate = _load_state_tile(dfinal_ptr + state_off, pn_off, mask_pn, HAS_DFINAL, BLOCK_P, BLOCK_N)
    inputs = (x_ptr, dt_ptr, b_ptr, c_ptr)
    sizes = (heads, head_dim, state_size, groups)
    tile = (head, group, offs_p, offs_n, decay_rate)
    offs_l = tl.arange(0, CHUNK)
    chunk_base = tl.load(chunk_offsets_ptr + seq).to(tl.int64)
    num_chunks = tl.cdiv(end - start, CHUNK)
    causal = offs_l[:, None] >= offs_l[None, :]
    da_total = 0.0
    dd_total = 0.0
    for k in range(0, num_chunks):
        ci = num_chunks - 1 - k
        cs_off = ((chunk_base + ci) * heads + head) * head_dim * state_size
        s0 = tl.load(chunk_states_ptr + cs_off + pn_off, mask=mask_pn, other=0.0)
        rows, mask_l, x_off, mask_lp, mask_ln, x, dt, b, c, a, is_last, a_last = _load_chunk(
            inputs, sizes, tile, start + ci * CHUNK, end, CHUNK
        )
        dy = tl.load(dy_ptr + x_off, mask=mask_lp, other=0.0).to(tl.float32)
        xdt = x * dt[:, None]
        scores = tl.dot(c, tl.trans(b), input_precision="ieee")
        diff = tl.where(causal, a[:, None] - a[None, :], 0.0)
        mask_w = tl.where(causal, tl.exp(diff), 0.0)
        weights = scores * mask_w
        # Skip connection.
        dx = skip * dy
        if HAS_D:
            dd_total += tl.sum(tl.sum(dy * x, axis=1), axis=0)
        # Intra-chunk quadratic form.
        dweights = tl.dot(dy, tl.trans(xdt), input_precision="ieee")
        dxdt = tl.dot(tl.trans(weights), dy, input_precision="ieee")
        dscores = dweights * mask_w
        dc = tl.dot(dscores, b, input_precision="ieee")
        db = tl.dot(tl.trans(dscores), c, input_precision="ieee")
        q = dweights * weights
        da = tl.sum(q, axis=1) - tl.sum(q, axis=0)
        # Contribution of the state carried into the chunk.
        ea = tl.where(mask_l, tl.exp(a), 0.0)
        dc += ea[:, None] * tl.dot(dy, s0, input_precision="ieee")
        y_off = ea[:, None] * tl.dot(c, tl.trans(s0), input_precision="ieee")
        da += tl.sum(dy * y_off, axis=1)
        ds0 = tl.dot(tl.trans(dy * ea[:, None]), c, input_precision="ieee")
        # State passed to the next chunk.
        decay = tl.where(mask_l, tl.exp(a_last - a), 0.0)
        e_last = tl.exp(a_last)
        dsb = tl.dot(b, tl.trans(dstate), input_precision="ieee")
        dxdt += decay[:, None] * dsb
        db += decay[:, None] * tl.dot(xdt, dstate, input_precision="ieee")
        contrib = decay * tl.sum(xdt * dsb, axis=1)
        da_last = tl.sum(contrib, axis=0) + e_last * tl.sum(tl.sum(dstate * s0, axis=1), axis=0)
        da = da - contrib + tl.where(is_last, da_last, 0.0)
        ds0 += e_last * dstate
        # a = cumsum(dt * A): the gradient of each increment sums da over the later tokens.
        da = tl.where(mask_l, da, 0.0)
        grad_inc = tl.sum(da, axis=0) - tl.cumsum(da, axis=0) + da
        ddt = grad_inc * decay_rate + tl.sum(dxdt * x, axis=1)
        da_total += tl.sum(grad_inc * dt, axis=0)
        dx += dxdt * dt[:, None]
        tl.store(dx_ptr + x_off, dx, mask=mask_lp)
        part = p_block * num_tokens
        tl.store(ddt_ptr + (part + rows) * heads + head, ddt, mask=mask_l)
        bh_off = ((part + rows[:, None]) * heads + head) * state_size + offs_n[None, :]
        tl.store(db_ptr + bh_off, db, mask=mask_ln)
        tl.store(dc_ptr + bh_off, dc, mask=mask_ln)
        dstate = ds0
    tl.store(dinit_ptr + state_off + pn_off, dstate, mask=mask_pn)
    part_seq = p_block * num_seqs + seq
    tl.store(da_ptr + part_seq * heads + head, da_total)
    tl.store(dd_ptr + part_seq * heads + head, dd_total)


# --- launchers, autograd, custom ops, API --------------------------------------------------------


def _blocks(head_dim: int, state_size: int) -> tuple[int, int, int]:
    """``(BLOCK_P, BLOCK_N, number of head-dim blocks)``.

    The state's rows evolve independently (``x`` enters row ``p`` only), so the head
    dimension is split over programs (32 rows each from 32 up) for more parallelism at the
    cost of recomputing the chunk's ``C B^T`` in each.
    """
    block_p = 32 if head_dim >= 32 else 16
    return block_p, max(16, next_power_of_2(state_size)), -(-head_dim // block_p)


def _launch_options(block_p: int, block_n: int) -> dict[str, int]:
    # Chunks are walked one after the other: no software pipelining, more warps for big states.
    return {"num_warps": 8 if block_p * block_n >= 4096 else 4, "num_stages": 1}


def _chunk_bound(tokens: int, num_seqs: int, chunk_size: int) -> int:
    """Chunks of ``num_seqs`` sequences of ``tokens`` in all, at most (no host sync)."""
    return -(-tokens // chunk_size) + num_seqs


def _chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    counts = (lengths + chunk_size - 1) // chunk_size
    offsets = torch.zeros_like(cu_seqlens)
    torch.cumsum(counts, 0, out=offsets[1:])
    return offsets


def _forward(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    chunk_size: int,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None,
    save_chunk_states: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    heads, head_dim = x.shape[1], x.shape[2]
    groups, state_size = B.shape[1], B.shape[2]
    num_seqs = cu_seqlens.numel() - 1
    y = torch.empty_like(x)
    final = torch.empty((num_seqs, heads, head_dim, state_size), device=x.device)
    offsets: torch.Tensor | None = None
    chunk_states: torch.Tensor | None = None
    if save_chunk_states:
        # Room for the most chunks the sequences can have: the exact count would need a host
        # sync, and the custom op's fake implementation needs a shape known from the inputs'.
        offsets = _chunk_offsets(cu_seqlens, chunk_size)
        total = _chunk_bound(x.shape[0], num_seqs, chunk_size)
        chunk_states = torch.empty((total, heads, head_dim, state_size), device=x.device)
    block_p, block_n, p_blocks = _blocks(head_dim, state_size)
    with on_device_of(x):
        ssd_fwd_kernel[(num_seqs, heads, p_blocks)](
            x,
            dt,
            A,
            B,
            C,
            D if D is not None else A,
            y,
            initial_states if initial_states is not None else final,
            final,
            chunk_states if chunk_states is not None else final,
            cu_seqlens,
            offsets if offsets is not None else cu_seqlens,
            heads,
            head_dim,
            state_size,
            groups,
            HEADS_PER_GROUP=heads // groups,
            HAS_D=D is not None,
            HAS_INIT=initial_states is not None,
            STORE_CHUNK_STATES=save_chunk_states,
            CHUNK=chunk_size,
            BLOCK_P=block_p,
            BLOCK_N=block_n,
            **_launch_options(block_p, block_n),
        )
    return y, final, chunk_states, offsets


class _SSDScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor | None,
        initial_states: torch.Tensor | None,
        cu_seqlens: torch.Tensor,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y, final, chunk_states, offsets = _forward(
            x, dt, A, B, C, D, chunk_size, cu_seqlens, initial_states, save_chunk_states=True
        )
        ctx.save_for_backward(x, dt, A, B, C, D, cu_seqlens, chunk_states, offsets)
        ctx.chunk_size = chunk_size
        ctx.has_init = initial_states is not None
        ctx.init_dtype = initial_states.dtype if initial_states is not None else None
        return y, final

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, dfinal: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        x, dt, A, B, C, D, cu_seqlens, chunk_states, offsets = ctx.saved_tensors
        grads = _backward(
            dy, dfinal, x, dt, A, B, C, D, cu_seqlens, chunk_states, offsets, ctx.chunk_size
        )
        grad_init = grads[6].to(ctx.init_dtype) if ctx.has_init else None
        return (*grads[:6], grad_init, None, None)


def _backward(
    dy: torch.Tensor,
    dfinal: torch.Tensor | None,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    chunk_states: torch.Tensor,
    offsets: torch.Tensor,
    chunk_size: int,
) -> tuple[Any, ...]:
    """Launch the backward: gradients of ``x, dt, A, B, C, D`` (None without ``D``) and the
    float32 gradient of the initial states."""
    tokens, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    num_seqs = cu_seqlens.numel() - 1
    dx = torch.empty_like(x, dtype=torch.float32)
    block_p, block_n, p_blocks = _blocks(head_dim, state_size)
    # Per head-dim block partial gradients, summed below.
    ddt = torch.empty((p_blocks, tokens, heads), device=x.device)
    db = torch.empty((p_blocks, tokens, heads, state_size), device=x.device)
    dc = torch.empty_like(db)
    da = torch.empty((p_blocks, num_seqs, heads), device=x.device)
    dd = torch.empty_like(da)
    dinit = torch.empty((num_seqs, heads, head_dim, state_size), device=x.device)
    with on_device_of(x):
        ssd_bwd_kernel[(num_seqs, heads, p_blocks)](
            x,
            dt,
            A,
            B,
            C,
            D if D is not None else A,
            dy.contiguous(),
            dfinal.contiguous() if dfinal is not None else dinit,
            chunk_states,
            cu_seqlens,
            offsets,
            dx,
            ddt,
            db,
            dc,
            da,
            dd,
            dinit,
            tokens,
            num_seqs,
            heads,
            head_dim,
            state_size,
            groups,
            HEADS_PER_GROUP=heads // groups,
            HAS_D=D is not None,
            HAS_DFINAL=dfinal is not None,
            CHUNK=chunk_size,
            BLOCK_P=block_p,
            BLOCK_N=block_n,
            **_launch_options(block_p, block_n),
        )
    per_group = (p_blocks, tokens, groups, heads // groups, state_size)
    return (
        dx.to(x.dtype),
        ddt.sum(0).to(dt.dtype),
        da.sum((0, 1)).to(A.dtype),
        db.view(per_group).sum((0, 3)).to(B.dtype),
        dc.view(per_group).sum((0, 3)).to(C.dtype),
        dd.sum((0, 1)).to(D.dtype) if D is not None else None,
        dinit,
    )


def _kernel_inputs(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_states: torch.Tensor | None,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None
]:
    """The layouts the kernels take (contiguous, float32 decay rates)."""
    init = initial_states.contiguous() if initial_states is not None else None
    return (
        x.contiguous(),
        dt.contiguous(),
        A.contiguous().float(),
        B.contiguous(),
        C.contiguous(),
        init,
    )


def ssd_scan_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan on the Triton kernels (same contract as :func:`ssd_scan`).

    Without autograd (inference) the forward saves no chunk states and does no host
    synchronisation, so it can be captured in a CUDA graph.

    Args:
        x: ``[T, H, P]`` inputs.
        dt: ``[T, H]`` time steps.
        A: ``[H]`` decay rates.
        B: ``[T, G, N]`` input projections.
        C: ``[T, G, N]`` output projections.
        D: ``[H]`` skip weights or None.
        chunk_size: Tokens per chunk (power of two >= 16).
        cu_seqlens: ``[S + 1]`` sequence starts (int32 or int64; default one sequence).
        initial_states: ``[S, H, P, N]`` or None.

    Returns:
        ``(y, final_states)``.
    """
    if cu_seqlens is None:
        cu_seqlens = default_cu_seqlens(x.shape[0], x.device)
    check_scan_args(x, dt, A, B, C, D, chunk_size, cu_seqlens, initial_states)
    chunk_size = min(chunk_size, MAX_KERNEL_CHUNK)
    x, dt, A, B, C, initial_states = _kernel_inputs(x, dt, A, B, C, initial_states)
    tensors = [t for t in (x, dt, A, B, C, D, initial_states) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        result = _SSDScanFunction.apply(
            x, dt, A, B, C, D, initial_states, cu_seqlens.contiguous(), chunk_size
        )
        return result[0], result[1]
    y, final, _, _ = _forward(
        x, dt, A, B, C, D, chunk_size, cu_seqlens, initial_states, save_chunk_states=False
    )
    return y, final


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2 chunked scan over packed sequences, dispatched to Triton or torch.

    Args:
        x: ``[T, H, P]`` inputs of all packed tokens.
        dt: ``[T, H]`` positive time steps (after bias, softplus and clamping).
        A: ``[H]`` decay rates (negative).
        B: ``[T, G, N]`` input projections (``G`` groups shared by ``H / G`` heads each).
        C: ``[T, G, N]`` output projections.
        D: ``[H]`` skip weights, or None.
        chunk_size: Tokens per chunk (a power of two >= 16).
        cu_seqlens: ``[S + 1]`` start offsets of the packed sequences; the state restarts at
            each (default: one sequence).
        initial_states: ``[S, H, P, N]`` state before each sequence (default zeros).

    Returns:
        ``(y, final_states)``: ``y`` ``[T, H, P]`` in ``x.dtype`` and float32
        ``[S, H, P, N]`` states after each sequence. Differentiable in all tensor inputs.

    Raises:
        KernelShapeError: A shape does not match the layout.
        KernelValueError: ``chunk_size`` or the head/group split is invalid.
        KernelBackendError: ``MCORE_KERNELS_BACKEND`` asks for a backend that cannot run.

    Under ``torch.compile`` the call is the opaque custom op
    ``torch.ops.mcore_kernels.ssd_scan_fwd`` (with a registered backward).
    """
    if _compile.compiling():
        if cu_seqlens is None:
            cu_seqlens = default_cu_seqlens(x.shape[0], x.device)
        check_scan_args(x, dt, A, B, C, D, chunk_size, cu_seqlens, initial_states)
        y, final, _, _ = _ssd_scan_fwd_op(x, dt, A, B, C, D, initial_states, cu_seqlens, chunk_size)
        return y, final
    scan = ssd_scan_triton if use_triton(x) else ssd_scan_reference
    return scan(
        x,
        dt,
        A,
        B,
        C,
        D,
        chunk_size=chunk_size,
        cu_seqlens=cu_seqlens,
        initial_states=initial_states,
    )


# --- torch.compile: the custom ops -----------------------------------------------------------


@_compile.custom_op(
    "ssd_scan_fwd",
    "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? initial_states, "
    "Tensor cu_seqlens, int chunk_size) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _ssd_scan_fwd_op(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(x):
        kx, kdt, kA, kB, kC, init = _kernel_inputs(x, dt, A, B, C, initial_states)
        chunk, cu = min(chunk_size, MAX_KERNEL_CHUNK), cu_seqlens.contiguous()
        y, final, states, offsets = _forward(
            kx, kdt, kA, kB, kC, D, chunk, cu, init, save_chunk_states=True
        )
        assert states is not None and offsets is not None
        return y, final, states, offsets
    y, final = ssd_scan_reference(
        x,
        dt,
        A,
        B,
        C,
        D,
        chunk_size=chunk_size,
        cu_seqlens=cu_seqlens,
        initial_states=initial_states,
    )
    # Shapes as on the Triton path (the fake implementation cannot know which backend runs);
    # the torch backward differentiates the reference and reads neither.
    tokens, heads, head_dim = x.shape
    num_seqs = cu_seqlens.shape[0] - 1
    chunks = _chunk_bound(tokens, num_seqs, min(chunk_size, MAX_KERNEL_CHUNK))
    states = x.new_zeros((chunks, heads, head_dim, B.shape[2]), dtype=torch.float32)
    return y, final, states, torch.zeros_like(cu_seqlens)


@_ssd_scan_fwd_op.register_fake
def _ssd_scan_fwd_fake(x, dt, A, B, C, D, initial_states, cu_seqlens, chunk_size):
    tokens, heads, head_dim = x.shape
    num_seqs, state_size = cu_seqlens.shape[0] - 1, B.shape[2]
    chunks = _chunk_bound(tokens, num_seqs, min(chunk_size, MAX_KERNEL_CHUNK))
    return (
        x.new_empty(x.shape),
        x.new_empty((num_seqs, heads, head_dim, state_size), dtype=torch.float32),
        x.new_empty((chunks, heads, head_dim, state_size), dtype=torch.float32),
        cu_seqlens.new_empty(cu_seqlens.shape),
    )


@_compile.custom_op(
    "ssd_scan_bwd",
    "(Tensor dy, Tensor? dfinal, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, "
    "Tensor? initial_states, Tensor cu_seqlens, Tensor chunk_states, Tensor offsets, "
    "int chunk_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _ssd_scan_bwd_op(
    dy: torch.Tensor,
    dfinal: torch.Tensor | None,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    chunk_states: torch.Tensor,
    offsets: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, ...]:
    """Gradients of ``x, dt, A, B, C, D, initial_states`` (empty stand-ins for absent ones)."""
    empty = x.new_empty(0)
    if use_triton(x):
        kx, kdt, kA, kB, kC, _ = _kernel_inputs(x, dt, A, B, C, None)
        chunk, cu = min(chunk_size, MAX_KERNEL_CHUNK), cu_seqlens.contiguous()
        dx, ddt, da, db, dc, dd, dinit = _backward(
            dy, dfinal, kx, kdt, kA, kB, kC, D, cu, chunk_states, offsets, chunk
        )
        da = da.to(A.dtype)
        dinit = dinit.to(initial_states.dtype) if initial_states is not None else empty
        return dx, ddt, da, db, dc, dd if dd is not None else empty.clone(), dinit
    # The torch dispatch differentiates the one reference instead of a second formula.
    with _compile.autograd_inside_op():
        inputs = [t.detach().requires_grad_() for t in (x, dt, A, B, C)]
        optional = [
            t.detach().requires_grad_() if t is not None else None for t in (D, initial_states)
        ]
        y, final = ssd_scan_reference(
            inputs[0],
            inputs[1],
            inputs[2],
            inputs[3],
            inputs[4],
            optional[0],
            chunk_size=chunk_size,
            cu_seqlens=cu_seqlens,
            initial_states=optional[1],
        )
        leaves = inputs + [t for t in optional if t is not None]
        outputs, grads_out = [y], [dy]
        if dfinal is not None:
            outputs.append(final)
            grads_out.append(dfinal)
        found = list(torch.autograd.grad(outputs, leaves, grads_out, allow_unused=True))
    found = [
        g if g is not None else torch.zeros_like(t) for g, t in zip(found, leaves, strict=True)
    ]
    result = found[:5]
    rest = iter(found[5:])
    for t in (D, initial_states):
        result.append(next(rest) if t is not None else empty.clone())
    return tuple(result)


@_ssd_scan_bwd_op.register_fake
def _ssd_scan_bwd_fake(dy, dfinal, x, dt, A, B, C, D, initial_states, *args):
    def like(t):
        return t.new_empty(t.shape) if t is not None else x.new_empty(0)

    return like(x), like(dt), like(A), like(B), like(C), like(D), like(initial_states)


def _setup_context(ctx, inputs, output):
    x, dt, A, B, C, D, initial_states, cu_seqlens, chunk_size = inputs
    _, _, chunk_states, offsets = output
    ctx.save_for_backward(x, dt, A, B, C, D, initial_states, cu_seqlens, chunk_states, offsets)
    ctx.chunk_size = chunk_size
    ctx.has_d = D is not None
    ctx.has_init = initial_states is not None


def _op_backward(ctx, dy, dfinal, _dstates, _doffsets):
    x, dt, A, B, C, D, initial_states, cu_seqlens, chunk_states, offsets = ctx.saved_tensors
    grads = _ssd_scan_bwd_op(
        dy,
        dfinal,
        x,
        dt,
        A,
        B,
        C,
        D,
        initial_states,
        cu_seqlens,
        chunk_states,
        offsets,
        ctx.chunk_size,
    )
    dd = grads[5] if ctx.has_d else None
    dinit = grads[6] if ctx.has_init else None
    return (*grads[:5], dd, dinit, None, None)


_ssd_scan_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)
