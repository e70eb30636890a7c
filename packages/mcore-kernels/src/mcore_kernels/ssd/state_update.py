"""Mamba-2 single-token decode: the SSD state update as a Triton kernel, with its dispatch.

One program per (request, head) reads the request's ``[P, N]`` state slot, applies
``S = exp(dt A) S + dt x B^T``, writes the slot back and emits ``y = S C + D x``. Slots are
addressed through ``state_indices`` so that an engine keeps the states of all live requests in
one preallocated tensor; a negative index is a padding row (CUDA-graph buckets) that reads and
writes no slot and outputs zeros. The launch shape depends on the batch only, so the kernel is
graph-capturable. While ``torch.compile`` traces a call it becomes the ``torch.library`` op
``torch.ops.mcore_kernels.ssd_state_update_`` (it writes ``state``), which runs the same dispatch
when the graph runs.
"""

from __future__ import annotations

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import jit, next_power_of_2, on_device_of, tl
from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.ssd.reference import ssd_state_update_reference

__all__ = ["ssd_state_update", "ssd_state_update_triton"]


@jit
def _state_update_kernel(
    state_ptr,
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    idx_ptr,
    y_ptr,
    heads,
    head_dim,
    state_size,
    groups,
    HEADS_PER_GROUP: tl.constexpr,
    HAS_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    group = head // HEADS_PER_GROUP
    slot = tl.load(idx_ptr + row).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < head_dim
    mask_n = offs_n < state_size
    valid = slot >= 0
    slot_tile = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.int64) + slot
    mask_pn = mask_p[:, None] & mask_n[None, :] & (slot_tile >= 0)
    state_off = (tl.maximum(slot, 0) * heads + head) * head_dim * state_size
    pn_off = offs_p[:, None] * state_size + offs_n[None, :]
    state = tl.load(state_ptr + state_off + pn_off, mask=mask_pn, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + (row * heads + head) * head_dim + offs_p, mask=mask_p, other=0.0)
    x = x.to(tl.float32)
    dt = tl.load(dt_ptr + row * heads + head).to(tl.float32)
    rate = tl.load(a_ptr + head).to(tl.float32)
    bc_off = (row * groups + group) * state_size + offs_n
    b = tl.load(b_ptr + bc_off, mask=mask_n, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + bc_off, mask=mask_n, other=0.0).to(tl.float32)
    state = tl.exp(dt * rate) * state + (dt * x)[:, None] * b[None, :]
    tl.store(state_ptr + state_off + pn_off, state, mask=mask_pn)
    y = tl.sum(state * c[None, :], axis=1)
    if HAS_D:
        y += tl.load(d_ptr + head).to(tl.float32) * x
    y = tl.where(valid, y, 0.0)
    tl.store(y_ptr + (row * heads + head) * head_dim + offs_p, y, mask=mask_p)


def _check(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state_indices: torch.Tensor,
) -> None:
    if x.dim() != 3 or B.dim() != 3:
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)} and B.shape={tuple(B.shape)} must be [batch, heads, "
            "head_dim] and [batch, groups, state]"
        )
    batch, heads, head_dim = x.shape
    groups, size = B.shape[1], B.shape[2]
    expected = {
        "state": (state.shape[0], heads, head_dim, size),
        "dt": (batch, heads),
        "A": (heads,),
        "B": (batch, groups, size),
        "C": (batch, groups, size),
        "state_indices": (batch,),
    }
    given = {"state": state, "dt": dt, "A": A, "B": B, "C": C, "state_indices": state_indices}
    if D is not None:
        expected["D"] = (heads,)
        given["D"] = D
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            raise KernelShapeError(
                f"{name}.shape={tuple(given[name].shape)} does not match the expected {shape}"
            )
    if heads % groups:
        raise KernelShapeError(f"heads={heads} is not a multiple of groups={groups}")
    if state.dtype != torch.float32:
        raise KernelDtypeError(f"state.dtype={state.dtype}: the state slots must be float32")


