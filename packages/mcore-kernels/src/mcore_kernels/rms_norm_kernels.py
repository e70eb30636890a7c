"""Triton kernels of the fused residual add + RMSNorm (forward, backward, partial sums).

The launchers are in :mod:`mcore_kernels.rms_norm_launch`, the public API in
:mod:`mcore_kernels.rms_norm`.
"""

from __future__ import annotations

from mcore_kernels._triton_utils import gdc_launch_dependents, gdc_wait, jit, round_to, tl


@jit
def _load(pointers, mask, EVEN: tl.constexpr, HINT: tl.constexpr):
    # Masked unless the block is known to be in bounds; HINT 0: no eviction hint, 1: evict
    # first, 2: evict last.
    if EVEN:
        if HINT == 1:
            value = tl.load(pointers, eviction_policy="evict_first")
        elif HINT == 2:
            value = tl.load(pointers, eviction_policy="evict_last")
        else:
            value = tl.load(pointers)
    else:
        if HINT == 1:
            value = tl.load(pointers, mask=mask, other=0.0, eviction_policy="evict_first")
        elif HINT == 2:
            value = tl.load(pointers, mask=mask, other=0.0, eviction_policy="evict_last")
        else:
            value = tl.load(pointers, mask=mask, other=0.0)
    return value


@jit
def _store(pointers, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(pointers, value)
    else:
        tl.store(pointers, value, mask=mask)


# The row count (an inference step's token count) is not specialised: its `== 1` and
# `% 16` classes would compile a kernel per class in the request path, and the row mask
# (or EVEN) does not use them.
@jit(do_not_specialize=["rows"])
def _rms_norm_fwd_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    y_ptr,
    hidden_out_ptr,
    rstd_ptr,
    rows,
    x_row_stride,
    residual_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    STORE_RSTD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    EVEN: tl.constexpr,
    WIDE: tl.constexpr,
    ROW_HINT: tl.constexpr,
    WEIGHT_HINT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        # Programmatic dependent launch: the next kernel may start; the previous one's outputs
        # are read (and ours written) only after gdc_wait (the weight is not such an output).
        gdc_launch_dependents()
    # 32-bit offsets unless the tensors hold 2**31 elements or more (fewer integer operations
    # on the path to each load).
    if WIDE:
        first = tl.program_id(0).to(tl.int64) * BLOCK_M
    else:
        first = tl.program_id(0) * BLOCK_M
    cols = tl.arange(0, BLOCK)
    if SINGLE_BLOCK:
        row_ids = first + tl.arange(0, BLOCK_M)
        row_mask = row_ids < rows
        col_mask = cols < hidden
        mask = row_mask[:, None] & col_mask[None, :]
        # Every load is issued before the first reduction: loads placed after it would wait
        # for the reduction's barrier and add a memory round trip to each program. Small calls
        # stream their rows through L2 (evict first) and keep the weight (evict last).
        w = _load(weight_ptr + cols, col_mask, EVEN, WEIGHT_HINT)
        if USE_PDL:
            gdc_wait()
        x = _load(
            x_ptr + row_ids[:, None] * x_row_stride + cols[None, :],
            mask,
            EVEN,
            ROW_HINT,
        )
        w = w.to(tl.float32)
        if HAS_RESIDUAL:
            r = _load(
                residual_ptr + row_ids[:, None] * residual_row_stride + cols[None, :],
                mask,
                EVEN,
                ROW_HINT,
            )
            # Rounded to the input dtype before normalising, as Hugging Face models do.
            x = round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype)
            _store(hidden_out_ptr + row_ids[:, None] * hidden + cols[None, :], x, mask, EVEN)
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / hidden + eps)
        y = round_to(h * rstd[:, None] * w[None, :], y_ptr.dtype.element_ty)
        _store(y_ptr + row_ids[:, None] * hidden + cols[None, :], y, mask, EVEN)
        if STORE_RSTD:
            tl.store(rstd_ptr + row_ids, rstd, mask=row_mask)
    else:
        if USE_PDL:
            gdc_wait()
        x_row = x_ptr + first * x_row_stride
        r_row = residual_ptr + first * residual_row_stride
        h_row = hidden_out_ptr + first * hidden
        y_row = y_ptr + first * hidden
        sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            mask = offs < hidden
            x = tl.load(x_row + offs, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_row + offs, mask=mask, other=0.0)
                x = round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype)
                tl.store(h_row + offs, x, mask=mask)
            h = x.to(tl.float32)
            sum_sq += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / hidden + eps)
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            mask = offs < hidden
            if HAS_RESIDUAL:
                h = tl.load(h_row + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + offs, round_to(h * rstd * w, y_ptr.dtype.element_ty), mask=mask)
        if STORE_RSTD:
            tl.store(rstd_ptr + first, rstd)


