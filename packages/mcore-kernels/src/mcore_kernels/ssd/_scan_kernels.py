"""Triton kernels of the Mamba-2 chunked scan (forward and backward); see :mod:`.scan`."""

from __future__ import annotations

from mcore_kernels._triton_utils import jit, tl

__all__ = ["ssd_bwd_kernel", "ssd_fwd_kernel"]


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
