"""Launchers of the add + RMSNorm kernels: output allocation, specialisation keys, launch.

Launches go through :meth:`~mcore_kernels._triton_utils.CachedLauncher.keyed` with a
specialisation key built from what the call knows (dtypes, widths, which ints are 1 or multiples
of 16).
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_kernels._triton_utils import CachedLauncher, device_limits, next_power_of_2
from mcore_kernels.errors import KernelValueError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.rms_norm_config import (
    _PARTIAL_SUM_COLS,
    _PARTIAL_SUM_ROWS,
    MAX_BLOCK,
    RMSNormLaunch,
    _backward_stages,
    _device,
    _forward_constexprs,
    _launch,
)
from mcore_kernels.rms_norm_kernels import (
    _rms_norm_bwd_exact_kernel,
    _rms_norm_bwd_kernel,
    _rms_norm_fwd_exact_kernel,
    _rms_norm_fwd_kernel,
    _sum_partials_kernel,
)

_SUM_CONSTEXPRS = {"BLOCK_P": _PARTIAL_SUM_ROWS, "BLOCK_H": _PARTIAL_SUM_COLS}
_FORWARD = CachedLauncher(_rms_norm_fwd_kernel)
_FORWARD_EXACT = CachedLauncher(_rms_norm_fwd_exact_kernel)
# Inside mcore_kernels.pdl.programmatic_dependent_launch (the engine's decode steps).
_FORWARD_PDL = CachedLauncher(_rms_norm_fwd_kernel, launch_pdl=True)
_BACKWARD = CachedLauncher(_rms_norm_bwd_kernel)
_BACKWARD_EXACT = CachedLauncher(_rms_norm_bwd_exact_kernel)
_SUM_PARTIALS = CachedLauncher(_sum_partials_kernel)


_ALIGNED = 15  # low address bits that must be zero for the 16-byte specialisation
# Elements from which the forward's offsets are 64-bit (a block's offsets stay below 2**31).
_WIDE_ELEMENTS = 2**31 - 2 * MAX_BLOCK
_I32_MAX = 2**31 - 1


def _int_class(value: int) -> tuple[bool, bool, bool]:
    """What Triton specialises an int argument on: ``== 1``, ``% 16 == 0``, 32-bit range."""
    return value == 1, not value & 15, value <= _I32_MAX


# Calls seen before, by (rows, hidden, device, x dtype, weight dtype, residual?): the compiled
# forward launch and its grid, so that a repeated call only allocates and launches (the host
# work of a one-row call is what it costs). Only calls without a stored rstd and with the
# 16-byte aligned inputs the key was built for take it; the others take the full path.
_FAST_FORWARD: dict[tuple, tuple] = {}
# By (shape of hidden_states, device, dy, d(hidden), hidden and weight dtypes, d(hidden)
# given?): the one-program backward launch (calls of one row block, which write the weight
# gradient directly), with the row count, hidden size and device it was built for.
_FAST_BACKWARD: dict[tuple, tuple] = {}
# Read only after a CUDA launch was cached (a build without CUDA never reaches it).
_current_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device: Any = getattr(torch._C, "_cuda_getDevice", None)


def _forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    for_backward: bool,
    config: RMSNormLaunch | None = None,
    specialise: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the forward: ``(y, x + residual or x, rstd or None)``.

    ``rstd`` is stored only ``for_backward`` of rows wider than ``MAX_BLOCK`` (the backward of
    narrower rows recomputes it). ``config`` overrides the table's launch parameters (the
    tuner's sweep). Calls of whole row blocks of rows exactly one block wide run the
    specialised kernel (no masks, no row count or strides: the bits of the general kernel);
    ``specialise=False`` runs the general kernel for them (the tests compare the two).
    """
    # Contiguous tensors go to the kernel as they are (rows of ``hidden`` elements): no
    # reshapes or views on the hot path; other layouts are copied once.
    hidden = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    if residual is not None and not residual.is_contiguous():
        residual = residual.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    rows = x.numel() // hidden
    # ``empty_like`` is the cheapest allocation from Python (about half of ``torch.empty`` with
    # keyword arguments on the H100 machine's host).
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    device_index = x.get_device()
    pdl = pdl_enabled(x.device)
    signature = (rows, hidden, device_index, x.dtype, weight.dtype, residual is not None, pdl)
    # Rows wider than MAX_BLOCK store rstd for the backward: not a launch of the fast path.
    fast = None
    if config is None and specialise and (not for_backward or hidden <= MAX_BLOCK):
        fast = _FAST_FORWARD.get(signature)
    if fast is not None:
        # A call like one launched before: its compiled kernel and grid, nothing recomputed.
        run, function, metadata, tail, programs, exact = fast
        r = residual if residual is not None else x
        xa, ra, wa, ya = x.data_ptr(), r.data_ptr(), weight.data_ptr(), y.data_ptr()
        if not (xa | ra | wa) & _ALIGNED:
            stream = _current_stream(device_index)
            if exact:
                run(programs, 1, 1, stream, function, metadata, None, None, None, xa, ra, wa, ya,
                    h.data_ptr(), eps, *tail)  # fmt: skip
            else:
                run(programs, 1, 1, stream, function, metadata, None, None, None, xa, ra, wa, ya,
                    h.data_ptr(), ya, rows, hidden, hidden, hidden, eps, *tail)  # fmt: skip
            return y, h, None
    plan = _launch(hidden, device_index)
    store_rstd = for_backward and not plan.single
    rstd = x.new_empty(rows, dtype=torch.float32) if store_rstd else None
    if rows == 0:
        return y, h, rstd
    has_residual = residual is not None
    tuned = config is None
    if config is None:
        config = plan.config
    # A row block never holds more rows than the call (same layout of a row, fewer idle rows
    # in the tile).
    block_rows = config.fwd_rows if rows >= config.fwd_rows else next_power_of_2(rows)
    elements = rows * hidden
    # PDL launches keep the general kernel (the specialised one has no grid-dependency wait).
    exact = specialise and not pdl and plan.exact and not rows % block_rows
    flags = (
        # No mask: whole row blocks of rows exactly one block wide.
        plan.exact and not rows % block_rows,
        # 64-bit offsets only where 32 bits could overflow.
        elements >= _WIDE_ELEMENTS,
        # Calls whose inputs fit in half the L2 cache stream them with the evict-first hint
        # (H200, one CUDA graph over L2-cold inputs: 256 x 2048 2.50 against 2.72 us, 4096 x
        # 2048 18.0 against 18.5 us); larger calls are 2-5 % slower with it and load plainly.
        elements * x.itemsize <= plan.streaming_bytes,
    )
    constexprs = _forward_constexprs(
        plan, has_residual, store_rstd, block_rows, flags, exact=exact, pdl=pdl
    )
    launcher = _FORWARD_PDL if pdl else _FORWARD
    r = residual if residual is not None else x
    stats = rstd if rstd is not None else y
    programs = -(-rows // block_rows)
    addresses = x.data_ptr(), r.data_ptr(), weight.data_ptr()
    if exact:
        # rstd is never stored here: rows of at most MAX_BLOCK recompute it in the backward.
        args_exact = (x, r, weight, y, h, eps)
        if tuned and not (addresses[0] | addresses[1] | addresses[2]) & _ALIGNED:
            exact_key = (
                hidden,
                device_index,
                x.dtype,
                weight.dtype,
                has_residual,
                block_rows,
                flags,
            )
            _FORWARD_EXACT.keyed(
                exact_key,
                programs,
                args_exact,
                (*addresses, y.data_ptr(), h.data_ptr(), eps),
                constexprs,
                config.fwd_warps,
                device_index,
            )
            entry = _FORWARD_EXACT.entry(exact_key)
            if entry is not None and type(eps) is float:
                _FAST_FORWARD[signature] = (*entry, programs, True)
        else:
            _FORWARD_EXACT((programs,), args_exact, constexprs, config.fwd_warps, device_index)
        return y, h, rstd
    args = (x, r, weight, y, h, stats, rows, hidden, hidden, hidden, eps)
    if tuned and not (addresses[0] | addresses[1] | addresses[2]) & _ALIGNED:
        # Fresh outputs are aligned: the specialisation follows from what is known here.
        y_address = y.data_ptr()
        key = (
            hidden,
            device_index,
            x.dtype,
            weight.dtype,
            has_residual,
            store_rstd,
            block_rows,
            flags,
            _int_class(rows),
            pdl,
        )
        launcher.keyed(
            key,
            programs,
            args,
            (
                *addresses,
                y_address,
                h.data_ptr(),
                stats.data_ptr() if store_rstd else y_address,
                rows,
                hidden,
                hidden,
                hidden,
                eps,
            ),
            constexprs,
            config.fwd_warps,
            device_index,
        )
        entry = launcher.entry(key)
        if entry is not None and specialise and not store_rstd and type(eps) is float:
            _FAST_FORWARD[signature] = (*entry, programs, False)
    else:
        launcher((programs,), args, constexprs, config.fwd_warps, device_index)
    return y, h, rstd


def _backward(
    dy: torch.Tensor,
    dhidden_out: torch.Tensor | None,
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor | None,
    eps: float,
    config: RMSNormLaunch | None = None,
    specialise: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward: ``(d(hidden_states), d(weight))`` in the inputs' dtypes.

    ``rstd`` is the forward's stored statistic, needed only by rows wider than ``MAX_BLOCK``
    (narrower rows recompute it from ``hidden_states``). ``config`` overrides the table's launch
    parameters (the tuner's sweep). A call that is one row block of rows exactly one block wide
    runs the specialised one-program kernel (no masks, no row count or strides: the bits of the
    general kernel); ``specialise=False`` runs the general kernel for it (the tests compare).
    """
    hidden = hidden_states.shape[-1]
    h2 = hidden_states if hidden_states.is_contiguous() else hidden_states.contiguous()
    dy2 = dy if dy.is_contiguous() else dy.contiguous()
    dh2 = dy2
    if dhidden_out is not None:
        dh2 = dhidden_out if dhidden_out.is_contiguous() else dhidden_out.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    if config is None and specialise and rstd is None:
        done = _backward_cached(dy2, dhidden_out if dhidden_out is None else dh2, h2, weight, eps)
        if done is not None:
            return done
    rows = h2.numel() // hidden
    dx = torch.empty_like(h2)
    if rows == 0:
        return dx, torch.zeros_like(weight)
    device_index = h2.get_device()
    signature = (h2.shape, device_index, dy2.dtype, dh2.dtype, h2.dtype, weight.dtype)
    block, single, chosen, cap, exact_width, _ = _launch(hidden, device_index)
    if rstd is None:
        if not single:
            raise KernelValueError(f"rows of {hidden} > MAX_BLOCK={MAX_BLOCK} need the stored rstd")
        rstd = dy2
    tuned = config is None
    if config is None:
        config = chosen
    else:
        cap = device_limits(_device(device_index))[0] * config.bwd_programs_per_sm
    # A row block never holds more rows than the call: a one-token backward runs a one-row
    # tile (2.0 against 3.0 us at hidden 2048 on an H100), with the same layout of each row.
    block_rows = config.bwd_rows if rows >= config.bwd_rows else next_power_of_2(rows)
    blocks = -(-rows // block_rows)
    programs = min(blocks, cap)
    final = programs == 1 and single
    # A pipeline overlaps one row block's loads with the previous one's reduction: with one
    # block per program there is nothing to overlap, and its shared-memory round trip only
    # adds latency.
    stages = 1
    if single and blocks > programs:
        stages = _backward_stages(
            config, block, 3 if dhidden_out is not None else 2, _device(device_index)
        )
    dweight = torch.empty_like(weight)
    has_dhidden = dhidden_out is not None
    if final and exact_width and specialise and rows == block_rows:
        _backward_exact(dy2, dh2, h2, weight, dx, dweight, eps, has_dhidden, block_rows, block,
                        config.bwd_warps, device_index, tuned, signature)  # fmt: skip
        return dx, dweight
    partial = dweight if final else weight.new_empty((programs, hidden), dtype=torch.float32)
    args = (dy2, dh2, h2, weight, rstd, dx, partial, rows, hidden, hidden, eps)
    constexprs = {
        "HAS_DHIDDEN_OUT": has_dhidden,
        "BLOCK_M": block_rows,
        "BLOCK": block,
        "SINGLE_BLOCK": single,
        "NUM_STAGES": stages,
        "FINAL": final,
    }
    inputs = dy2.data_ptr(), dh2.data_ptr(), h2.data_ptr(), weight.data_ptr(), rstd.data_ptr()
    if tuned and not (inputs[0] | inputs[1] | inputs[2] | inputs[3] | inputs[4]) & _ALIGNED:
        key = (
            hidden,
            device_index,
            dy2.dtype,
            dh2.dtype,
            h2.dtype,
            weight.dtype,
            rstd.dtype,
            has_dhidden,
            block_rows,
            stages,
            final,
            _int_class(rows),
        )
        addresses = (*inputs, dx.data_ptr(), partial.data_ptr(), rows, hidden, hidden, eps)
        _BACKWARD.keyed(key, programs, args, addresses, constexprs, config.bwd_warps, device_index)
        entry = _BACKWARD.entry(key)
        if entry is not None and specialise and final and rstd is dy2 and type(eps) is float:
            _FAST_BACKWARD[(*signature, has_dhidden)] = (
                *entry,
                programs,
                False,
                rows,
                hidden,
                device_index,
            )
    else:
        _BACKWARD((programs,), args, constexprs, config.bwd_warps, device_index)
    if not final:
        _SUM_PARTIALS.keyed(
            (hidden, device_index, weight.dtype, _int_class(programs)),
            -(-hidden // _PARTIAL_SUM_COLS),
            (partial, dweight, programs, hidden),
            (partial.data_ptr(), dweight.data_ptr(), programs, hidden),
            _SUM_CONSTEXPRS,
            4,
            device_index,
        )
    return dx, dweight


def _backward_exact(
    dy: torch.Tensor,
    dh: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    dx: torch.Tensor,
    dweight: torch.Tensor,
    eps: float,
    has_dhidden: bool,
    block_rows: int,
    block: int,
    warps: int,
    device_index: int,
    tuned: bool,
    signature: tuple,
) -> None:
    """Launch the specialised one-program backward (the call is one row block, exact width)."""
    args = (dy, dh, h, weight, dx, dweight, eps)
    constexprs = {"HAS_DHIDDEN_OUT": has_dhidden, "BLOCK_M": block_rows, "BLOCK": block}
    inputs = dy.data_ptr(), dh.data_ptr(), h.data_ptr(), weight.data_ptr()
    if tuned and not (inputs[0] | inputs[1] | inputs[2] | inputs[3]) & _ALIGNED:
        key = (block, device_index, dy.dtype, dh.dtype, h.dtype, weight.dtype, has_dhidden,
               block_rows)  # fmt: skip
        addresses = (*inputs, dx.data_ptr(), dweight.data_ptr(), eps)
        _BACKWARD_EXACT.keyed(key, 1, args, addresses, constexprs, warps, device_index)
        entry = _BACKWARD_EXACT.entry(key)
        if entry is not None and type(eps) is float:
            _FAST_BACKWARD[(*signature, has_dhidden)] = (
                *entry,
                1,
                True,
                dy.numel() // block,
                block,
                device_index,
            )
    else:
        _BACKWARD_EXACT((1,), args, constexprs, warps, device_index)


def _backward_cached(
    dy: torch.Tensor,
    dhidden_out: torch.Tensor | None,
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The one-program backward of a call like one launched before, from the fast table.

    Allocates the two outputs and launches the compiled kernel, nothing else; returns None when
    the call is not in the table or its tensors are not the contiguous, 16-byte aligned ones
    on the current device that the entry was built for (the caller then takes
    :func:`_backward`).
    """
    dh = dy if dhidden_out is None else dhidden_out
    fast = _FAST_BACKWARD.get(
        (
            hidden_states.shape,
            hidden_states.get_device(),
            dy.dtype,
            dh.dtype,
            hidden_states.dtype,
            weight.dtype,
            dhidden_out is not None,
        )
    )
    if fast is None:
        return None
    run, function, metadata, tail, programs, exact, rows, hidden, device_index = fast
    ya, ha, xa, wa = dy.data_ptr(), dh.data_ptr(), hidden_states.data_ptr(), weight.data_ptr()
    if (
        (ya | ha | xa | wa) & _ALIGNED
        or not (dy.is_contiguous() and dh.is_contiguous() and hidden_states.is_contiguous())
        or not weight.is_contiguous()
        or device_index != _current_device()
    ):
        return None
    dx = torch.empty_like(hidden_states)
    dweight = torch.empty_like(weight)
    stream = _current_stream(device_index)
    if exact:
        run(programs, 1, 1, stream, function, metadata, None, None, None, ya, ha, xa, wa,
            dx.data_ptr(), dweight.data_ptr(), eps, *tail)  # fmt: skip
    else:
        run(programs, 1, 1, stream, function, metadata, None, None, None, ya, ha, xa, wa, ya,
            dx.data_ptr(), dweight.data_ptr(), rows, hidden, hidden, eps, *tail)  # fmt: skip
    return dx, dweight