@jit
def _rms_norm_fwd_exact_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    y_ptr,
    hidden_out_ptr,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    WIDE: tl.constexpr,
    ROW_HINT: tl.constexpr,
    WEIGHT_HINT: tl.constexpr,
):
    # The forward of contiguous rows exactly BLOCK wide in whole row blocks: no masks, no row
    # count, the row stride is the constexpr width. The arithmetic is the general kernel's
    # single-block path (same reduction layout for the same BLOCK_M, BLOCK and warps; the
    # mean divides by the same power of two), so its outputs are bitwise the same.
    if WIDE:
        first = tl.program_id(0).to(tl.int64) * BLOCK_M
    else:
        first = tl.program_id(0) * BLOCK_M
    cols = tl.arange(0, BLOCK)
    offs = (first + tl.arange(0, BLOCK_M))[:, None] * BLOCK + cols[None, :]
    w = _load(weight_ptr + cols, None, True, WEIGHT_HINT)
    x = _load(x_ptr + offs, None, True, ROW_HINT)
    w = w.to(tl.float32)
    if HAS_RESIDUAL:
        r = _load(residual_ptr + offs, None, True, ROW_HINT)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype)
        tl.store(hidden_out_ptr + offs, x)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / BLOCK + eps)
    tl.store(y_ptr + offs, round_to(h * rstd[:, None] * w[None, :], y_ptr.dtype.element_ty))


@jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@jit
def _backward_rows(
    dy_ptr,
    dhidden_out_ptr,
    hidden_ptr,
    dx_ptr,
    w,
    row_ids,
    rows,
    hidden_row_stride,
    hidden,
    eps,
    HAS_DHIDDEN_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Writes d(x) of a block of rows and returns their weight-gradient terms dy * normed.
    cols = tl.arange(0, BLOCK)
    row_mask = row_ids < rows
    mask = row_mask[:, None] & (cols < hidden)[None, :]
    offs = row_ids[:, None] * hidden + cols[None, :]
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(
        hidden_ptr + row_ids[:, None] * hidden_row_stride + cols[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    if HAS_DHIDDEN_OUT:
        # Loaded before the reductions, as in the forward.
        dh = tl.load(dhidden_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # The row is in registers: recomputing its rstd costs no memory traffic. Both row sums come
    # from one reduction (sum(dy * w * normed) = rstd * sum(dy * w * h)): a single pass through
    # shared memory and one barrier instead of two in a row.
    dyw = dy * w[None, :]
    sum_sq, sum_dyw_h = tl.reduce((h * h, dyw * h), axis=1, combine_fn=_add_pairs)
    rstd = 1.0 / tl.sqrt(sum_sq / hidden + eps)
    normed = h * rstd[:, None]
    correction = rstd * sum_dyw_h / hidden
    dx = rstd[:, None] * (dyw - normed * correction[:, None])
    if HAS_DHIDDEN_OUT:
        dx += dh
    tl.store(dx_ptr + offs, round_to(dx, dx_ptr.dtype.element_ty), mask=mask)
    return dy * normed


@jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    dhidden_out_ptr,
    hidden_ptr,
    weight_ptr,
    rstd_ptr,
    dx_ptr,
    dweight_ptr,
    rows,
    hidden_row_stride,
    hidden,
    eps,
    HAS_DHIDDEN_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    FINAL: tl.constexpr,
):
    # Program p handles row blocks p, p + P, p + 2P ... and owns row p of the partials.
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    program64 = program.to(tl.int64)
    out_row = dweight_ptr + program64 * hidden
    cols = tl.arange(0, BLOCK)
    if SINGLE_BLOCK:
        col_mask = cols < hidden
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if FINAL:
            # The whole call is one row block: straight-line code, no loop to set up.
            contribution = _backward_rows(
                dy_ptr,
                dhidden_out_ptr,
                hidden_ptr,
                dx_ptr,
                w,
                tl.arange(0, BLOCK_M).to(tl.int64),
                rows,
                hidden_row_stride,
                hidden,
                eps,
                HAS_DHIDDEN_OUT,
                BLOCK,
            )
            total = tl.sum(contribution, axis=0)
            tl.store(out_row + cols, round_to(total, dweight_ptr.dtype.element_ty), mask=col_mask)
        else:
            # Every program has at least one row block: the grid never exceeds their number.
            iterations = tl.cdiv(tl.cdiv(rows, BLOCK_M) - program, programs)
            dw = tl.zeros([BLOCK_M, BLOCK], dtype=tl.float32)
            # Pipelining keeps the next row blocks' loads in flight while this one is reduced.
            # (The body is _backward_rows written out: Triton 3.6 pipelines this loop as is.)
            for i in tl.range(0, iterations, num_stages=NUM_STAGES):
                row_ids = (program64 + i * programs) * BLOCK_M + tl.arange(0, BLOCK_M)
                row_mask = row_ids < rows
                mask = row_mask[:, None] & col_mask[None, :]
                offs = row_ids[:, None] * hidden + cols[None, :]
                dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                h = tl.load(
                    hidden_ptr + row_ids[:, None] * hidden_row_stride + cols[None, :],
                    mask=mask,
                    other=0.0,
                ).to(tl.float32)
                if HAS_DHIDDEN_OUT:
                    dh = tl.load(dhidden_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                dyw = dy * w[None, :]
                sum_sq, sum_dyw_h = tl.reduce((h * h, dyw * h), axis=1, combine_fn=_add_pairs)
                rstd = 1.0 / tl.sqrt(sum_sq / hidden + eps)
                normed = h * rstd[:, None]
                correction = rstd * sum_dyw_h / hidden
                dx = rstd[:, None] * (dyw - normed * correction[:, None])
                if HAS_DHIDDEN_OUT:
                    dx += dh
                tl.store(dx_ptr + offs, round_to(dx, dx_ptr.dtype.element_ty), mask=mask)
                dw += dy * normed
            tl.store(out_row + cols, tl.sum(dw, axis=0), mask=col_mask)
    else:
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            tl.store(out_row + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < hidden)
        for i in range(0, tl.cdiv(rows - program, programs)):
            row64 = program64 + i * programs
            rstd = tl.load(rstd_ptr + row64)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, hidden, BLOCK):
                offs = start + cols
                mask = offs < hidden
                dy = tl.load(dy_ptr + row64 * hidden + offs, mask=mask, other=0.0).to(tl.float32)
                h = tl.load(hidden_ptr + row64 * hidden_row_stride + offs, mask=mask, other=0.0)
                w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                acc += dy * w * h.to(tl.float32) * rstd
            correction = tl.sum(acc, axis=0) / hidden
            for start in range(0, hidden, BLOCK):
                offs = start + cols
                mask = offs < hidden
                dy = tl.load(dy_ptr + row64 * hidden + offs, mask=mask, other=0.0).to(tl.float32)
                h = tl.load(hidden_ptr + row64 * hidden_row_stride + offs, mask=mask, other=0.0)
                w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                normed = h.to(tl.float32) * rstd
                dx = rstd * (dy * w - normed * correction)
                if HAS_DHIDDEN_OUT:
                    dh = tl.load(dhidden_out_ptr + row64 * hidden + offs, mask=mask, other=0.0)
                    dx += dh.to(tl.float32)
                dx_out = round_to(dx, dx_ptr.dtype.element_ty)
                tl.store(dx_ptr + row64 * hidden + offs, dx_out, mask=mask)
                dw = tl.load(out_row + offs, mask=mask, other=0.0)
                tl.store(out_row + offs, dw + dy * normed, mask=mask)


@jit
def _rms_norm_bwd_exact_kernel(
    dy_ptr,
    dhidden_out_ptr,
    hidden_ptr,
    weight_ptr,
    dx_ptr,
    dweight_ptr,
    eps,
    HAS_DHIDDEN_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # The backward of a call that is one row block of contiguous rows exactly BLOCK wide (one
    # program, which writes the weight gradient directly): no masks, no row count or strides.
    # The arithmetic is the general kernel's one-program path, so the bits are the same.
    cols = tl.arange(0, BLOCK)
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK + cols[None, :]
    w = tl.load(weight_ptr + cols).to(tl.float32)
    dy = tl.load(dy_ptr + offs).to(tl.float32)
    h = tl.load(hidden_ptr + offs).to(tl.float32)
    if HAS_DHIDDEN_OUT:
        dh = tl.load(dhidden_out_ptr + offs).to(tl.float32)
    dyw = dy * w[None, :]
    sum_sq, sum_dyw_h = tl.reduce((h * h, dyw * h), axis=1, combine_fn=_add_pairs)
    rstd = 1.0 / tl.sqrt(sum_sq / BLOCK + eps)
    normed = h * rstd[:, None]
    correction = rstd * sum_dyw_h / BLOCK
    dx = rstd[:, None] * (dyw - normed * correction[:, None])
    if HAS_DHIDDEN_OUT:
        dx += dh
    tl.store(dx_ptr + offs, round_to(dx, dx_ptr.dtype.element_ty))
    total = tl.sum(dy * normed, axis=0)
    tl.store(dweight_ptr + cols, round_to(total, dweight_ptr.dtype.element_ty))


@jit
def _sum_partials_kernel(
    partial_ptr, out_ptr, programs, hidden, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr
):
    # Blocks of BLOCK_P partial rows are added in program order: the sum is deterministic.
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < hidden
    acc = tl.zeros([BLOCK_P, BLOCK_H], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        part = start + tl.arange(0, BLOCK_P)
        mask = (part < programs)[:, None] & col_mask[None, :]
        offs = part.to(tl.int64)[:, None] * hidden + cols[None, :]
        acc += tl.load(partial_ptr + offs, mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + cols, round_to(total, out_ptr.dtype.element_ty), mask=col_mask)
