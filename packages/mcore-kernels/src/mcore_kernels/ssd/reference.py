"""Torch references of the Mamba-2 state-space duality (SSD) kernels.

Notation (as in the Mamba-2 paper, Dao & Gu 2024): per head ``h`` the state ``S`` is a
``[P, N]`` matrix (head dimension by state size) that evolves token by token as
``S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T`` and emits ``y_t = S_t C_t + D_h x_t``.
``B`` and ``C`` are shared by the ``H / G`` heads of a group. Tokens of several sequences may be
packed into one row; ``cu_seqlens`` marks where each starts and the state restarts there (from
``initial_states`` or zeros).

:func:`ssd_scan_reference` computes this chunk by chunk (quadratic inside a chunk, recurrent
between chunks), the same decomposition as the Triton kernel, in float32 torch with autograd;
it is the CPU path of :func:`mcore_kernels.ssd.ssd_scan`. :func:`ssd_scan_recurrent` is the
token-by-token recurrence, an independent oracle for tests.
"""

from __future__ import annotations

import torch

from mcore_kernels.ssd._checks import check_scan_args, default_cu_seqlens

__all__ = ["ssd_scan_recurrent", "ssd_scan_reference", "ssd_state_update_reference"]


def _expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.float().repeat_interleave(heads // t.shape[-2], dim=-2)


def ssd_scan_reference(
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
    """Chunked SSD scan over packed sequences in float32 torch (differentiable).

    Args:
        x: ``[T, H, P]`` inputs of all packed tokens.
        dt: ``[T, H]`` positive time steps (after bias, softplus and clamping).
        A: ``[H]`` decay rates (negative).
        B: ``[T, G, N]`` input projections.
        C: ``[T, G, N]`` output projections.
        D: ``[H]`` skip weights, or None.
        chunk_size: Tokens per chunk (a power of two >= 16).
        cu_seqlens: ``[S + 1]`` start offsets of the packed sequences (default: one sequence).
        initial_states: ``[S, H, P, N]`` state before each sequence (default zeros).

    Returns:
        ``(y, final_states)``: ``y`` ``[T, H, P]`` in ``x.dtype`` and the float32 state after
        the last token of each sequence, ``[S, H, P, N]``.

    Raises:
        KernelShapeError: A shape does not match.
        KernelValueError: ``chunk_size`` or the head/group split is invalid.
    """
    if cu_seqlens is None:
        cu_seqlens = default_cu_seqlens(x.shape[0], x.device)
    check_scan_args(x, dt, A, B, C, D, chunk_size, cu_seqlens, initial_states)
    heads, head_dim = x.shape[1], x.shape[2]
    state_size = B.shape[-1]
    bounds = cu_seqlens.tolist()
    A32 = A.float()
    outputs = []
    finals = []
    for seq in range(len(bounds) - 1):
        if initial_states is not None:
            state = initial_states[seq].float()
        else:
            state = x.new_zeros((heads, head_dim, state_size), dtype=torch.float32)
        for c0 in range(bounds[seq], bounds[seq + 1], chunk_size):
            c1 = min(c0 + chunk_size, bounds[seq + 1])
            xc = x[c0:c1].float()
            dtc = dt[c0:c1].float()
            bc = _expand_groups(B[c0:c1], heads)
            cc = _expand_groups(C[c0:c1], heads)
            a = torch.cumsum(dtc * A32, dim=0)
            length = c1 - c0
            causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            diff = (a[:, None, :] - a[None, :, :]).masked_fill(~causal[..., None], float("-inf"))
            weights = torch.einsum("lhn,shn->lsh", cc, bc) * torch.exp(diff)
            xdt = xc * dtc[..., None]
            y = torch.einsum("lsh,shp->lhp", weights, xdt)
            y = y + torch.exp(a)[..., None] * torch.einsum("lhn,hpn->lhp", cc, state)
            if D is not None:
                y = y + D.float()[:, None] * xc
            decay = torch.exp(a[-1:] - a)
            state = torch.exp(a[-1])[:, None, None] * state + torch.einsum(
                "lh,lhp,lhn->hpn", decay, xdt, bc
            )
            outputs.append(y)
        finals.append(state)
    y_all = torch.cat(outputs) if outputs else x.new_zeros((0, heads, head_dim))
    return y_all.to(x.dtype), torch.stack(finals)


def ssd_scan_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence one token at a time (float64 oracle for tests).

    Args:
        x: ``[T, H, P]`` inputs.
        dt: ``[T, H]`` time steps.
        A: ``[H]`` decay rates.
        B: ``[T, G, N]`` input projections.
        C: ``[T, G, N]`` output projections.
        D: ``[H]`` skip weights, or None.
        cu_seqlens: ``[S + 1]`` sequence starts (default: one sequence).
        initial_states: ``[S, H, P, N]`` or None.

    Returns:
        ``(y, final_states)`` in float64.
    """
    if cu_seqlens is None:
        cu_seqlens = default_cu_seqlens(x.shape[0], x.device)
    heads, head_dim = x.shape[1], x.shape[2]
    bexp = B.double().repeat_interleave(heads // B.shape[1], dim=1)
    cexp = C.double().repeat_interleave(heads // C.shape[1], dim=1)
    bounds = cu_seqlens.tolist()
    ys = []
    finals = []
    for seq in range(len(bounds) - 1):
        state = (
            initial_states[seq].double()
            if initial_states is not None
            else torch.zeros(heads, head_dim, B.shape[-1], dtype=torch.float64)
        )
        for t in range(bounds[seq], bounds[seq + 1]):
            step = dt[t].double()
            decay = torch.exp(step * A.double())
            state = (
                decay[:, None, None] * state
                + (step[:, None] * x[t].double())[..., None] * bexp[t][:, None, :]
            )
            y = torch.einsum("hpn,hn->hp", state, cexp[t])
            if D is not None:
                y = y + D.double()[:, None] * x[t].double()
            ys.append(y)
        finals.append(state)
    return torch.stack(ys), torch.stack(finals)


def ssd_state_update_reference(
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
    """One decode step of the SSD recurrence, updating the states in place.

    Args:
        state: ``[num_slots, H, P, N]`` float32 state slots, updated in place.
        x: ``[Bt, H, P]`` inputs of the new token of each request.
        dt: ``[Bt, H]`` time steps.
        A: ``[H]`` decay rates.
        B: ``[Bt, G, N]`` input projections.
        C: ``[Bt, G, N]`` output projections.
        D: ``[H]`` skip weights, or None.
        state_indices: ``[Bt]`` slot of each request (default ``0 .. Bt - 1``); a negative
            index marks a padding row whose output is zero and which touches no slot.

    Returns:
        ``[Bt, H, P]`` outputs in ``x.dtype``.
    """
    batch, heads, _ = x.shape
    if state_indices is None:
        state_indices = torch.arange(batch, device=x.device)
    valid = state_indices >= 0
    slots = state_indices.clamp(min=0).long()
    current = state[slots].float()
    step = dt.float()
    bexp = _expand_groups(B, heads)
    cexp = _expand_groups(C, heads)
    decay = torch.exp(step * A.float())
    new = (
        decay[..., None, None] * current
        + (step[..., None] * x.float())[..., None] * bexp[:, :, None, :]
    )
    y = torch.einsum("bhpn,bhn->bhp", new, cexp)
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    state[slots[valid]] = new[valid].to(state.dtype)
    return torch.where(valid[:, None, None], y, torch.zeros_like(y)).to(x.dtype)