def ssd_state_update_triton(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step on the Triton kernel (same contract as :func:`ssd_state_update`).

    Args:
        state: ``[num_slots, H, P, N]`` float32 contiguous state slots, updated in place.
        x: ``[Bt, H, P]`` inputs.
        dt: ``[Bt, H]`` time steps.
        A: ``[H]`` decay rates.
        B: ``[Bt, G, N]`` input projections.
        C: ``[Bt, G, N]`` output projections.
        D: ``[H]`` skip weights or None.
        state_indices: ``[Bt]`` slot per row (negative: padding); default ``0 .. Bt - 1``.

    Returns:
        ``[Bt, H, P]`` outputs in ``x.dtype``.
    """
    batch, heads, head_dim = x.shape
    if state_indices is None:
        state_indices = torch.arange(batch, device=x.device)
    _check(state, x, dt, A, B, C, D, state_indices)
    x, dt, B, C = x.contiguous(), dt.contiguous(), B.contiguous(), C.contiguous()
    y = torch.empty_like(x)
    block_p = next_power_of_2(head_dim)
    block_n = next_power_of_2(B.shape[2])
    with on_device_of(x):
        _state_update_kernel[(batch, heads)](
            state,
            x,
            dt,
            A.contiguous(),
            B,
            C,
            D if D is not None else A,
            state_indices.contiguous(),
            y,
            heads,
            head_dim,
            B.shape[2],
            B.shape[1],
            HEADS_PER_GROUP=heads // B.shape[1],
            HAS_D=D is not None,
            BLOCK_P=block_p,
            BLOCK_N=block_n,
        )
    return y


def ssd_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Mamba-2 decode step for a batch of requests, updating their state slots in place.

    Args:
        state: ``[num_slots, H, P, N]`` float32 state slots (contiguous), updated in place.
        x: ``[Bt, H, P]`` inputs of each request's new token.
        dt: ``[Bt, H]`` positive time steps.
        A: ``[H]`` decay rates (negative).
        B: ``[Bt, G, N]`` input projections.
        C: ``[Bt, G, N]`` output projections.
        D: ``[H]`` skip weights, or None.
        state_indices: ``[Bt]`` slot of each request (default ``0 .. Bt - 1``); a negative
            index marks a padding row (zero output, no slot touched).

    Returns:
        ``[Bt, H, P]`` outputs in ``x.dtype``.

    Raises:
        KernelShapeError: A shape does not match.
        KernelDtypeError: ``state`` is not float32.
        KernelBackendError: ``MCORE_KERNELS_BACKEND`` asks for a backend that cannot run.
    """
    if _compile.compiling():
        if state_indices is None:
            state_indices = torch.arange(x.shape[0], device=x.device)
        _check(state, x, dt, A, B, C, D, state_indices)
        return _ssd_state_update_op(state, x, dt, A, B, C, D, state_indices)
    return _ssd_state_update_run(state, x, dt, A, B, C, D, state_indices)


def _ssd_state_update_run(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state_indices: torch.Tensor | None,
) -> torch.Tensor:
    if use_triton(x):
        return ssd_state_update_triton(state, x, dt, A, B, C, D, state_indices=state_indices)
    if state_indices is None:
        state_indices = torch.arange(x.shape[0], device=x.device)
    _check(state, x, dt, A, B, C, D, state_indices)
    return ssd_state_update_reference(state, x, dt, A, B, C, D, state_indices=state_indices)


@_compile.custom_op(
    "ssd_state_update_",
    "(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, "
    "Tensor state_indices) -> Tensor",
    mutates_args=("state",),
)
def _ssd_state_update_op(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    return _ssd_state_update_run(state, x, dt, A, B, C, D, state_indices)


@_ssd_state_update_op.register_fake
def _ssd_state_update_fake(state, x, dt, A, B, C, D, state_indices):
    return x.new_empty(x.shape)
