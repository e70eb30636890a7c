"""Argument checks shared by the Mamba-2 (SSD) kernels and their references."""

from __future__ import annotations

import torch

from mcore_kernels.errors import KernelShapeError, KernelValueError

__all__ = ["check_scan_args", "default_cu_seqlens"]


def _shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise KernelShapeError(
            f"{name}.shape={tuple(tensor.shape)} does not match the expected {expected}"
        )


def default_cu_seqlens(num_tokens: int, device: torch.device) -> torch.Tensor:
    """Boundaries of a single sequence covering all tokens.

    Args:
        num_tokens: Tokens in the row.
        device: Device of the returned tensor.

    Returns:
        ``int32`` tensor ``[0, num_tokens]``.
    """
    return torch.tensor([0, num_tokens], dtype=torch.int32, device=device)


def check_scan_args(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    chunk_size: int,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None,
) -> None:
    """Validate the arguments of the chunked scan.

    Args:
        x: ``[T, H, P]`` inputs.
        dt: ``[T, H]`` time steps.
        A: ``[H]`` decay rates.
        B: ``[T, G, N]`` input projections.
        C: ``[T, G, N]`` output projections.
        D: ``[H]`` skip weights or None.
        chunk_size: Tokens per chunk.
        cu_seqlens: ``[S + 1]`` sequence boundaries.
        initial_states: ``[S, H, P, N]`` or None.

    Raises:
        KernelShapeError: A shape does not match the layout.
        KernelValueError: ``chunk_size`` is not a power of two of at least 16, or the number
            of heads is not a multiple of the number of groups.
    """
    if x.dim() != 3:
        raise KernelShapeError(f"x.shape={tuple(x.shape)} must be [tokens, heads, head_dim]")
    if B.dim() != 3:
        raise KernelShapeError(f"B.shape={tuple(B.shape)} must be [tokens, groups, state]")
    tokens, heads, _ = x.shape
    groups, state = B.shape[1], B.shape[2]
    _shape("dt", dt, (tokens, heads))
    _shape("A", A, (heads,))
    _shape("C", C, (tokens, groups, state))
    if D is not None:
        _shape("D", D, (heads,))
    if heads % groups:
        raise KernelValueError(f"heads={heads} is not a multiple of groups={groups}")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise KernelValueError(f"chunk_size={chunk_size} must be a power of two >= 16")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise KernelShapeError(
            f"cu_seqlens.shape={tuple(cu_seqlens.shape)} must be [num_sequences + 1]"
        )
    if initial_states is not None:
        _shape(
            "initial_states",
            initial_states,
            (cu_seqlens.numel() - 1, heads, x.shape[2], state),
        )
