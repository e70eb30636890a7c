"""Which kernel runs each of the six grouped GEMMs of a SwiGLU expert MLP's forward + backward.

Rows sorted by expert, ``offsets[e]`` the end row of expert ``e``:

- ``gate_up``: ``x[rows of e] @ Wgu[e].T``, ``down``: ``act[rows of e] @ Wd[e].T``;
- ``d_act``: ``grad[rows of e] @ Wd[e]``, ``d_x``: ``grad_gate_up[rows of e] @ Wgu[e]``;
- ``w_down``: ``grad[rows of e].T @ act[rows of e]``, ``w_gate_up``: ``grad_gate_up[rows of
  e].T @ x[rows of e]``.

Each runs on ``torch._grouped_mm``, on a loop of cuBLAS GEMMs over the experts, on one batched
cuBLAS GEMM over equal row slots per expert, or on the persistent Triton kernels of
:mod:`mcore_kernels.moe.grouped_mm`, as an :class:`ExpertGemms` plan says.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from mcore_kernels.errors import KernelShapeError, KernelValueError
from mcore_kernels.moe.grouped_mm import (
    PersistentTiles,
    k_grouped_mm,
    m_grouped_mm,
    tile_schedule,
)

__all__ = [
    "BATCHED",
    "BATCHED_PLAN",
    "CUBLAS_LOOP",
    "CUBLAS_LOOP_PLAN",
    "GROUPED_MM",
    "ExpertGemmRunner",
    "ExpertGemms",
    "GemmKernel",
    "choose_expert_gemms",
    "measured_expert_gemms",
    "prefers_slots",
    "triton_expert_gemms",
    "without_host_sync",
]


GROUPED_MM = "grouped_mm"
"""``torch._grouped_mm`` (no host synchronisation)."""
CUBLAS_LOOP = "cublas_loop"
"""One cuBLAS GEMM per expert with rows, written in place (the group sizes are read on the
host once per layer call: one synchronisation)."""

BATCHED = "bmm"
"""One batched cuBLAS GEMM (``torch.bmm``) over equal row slots: expert ``e`` owns rows ``e *
S`` to ``(e + 1) * S`` of the ``E * S`` rows, its unused rows being empty (zero input, zero
gradient). Only for rows laid out in such slots (capacity routing's padded slots, or dropless
rows padded to the largest expert); no host synchronisation in the GEMMs themselves."""

GLUON_WEIGHTS = True
"""On a Hopper GPU, the weight gradients of the listed shapes run on the warp-specialised Gluon
kernels (:mod:`mcore_kernels.moe.gluon_wgrad`): the :data:`BATCHED` ones (equal slots) of
:data:`_GLUON_SLOT_SHAPES` instead of ``torch.bmm``, those of :class:`PersistentTiles` on rows
padded per expert (``row_align``) of :data:`_GLUON_ALIGNED_SHAPES` instead of the aligned
Triton kernel, and the :data:`GROUPED_MM` ones on packed rows of :data:`_GLUON_PACKED_SHAPES`
instead of ``torch._grouped_mm``."""

GLUON_D_ACT = False
"""On a Hopper GPU, the down projection's input gradient of the shapes in
:data:`_GLUON_D_ACT_SHAPES` runs on the warp-specialised Gluon kernel with the routed SwiGLU
backward in its epilogue (:func:`mcore_kernels.moe.gluon_d_act.gluon_d_act_swiglu`, through
:meth:`ExpertGemmRunner.d_act_swiglu`) instead of the GEMM followed by the separate pass (the
same gate/up gradient; the routing weights' gradient adds its terms in another order). Off:
no layer gain measured at Qwen3-30B-A3B on one H200 (session 17: with 128-column tiles and a
4-warp epilogue 0.481 against 0.496 ms for the GEMM and the pass, the layer 4.381 against 4.366
ms dropless and 4.336 against 4.347 ms drop-and-pad with the gate/up kernel on in both)."""

GLUON_GATE_UP = True
"""On a Hopper GPU, the gate/up projection of the shapes in :data:`_GLUON_D_ACT_SHAPES` runs on
the warp-specialised Gluon kernel with the routed SwiGLU in its epilogue
(:func:`mcore_kernels.moe.gluon_grouped.gluon_gate_up_swiglu`, through
:meth:`ExpertGemmRunner.gate_up_swiglu`) instead of the GEMM followed by the separate pass
(the same gate/up output and activation, bitwise). Qwen3-30B-A3B on one H200 (session 17):
GEMM + pass 0.788 / 0.805 ms against 0.731 / 0.760 ms (medians of six alternations, two
probes); the layer 4.407 against 4.491 ms dropless, 4.398 against 4.452 ms drop-and-pad
(medians of six rotated windows)."""

GLUON_TILES: Any = None
"""Tiles of all those Gluon weight gradients
(:class:`~mcore_kernels.moe.gluon_wgrad.GluonWeightTiles`, a measurement switch); None: the
tiles listed with each shape."""

LOOP_PREFIX = True
"""The first cuBLAS loop of a layer call whose group ends come through ``host_ends`` starts
with the first expert's GEMM over the mean rows per expert before the host waits for the ends
(:meth:`ExpertGemmRunner._prefix_rows`)."""

GemmKernel = PersistentTiles | str
"""The kernel of one GEMM: :data:`GROUPED_MM`, :data:`CUBLAS_LOOP`, :data:`BATCHED` or the
tiles of the persistent Triton kernel."""

_GEMMS = ("gate_up", "down", "d_act", "d_x", "w_down", "w_gate_up")


@dataclass(kw_only=True, slots=True, frozen=True)
class ExpertGemms:
    """Kernel of each expert GEMM: :data:`GROUPED_MM`, :data:`CUBLAS_LOOP`, :data:`BATCHED` or
    the :class:`~mcore_kernels.moe.grouped_mm.PersistentTiles` of the persistent Triton
    kernel."""

    gate_up: GemmKernel = GROUPED_MM
    """Gate/up projection (forward)."""
    down: GemmKernel = GROUPED_MM
    """Down projection (forward)."""
    d_act: GemmKernel = GROUPED_MM
    """Input gradient of the down projection."""
    d_x: GemmKernel = GROUPED_MM
    """Input gradient of the gate/up projection."""
    w_down: GemmKernel = GROUPED_MM
    """Weight gradient of the down projection."""
    w_gate_up: GemmKernel = GROUPED_MM
    """Weight gradient of the gate/up projection."""
    row_align: int = 1
    """Rows of every expert padded to a multiple of this with empty rows (the dispatcher
    builds such rows when the plan asks for it, :func:`mcore_kernels.moe.rows.aligned_rows`):
    the weight gradients on :class:`PersistentTiles` whose ``block_m`` divides it then run
    without masked row chunks (``k_grouped_mm(aligned=True)``). 1: rows packed."""

    def __post_init__(self) -> None:
        for name in _GEMMS:
            value = getattr(self, name)
            if not (
                isinstance(value, PersistentTiles) or value in (GROUPED_MM, CUBLAS_LOOP, BATCHED)
            ):
                raise KernelValueError(
                    f"ExpertGemms.{name}={value!r}: expected one of "
                    f"{(GROUPED_MM, CUBLAS_LOOP, BATCHED)} or PersistentTiles"
                )
        if self.row_align < 1 or self.row_align & (self.row_align - 1):
            raise KernelValueError(
                f"ExpertGemms.row_align={self.row_align}: expected a power of two >= 1"
            )

    @property
    def slotted(self) -> bool:
        """Whether a GEMM runs :data:`BATCHED`: the rows must then be equal slots per expert."""
        return any(getattr(self, name) == BATCHED for name in _GEMMS)


class ExpertGemmRunner:
    """Runs the six GEMMs of one layer call as an :class:`ExpertGemms` plan says, building each
    row-tile schedule once (per tile height) and the host copy of the group ends at most once,
    shared between the forward and the backward GEMMs.

    Args:
        plan: Kernel of each GEMM.
        offsets: ``[E]`` int32 end row of each expert.
        num_rows: Rows of the grouped matrices.
        host_ends: Returns ``offsets`` as a host list (for the cuBLAS loops), e.g. from a copy
            started earlier on the stream so that the wait overlaps queued kernels; None
            reads ``offsets`` on the host when first needed (a synchronisation).
    """

    def __init__(
        self,
        plan: ExpertGemms,
        offsets: torch.Tensor,
        num_rows: int,
        host_ends: Callable[[], list[int]] | None = None,
    ) -> None:
        self.plan = plan
        self.offsets = offsets
        self.num_rows = num_rows
        self._host_ends = host_ends
        self._schedules: dict[int, torch.Tensor] = {}
        self._spans: list[tuple[int, int, int]] | None = None
        experts = offsets.shape[0]
        if plan.slotted and (experts == 0 or num_rows % experts):
            raise KernelShapeError(
                f"num_rows={num_rows}: batched GEMMs need equal row slots for the {experts} experts"
            )

    def _schedule(self, tiles: PersistentTiles) -> torch.Tensor:
        if tiles.block_m not in self._schedules:
            self._schedules[tiles.block_m] = tile_schedule(
                self.offsets, self.num_rows, tiles.block_m
            )
        return self._schedules[tiles.block_m]

    def _expert_spans(self) -> list[tuple[int, int, int]]:
        """``(expert, first row, end row)`` of every expert (one host synchronisation)."""
        if self._spans is None:
            # NOTE: the group ends on the host, once per layer call, for the cuBLAS loop.
            ends = self._host_ends() if self._host_ends is not None else self.offsets.tolist()
            self._spans = [(e, ends[e - 1] if e else 0, ends[e]) for e in range(len(ends))]
        return self._spans

    def _prefix_rows(self, experts: int) -> int:
        """Rows of the speculative first-expert GEMM (0: none): only while the group ends
        are not yet on the host and arrive through ``host_ends`` (whose copy was queued
        earlier: the wait then overlaps this GEMM)."""
        if not LOOP_PREFIX or self._spans is not None or self._host_ends is None or experts < 2:
            return 0
        return self.num_rows // experts

    def _loop(self, one: Callable[[int, int, int], None], done: int = 0) -> None:
        """``one(expert, start, end)`` for every expert with rows, the first expert's from row
        ``done`` on (its rows before ``done`` already computed)."""
        for expert, start, end in self._expert_spans():
            if expert == 0:
                start = max(start, done)
            if end > start:
                one(expert, start, end)

    def _rows(
        self, kernel: GemmKernel, a: torch.Tensor, w: torch.Tensor, transpose: bool
    ) -> torch.Tensor:
        if isinstance(kernel, PersistentTiles):
            return m_grouped_mm(
                a,
                w,
                self.offsets,
                transpose_weight=transpose,
                tiles=kernel,
                schedule=self._schedule(kernel),
            )
        if kernel == CUBLAS_LOOP:
            out = a.new_empty(a.shape[0], w.shape[1] if transpose else w.shape[2])

            def one(expert: int, start: int, end: int) -> None:
                weight = w[expert].t() if transpose else w[expert]
                torch.mm(a[start:end], weight, out=out[start:end])

            prefix = self._prefix_rows(w.shape[0])
            if prefix:
                # Before the host waits for the group ends: the first expert's GEMM over a
                # fixed prefix of the mean rows per expert, so the GPU computes while the
                # host waits and launches the rest. Rows of the prefix past the first expert
                # are rewritten by their own expert's GEMM later on the stream.
                one(0, 0, prefix)
            self._loop(one, done=prefix)
            return out
        if kernel == BATCHED:
            slots = a.view(w.shape[0], -1, a.shape[1])
            return torch.bmm(slots, w.transpose(1, 2) if transpose else w).view(a.shape[0], -1)
        return torch._grouped_mm(a, w.transpose(-2, -1) if transpose else w, offs=self.offsets)

    def _weights(self, kernel: GemmKernel, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if isinstance(kernel, PersistentTiles):
            aligned = self.plan.row_align % kernel.block_m == 0
            experts = self.offsets.shape[0]
            align = self.plan.row_align
            tiles = _gluon_tiles(g, x, experts, _GLUON_ALIGNED_SHAPES, align) if aligned else None
            if tiles is not None:
                from mcore_kernels.moe.gluon_wgrad import gluon_k_grouped_mm

                return gluon_k_grouped_mm(g, x, self.offsets, tiles=tiles)
            return k_grouped_mm(g, x, self.offsets, tiles=kernel, aligned=aligned)
        if kernel == CUBLAS_LOOP:
            out = g.new_empty(self.offsets.shape[0], g.shape[1], x.shape[1])

            def one(expert: int, start: int, end: int) -> None:
                torch.mm(g[start:end].t(), x[start:end], out=out[expert])

            for expert, start, end in self._expert_spans():
                if end == start:
                    out[expert].zero_()
            self._loop(one)
            return out
        if kernel == BATCHED:
            # [E, N, K] in the parameter's layout: the slots' transposed gradient times their
            # rows (empty rows add zero).
            experts = self.offsets.shape[0]
            tiles = _gluon_tiles(g, x, experts, _GLUON_SLOT_SHAPES)
            if tiles is not None:
                from mcore_kernels.moe.gluon_wgrad import gluon_slot_k_grouped_mm

                return gluon_slot_k_grouped_mm(g, x, experts, tiles=tiles)
            return torch.bmm(
                g.view(experts, -1, g.shape[1]).transpose(1, 2), x.view(experts, -1, x.shape[1])
            )
        tiles = _gluon_tiles(g, x, self.offsets.shape[0], _GLUON_PACKED_SHAPES)
        if tiles is not None:
            from mcore_kernels.moe.gluon_wgrad import gluon_k_grouped_mm

            return gluon_k_grouped_mm(g, x, self.offsets, tiles=tiles, aligned=False)
        return torch._grouped_mm(g.t(), x, offs=self.offsets)

    def gate_up(self, x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
        """``x[rows of e] @ w_gate_up[e].T``.

        Args:
            x: ``[M, H]``.
            w_gate_up: ``[E, 2F, H]``.

        Returns:
            ``[M, 2F]``.
        """
        return self._rows(self.plan.gate_up, x, w_gate_up, True)

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

    def _gluon_rows(
        self, switch: bool, kernel: GemmKernel, x: torch.Tensor, w: torch.Tensor, shape: tuple
    ) -> bool:
        """Whether a row GEMM of the layer shape ``(hidden, ffn, experts)`` runs on a Gluon
        kernel with the routed SwiGLU in its epilogue."""
        return (
            switch
            and isinstance(kernel, PersistentTiles)
            and shape in _GLUON_D_ACT_SHAPES
            and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == x.dtype
            and _hopper(x.device)
            and _gluon_ready("gluon_grouped")
        )

    def gate_up_swiglu(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        weights: torch.Tensor,
        order: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The gate/up projection and the routed SwiGLU of its output on the Gluon kernel
        (:data:`GLUON_GATE_UP`), or None where it does not run (the caller then runs
        :meth:`gate_up` and the separate pass).

        Args:
            x: ``[M, H]``.
            w_gate_up: ``[E, 2F, H]``.
            weights: ``[A]`` routing weight of each assignment.
            order: ``[M]`` int64 assignment of each row (-1: none).

        Returns:
            ``(gate_up [M, 2F], act [M, F])`` or None.
        """
        experts, two_ffn, hidden = w_gate_up.shape
        shape = (hidden, two_ffn // 2, experts)
        if not self._gluon_rows(GLUON_GATE_UP, self.plan.gate_up, x, w_gate_up, shape):
            return None
        from mcore_kernels.moe.gluon_grouped import BLOCK_M, gluon_gate_up_swiglu

        schedule = self._schedule(PersistentTiles(block_m=BLOCK_M))
        return gluon_gate_up_swiglu(x, w_gate_up, self.offsets, weights, order, schedule=schedule)

    def d_act_swiglu(
        self,
        grad: torch.Tensor,
        w_down: torch.Tensor,
        gate_up: torch.Tensor,
        weights: torch.Tensor,
        order: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The routed SwiGLU's gradients straight from ``grad[rows of e] @ w_down[e]`` on the
        Gluon kernel (:data:`GLUON_D_ACT`), or None where it does not run (the caller then runs
        :meth:`d_act` and the separate pass).

        Args:
            grad: ``[M, H]``.
            w_down: ``[E, H, F]``.
            gate_up: ``[M, 2F]`` saved gate/up output.
            weights: ``[A]`` routing weight of each assignment.
            order: ``[M]`` int64 assignment of each row (-1: none).

        Returns:
            ``(grad_gate_up, grad_weights)`` or None.
        """
        experts, hidden, ffn = w_down.shape
        shape = (hidden, ffn, experts)
        if gate_up.dtype != grad.dtype or not self._gluon_rows(
            GLUON_D_ACT, self.plan.d_act, grad, w_down, shape
        ):
            return None
        from mcore_kernels.moe.gluon_d_act import gluon_d_act_swiglu
        from mcore_kernels.moe.gluon_grouped import BLOCK_M

        schedule = self._schedule(PersistentTiles(block_m=BLOCK_M))
        return gluon_d_act_swiglu(
            grad, w_down, self.offsets, gate_up, weights, order, schedule=schedule
        )

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


CUBLAS_LOOP_PLAN = ExpertGemms(**cast(dict[str, Any], dict.fromkeys(_GEMMS, CUBLAS_LOOP)))
"""One cuBLAS GEMM per expert for all six GEMMs (the group sizes read on the host once per
layer call)."""
BATCHED_PLAN = ExpertGemms(**cast(dict[str, Any], dict.fromkeys(_GEMMS, BATCHED)))
"""Batched cuBLAS GEMMs over equal row slots per expert for all six GEMMs."""

_WIDE = PersistentTiles(block_m=128, block_n=256, block_k=64, num_stages=4, flatten=True)
_WIDE_3 = PersistentTiles(block_m=128, block_n=256, block_k=64, num_stages=3, flatten=True)
_ALIGNED = PersistentTiles(block_m=64, block_n=128, block_k=256, num_stages=3)
# Each expert's jobs column tile by column tile (expert_columns): its two or three row tiles
# read one 2-4 MB strip of its weights side by side, so the strip streams from memory once.
# Layer forward + backward, one H200, two probes of session 12, alternating in one process:
# 39.51 / 40.52 / 40.53 / 40.60 ms against 42.05 / 43.56 / 43.30 / 44.35 ms with the same
# tiles in row-tile order (medians 40.52 against 43.43), and 38.85 / 44.14 / 39.49 against
# 41.65 / 42.29 / 42.92 ms.
_DEEPSEEK_ROWS = ExpertGemms(
    gate_up=replace(_WIDE_3, expert_columns=True),
    down=replace(_WIDE, expert_columns=True),
    d_act=replace(_WIDE_3, expert_columns=True),
    d_x=replace(_WIDE_3, expert_columns=True),
)

_MEASURED_PLANS: dict[tuple[int, int, int], list[tuple[int, ExpertGemms]]] = {
    # Qwen3-30B-A3B (512 rows per expert at 8192 tokens), one H200: the four row GEMMs on
    # Triton (session 12: the gate/up projection and the down projection's input gradient
    # moved from torch._grouped_mm). Layer forward + backward, alternating in one process:
    # 3.99 / 4.13 / 4.08 / 4.30 / 4.25 / 4.13 ms against 4.09 / 4.33 / 4.36 / 4.56 / 4.44 /
    # 4.54 ms for the session-11 plan (medians 4.13 against 4.40).
    (2048, 768, 128): [(1024, ExpertGemms(gate_up=_WIDE, down=_WIDE, d_act=_WIDE, d_x=_WIDE))],
    # DeepSeek-V3 (256 rows per expert at 8192 tokens): the down projection 488-502 against
    # 424-438 TFLOP/s, its input gradient 517-557 against 467-491 (three probes); the gate/up
    # input gradient 495-523 against 461-478 (two); the gate/up projection 530-547 against
    # 483-537 (two).
    # With every expert's rows padded to 64 (row_align), both weight gradients on the
    # unmasked aligned kernel: 4.65 and 8.76 ms against 5.47 and 9.60 ms for torch._grouped_mm
    # on the packed rows; the layer 42.44 against 43.13 ms, 40.88 against 41.38 ms and a mean
    # of 41.63 against 41.84 ms over an alternating A/B (session 10, three runs: a small gain,
    # inside the run-to-run spread).
    (7168, 2048, 256): [
        (384, replace(_DEEPSEEK_ROWS, w_down=_ALIGNED, w_gate_up=_ALIGNED, row_align=64)),
    ],
    # Mixtral-8x7B (2048 rows per expert at 8192 tokens): the whole layer on the cuBLAS loop
    # took 26.34 and 27.41 ms against 27.68 and 28.89 ms on torch._grouped_mm (two runs of
    # session 8, one H200); fewer rows per expert were not measured.
    (4096, 14336, 8): [(1023, ExpertGemms()), (1 << 62, CUBLAS_LOOP_PLAN)],
}
"""Plans measured faster than ``torch._grouped_mm`` on an H200, by ``(hidden, ffn,
experts)``: a list of ``(largest mean rows per expert, plan)`` in increasing order. The
measurements are in ``docs/benchmarks/moe.md``."""


_SLOTTED_SHAPES: dict[tuple[int, int, int], int] = {
    # DeepSeek-V3 (256 rows per expert at 8192 tokens): dropless routing padded to the largest
    # expert on batched cuBLAS GEMMs (expert_kernel="bmm", then separate autograd operations)
    # took 38.02 ms against 43.30 ms for the measured plan (session 11's final run, one H200),
    # 36.50 against 40.88 ms (session 10); its GEMMs reach 650-716 TFLOP/s on the row GEMMs at
    # equal groups against 431-524 for the grouped kernels (docs/benchmarks/moe.md).
    (7168, 2048, 256): 384,
}
"""Shapes whose dropless routing was measured faster on :data:`BATCHED_PLAN` over every expert
padded to the largest one (a host sync) than on the measured grouped plan, by ``(hidden, ffn,
experts)``: the largest mean rows per expert where that holds."""


GluonFields = tuple[tuple[str, Any], ...]
"""Fields of a :class:`~mcore_kernels.moe.gluon_wgrad.GluonWeightTiles` as ``(name, value)``
pairs (empty: the kernel's defaults)."""

_SHORT_ROWS: GluonFields = (("block_r", 32), ("stages", 6))
"""32-row chunks through 6 stages: half the wasted rows in each expert's last chunk, the same
bytes in flight as 3 stages of 64 rows."""

_GLUON_SLOT_SHAPES: dict[tuple[int, int, int], GluonFields] = {
    # DeepSeek-V3 (hidden 7168, expert width 2048, 256 experts): w_gate_up ([E, 4096, 7168])
    # over 312-320 slots, 8.89-8.96 ms against 9.36-9.45 ms for bmm (session 16, r0); the 8k
    # layer 38.05 against 40.66 ms dropless and 39.77 against 40.53 ms drop-and-pad (r2,
    # medians of five alternating windows, bitwise the same gradients). w_down stays on bmm
    # (4.40-4.46 against 4.13-4.25 ms; no layer gain).
    (4096, 7168, 256): (),
}
"""Weight-gradient shapes ``(columns of g, columns of x, experts)`` whose equal-slot GEMMs run
on the Gluon kernel, with their tiles (see :data:`GLUON_WEIGHTS`)."""

_GLUON_ALIGNED_SHAPES: dict[tuple[int, int, int], GluonFields] = {
    # DeepSeek-V3 on rows padded to 64 per expert: w_gate_up 8.18 against 9.55 ms and w_down
    # 4.04 against 4.82 ms for the aligned Triton kernel (session 16, r0).
    (4096, 7168, 256): (),
    (7168, 2048, 256): (),
}
"""Weight-gradient shapes whose GEMMs on rows padded per expert run on the Gluon kernel
instead of the aligned Triton kernel, with their tiles (see :data:`GLUON_WEIGHTS`)."""

_GLUON_PACKED_SHAPES: dict[tuple[int, int, int], GluonFields] = {
    # Qwen3-30B-A3B (hidden 2048, expert width 768, 128 experts) on packed rows (dropless, and
    # capacity routing's packed kept rows; 467-563 rows per expert at 8192 tokens), instead of
    # torch._grouped_mm, one H200 (session 17, r1; windows of 8 queued calls, medians of 4):
    # w_down ([E, 2048, 768]) 0.366 against 0.418 ms, w_gate_up ([E, 1536, 2048]) 0.727
    # against 0.906 ms (64-row chunks x 3 stages: 0.409 / 0.833). The layer, medians of nine
    # alternating windows (r2): dropless 4.166 against 4.444 ms, drop-and-pad 4.202 against
    # 4.465 ms; every gradient bitwise the same.
    (2048, 768, 128): _SHORT_ROWS,
    (1536, 2048, 128): _SHORT_ROWS,
}
"""Weight-gradient shapes whose :data:`GROUPED_MM` GEMMs (packed rows, any count per expert)
run on the Gluon kernel with masked last chunks, with their tiles (see
:data:`GLUON_WEIGHTS`)."""


_GLUON_D_ACT_SHAPES: frozenset[tuple[int, int, int]] = frozenset(
    {
        # Qwen3-30B-A3B (hidden 2048, expert width 768, 128 experts).
        (2048, 768, 128),
    }
)
"""Layer shapes ``(hidden, ffn, experts)`` whose gate/up and d_act GEMMs run with the routed
SwiGLU (backward) in their epilogues (see :data:`GLUON_GATE_UP` and :data:`GLUON_D_ACT`)."""


@functools.cache
def _gluon_ready(module: str = "gluon_wgrad") -> bool:
    """Whether ``mcore_kernels.moe.<module>`` imports (False on a Triton without Gluon's Hopper
    API)."""
    try:
        importlib.import_module(f"mcore_kernels.moe.{module}")
    except ImportError:
        return False
    return True


@functools.cache
def _tiles(fields: GluonFields) -> Any:
    from mcore_kernels.moe.gluon_wgrad import GluonWeightTiles

    return GluonWeightTiles(**dict(fields))


def _gluon_tiles(
    g: torch.Tensor,
    x: torch.Tensor,
    experts: int,
    shapes: dict[tuple[int, int, int], GluonFields],
    row_align: int = 0,
) -> Any:
    """The :class:`~mcore_kernels.moe.gluon_wgrad.GluonWeightTiles` with which the weight
    gradient ``g.T @ x`` of a shape listed in ``shapes`` runs on the Gluon kernels (rows padded
    per expert to ``row_align``: a multiple of the tiles' chunk), or None."""
    fields = shapes.get((g.shape[1], x.shape[1], experts)) if GLUON_WEIGHTS else None
    if (
        fields is None
        or g.dtype not in (torch.bfloat16, torch.float16)
        or x.dtype != g.dtype
        or not _hopper(g.device)
        or not _gluon_ready()
    ):
        return None
    tiles = GLUON_TILES if GLUON_TILES is not None else _tiles(fields)
    return None if row_align and row_align % tiles.block_r else tiles


@functools.cache
def _hopper_index(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def _hopper(device: torch.device) -> bool:
    # The capability cached per device index: the layer asks two or three times per step,
    # before its first GEMM is launched (time the GPU waits for at the start of a step).
    if device.type != "cuda":
        return False
    return _hopper_index(device.index if device.index is not None else torch.cuda.current_device())


def without_host_sync(plan: ExpertGemms) -> ExpertGemms:
    """``plan`` with every cuBLAS loop (which reads the group sizes on the host) replaced by
    ``torch._grouped_mm``.

    Args:
        plan: Any plan.

    Returns:
        A plan without host synchronisation (``plan`` itself when it has none).
    """
    loops = {name: GROUPED_MM for name in _GEMMS if getattr(plan, name) == CUBLAS_LOOP}
    return replace(plan, **cast(dict[str, Any], loops)) if loops else plan


def measured_expert_gemms(rows: int, hidden: int, ffn: int, experts: int) -> ExpertGemms:
    """The plan measured fastest on an H200 for a layer shape and row count, whatever the
    device at hand.

    Args:
        rows: Routed rows (tokens x top-k; under capacity routing the routed rows too, not
            the padded slots: the kept rows are packed).
        hidden: Hidden size.
        ffn: Inner width of each expert.
        experts: Experts held.

    Returns:
        The plan for the mean rows per expert; ``torch._grouped_mm`` for every GEMM for
        shapes not measured.
    """
    mean_rows = rows // max(experts, 1)
    for largest, plan in _MEASURED_PLANS.get((hidden, ffn, experts), ()):
        if mean_rows <= largest:
            return plan
    return ExpertGemms()


def prefers_slots(rows: int, hidden: int, ffn: int, experts: int, device: torch.device) -> bool:
    """Whether dropless routing of this shape runs faster with every expert padded to the
    largest one and :data:`BATCHED_PLAN` (measured on an H200; the padding size is read on the
    host, so never while a CUDA graph is being captured).

    Args:
        rows: Routed rows (tokens x top-k).
        hidden: Hidden size.
        ffn: Inner width of each expert.
        experts: Experts held.
        device: Device of the tokens.

    Returns:
        True on a Hopper GPU for a measured shape and row count, outside graph captures.
    """
    largest = _SLOTTED_SHAPES.get((hidden, ffn, experts))
    if largest is None or rows // max(experts, 1) > largest or not _hopper(device):
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


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
        :func:`measured_expert_gemms` on a Hopper GPU, without its cuBLAS loops while the
        current stream captures a CUDA graph (no host sync there);
        ``torch._grouped_mm`` for every GEMM elsewhere.
    """
    if not _hopper(device):
        return ExpertGemms()
    plan = measured_expert_gemms(rows, hidden, ffn, experts)
    if torch.cuda.is_current_stream_capturing():
        return without_host_sync(plan)
    return plan


def triton_expert_gemms(rows: int, hidden: int, ffn: int, experts: int) -> ExpertGemms:
    """Every expert GEMM on the persistent Triton kernels, with the tiles measured fastest on
    an H200 (flattened 128x256 row tiles; 64-row reduction chunks into 128x256 weight-gradient
    tiles), to compare them GEMM by GEMM with the other kernels.

    Args:
        rows: Routed rows (tokens x top-k).
        hidden: Hidden size.
        ffn: Inner width of each expert.
        experts: Experts held.

    Returns:
        The plan.
    """
    weight_tiles = PersistentTiles(block_m=64, block_n=128, block_k=256, num_stages=3)
    return ExpertGemms(
        gate_up=_WIDE,
        down=_WIDE,
        d_act=_WIDE,
        d_x=_WIDE,
        w_down=weight_tiles,
        w_gate_up=weight_tiles,
    )
