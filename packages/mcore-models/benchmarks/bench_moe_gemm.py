"""The six expert GEMMs of a MoE layer's forward + backward, one at a time, against dense GEMMs.

For each case of ``bench_moe.py`` the tokens are routed by a random top-k router (the group
sizes a freshly initialised layer sees) and every GEMM of the experts' forward + backward is
timed on its own with CUDA events:

- ``gate_up`` (``x @ Wgu[e].T``), ``down`` (``act @ Wd[e].T``): the forward;
- ``d_act`` (``grad @ Wd[e]``), ``d_x`` (``grad_gate_up @ Wgu[e]``): input gradients;
- ``w_down`` (``grad[rows of e].T @ act[rows of e]``), ``w_gate_up``: weight gradients, each
  written in the parameter's layout.

Implementations: ``torch._grouped_mm``, the persistent Triton grouped GEMMs of
``mcore_kernels.moe.grouped_mm`` with the tiles tuned for the shape, the plan the layer runs
(``choose_expert_gemms``: per GEMM the faster kernel, as measured by this script; on rows
padded per expert when the plan asks for it, FLOPs counted on the routed rows), a loop of cuBLAS GEMMs
over the experts (the group sizes on the host) on one stream and alternating between two,
batched cuBLAS GEMMs on equal groups of the mean size (an idealised bound: no expert gets
more rows than the mean) and padded to the largest expert (what ``expert_kernel="bmm"`` runs),
``torch._grouped_mm`` with the weights stored ``[E, K, N]``, and the dense GEMM with the same
total FLOPs (all the rows against one weight of the same shape: the dense layer's GEMM). Reports ms and TFLOP/s
per GEMM, and the persistent Triton kernels in this session's variants (``VARIANTS``: row-tile
and expert-column job orders at 3 and 4 stages; the weight gradients on the aligned kernel over
rows padded to 64 per expert). Writes ``moe_gemm.json`` and ``moe_gemm.md``. With
``--layer-ab`` each case then times ``bench_moe.py``'s dropless layer on its plan against named
candidate plans (:func:`layer_candidates`), alternating ``--ab-rounds`` times in one process,
into ``moe_gemm_layer_ab.json``.

Run from the repository root on the GPU machine::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-models/benchmarks/bench_moe_gemm.py --out $OUT/moe
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from bench_moe import CASES  # type: ignore[import-not-found]

from mcore_kernels.moe.expert_gemms import (
    ExpertGemmRunner,
    ExpertGemms,
    choose_expert_gemms,
    triton_expert_gemms,
)
from mcore_kernels.moe.grouped_mm import PersistentTiles
from mcore_kernels.moe.rows import aligned_rows

GEMMS = ("gate_up", "down", "d_act", "d_x", "w_down", "w_gate_up")
TRITON = "persistent Triton grouped GEMMs (mcore_kernels.moe.grouped_mm, tuned tiles)"
CHOSEN = "the layer's plan (choose_expert_gemms: the faster of the above per GEMM)"


def _timed(fn: Callable[[], object], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _counts(tokens: int, experts: int, top_k: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, experts, device=device, generator=generator)
    chosen = logits.topk(top_k, dim=-1).indices.reshape(-1)
    return torch.bincount(chosen, minlength=experts)


class Problem:
    """Operands of one case's expert GEMMs (tokens already in expert order)."""

    def __init__(self, case: dict[str, int], device: torch.device) -> None:
        hidden, experts, ffn = case["hidden"], case["experts"], case["ffn"]
        self.counts = _counts(case["tokens"], experts, case["top_k"], device)
        self.sizes = self.counts.tolist()
        rows = sum(self.sizes)
        self.offsets = self.counts.cumsum(0).to(torch.int32)
        ends = self.offsets
        self.bounds = (ends - self.counts.to(torch.int32), ends)
        bf16 = dict(device=device, dtype=torch.bfloat16)
        self.x = torch.randn(rows, hidden, **bf16)
        self.act = torch.randn(rows, ffn, **bf16)
        self.grad = torch.randn(rows, hidden, **bf16)
        self.grad_gu = torch.randn(rows, 2 * ffn, **bf16)
        self.w_gu = torch.empty(experts, 2 * ffn, hidden, **bf16).normal_(0.0, 0.02)
        self.w_d = torch.empty(experts, hidden, ffn, **bf16).normal_(0.0, 0.02)
        self.rows, self.hidden, self.ffn, self.experts = rows, hidden, ffn, experts

    def flops(self, gemm: str) -> float:
        per_row = {
            "gate_up": 2 * self.ffn,
            "down": self.ffn,
            "d_act": self.ffn,
            "d_x": 2 * self.ffn,
        }
        per_row.update(w_down=self.ffn, w_gate_up=2 * self.ffn)
        return 2.0 * self.rows * self.hidden * per_row[gemm]


def _grouped_mm(p: Problem) -> dict[str, Callable[[], object]]:
    gmm, offs = torch._grouped_mm, p.offsets
    return {
        "gate_up": lambda: gmm(p.x, p.w_gu.transpose(-2, -1), offs=offs),
        "down": lambda: gmm(p.act, p.w_d.transpose(-2, -1), offs=offs),
        "d_act": lambda: gmm(p.grad, p.w_d, offs=offs),
        "d_x": lambda: gmm(p.grad_gu, p.w_gu, offs=offs),
        "w_down": lambda: gmm(p.grad.t(), p.act, offs=offs),
        "w_gate_up": lambda: gmm(p.grad_gu.t(), p.x, offs=offs),
    }


def _grouped_mm_kn(p: Problem) -> dict[str, Callable[[], object]]:
    """``torch._grouped_mm`` with the weights stored ``[E, K, N]`` (row-major B in the forward
    pass) and the weight gradients computed in that layout."""
    gmm, offs = torch._grouped_mm, p.offsets
    w_gu = p.w_gu.transpose(1, 2).contiguous()
    w_d = p.w_d.transpose(1, 2).contiguous()
    return {
        "gate_up": lambda: gmm(p.x, w_gu, offs=offs),
        "down": lambda: gmm(p.act, w_d, offs=offs),
        "d_act": lambda: gmm(p.grad, w_d.transpose(-2, -1), offs=offs),
        "d_x": lambda: gmm(p.grad_gu, w_gu.transpose(-2, -1), offs=offs),
        "w_down": lambda: gmm(p.act.t(), p.grad, offs=offs),
        "w_gate_up": lambda: gmm(p.x.t(), p.grad_gu, offs=offs),
    }


def _loop_streams(p: Problem) -> dict[str, Callable[[], object]]:
    """The cuBLAS loop over experts on two CUDA streams, alternating experts (one expert's
    last partial wave of tiles overlaps the next expert's GEMM)."""
    return _loop(p, streams=(torch.cuda.Stream(), torch.cuda.Stream()))


def _loop(
    p: Problem, streams: tuple[torch.cuda.Stream, ...] = ()
) -> dict[str, Callable[[], object]]:
    starts = [0]
    for size in p.sizes:
        starts.append(starts[-1] + size)
    spans = [(e, starts[e], starts[e + 1]) for e in range(p.experts)]
    out_gu = p.x.new_empty(p.rows, 2 * p.ffn)
    out_h = p.x.new_empty(p.rows, p.hidden)
    out_f = p.x.new_empty(p.rows, p.ffn)
    g_d = torch.empty_like(p.w_d)
    g_gu = torch.empty_like(p.w_gu)

    def run(fn: Callable[[int, int, int], object]) -> Callable[[], None]:
        def go() -> None:
            if not streams:
                for e, s, t in spans:
                    fn(e, s, t)
                return
            main = torch.cuda.current_stream()
            for stream in streams:
                stream.wait_stream(main)
            for e, s, t in spans:
                with torch.cuda.stream(streams[e % len(streams)]):
                    fn(e, s, t)
            for stream in streams:
                main.wait_stream(stream)

        return go

    return {
        "gate_up": run(lambda e, s, t: torch.mm(p.x[s:t], p.w_gu[e].t(), out=out_gu[s:t])),
        "down": run(lambda e, s, t: torch.mm(p.act[s:t], p.w_d[e].t(), out=out_h[s:t])),
        "d_act": run(lambda e, s, t: torch.mm(p.grad[s:t], p.w_d[e], out=out_f[s:t])),
        "d_x": run(lambda e, s, t: torch.mm(p.grad_gu[s:t], p.w_gu[e], out=out_h[s:t])),
        "w_down": run(lambda e, s, t: torch.mm(p.grad[s:t].t(), p.act[s:t], out=g_d[e])),
        "w_gate_up": run(lambda e, s, t: torch.mm(p.grad_gu[s:t].t(), p.x[s:t], out=g_gu[e])),
    }


def _batched(p: Problem) -> dict[str, Callable[[], object]]:
    cap = p.rows // p.experts
    m = cap * p.experts

    def v(t: torch.Tensor) -> torch.Tensor:
        return t[:m].view(p.experts, cap, -1)

    return {
        "gate_up": lambda: torch.bmm(v(p.x), p.w_gu.transpose(1, 2)),
        "down": lambda: torch.bmm(v(p.act), p.w_d.transpose(1, 2)),
        "d_act": lambda: torch.bmm(v(p.grad), p.w_d),
        "d_x": lambda: torch.bmm(v(p.grad_gu), p.w_gu),
        "w_down": lambda: torch.bmm(v(p.grad).transpose(1, 2), v(p.act)),
        "w_gate_up": lambda: torch.bmm(v(p.grad_gu).transpose(1, 2), v(p.x)),
    }


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _batched_max(p: Problem) -> dict[str, Callable[[], object]]:
    """Batched cuBLAS GEMMs with every expert padded to the largest expert (rounded to 8)."""
    cap = _round_up(max(p.sizes), 8)
    bf16 = dict(device=p.x.device, dtype=p.x.dtype)
    e = p.experts
    xs = torch.randn(e, cap, p.hidden, **bf16)
    acts = torch.randn(e, cap, p.ffn, **bf16)
    grads = torch.randn(e, cap, p.hidden, **bf16)
    grad_gus = torch.randn(e, cap, 2 * p.ffn, **bf16)
    return {
        "gate_up": lambda: torch.bmm(xs, p.w_gu.transpose(1, 2)),
        "down": lambda: torch.bmm(acts, p.w_d.transpose(1, 2)),
        "d_act": lambda: torch.bmm(grads, p.w_d),
        "d_x": lambda: torch.bmm(grad_gus, p.w_gu),
        "w_down": lambda: torch.bmm(grads.transpose(1, 2), acts),
        "w_gate_up": lambda: torch.bmm(grad_gus.transpose(1, 2), xs),
    }


def _runner(p: Problem, plan: ExpertGemms) -> dict[str, Callable[[], object]]:
    """The six GEMMs as the fused routed experts run them under ``plan``."""
    run = ExpertGemmRunner(plan, p.offsets, p.rows)
    return {
        "gate_up": lambda: run.gate_up(p.x, p.w_gu),
        "down": lambda: run.down(p.act, p.w_d),
        "d_act": lambda: run.d_act(p.grad, p.w_d),
        "d_x": lambda: run.d_x(p.grad_gu, p.w_gu),
        "w_down": lambda: run.w_down(p.grad, p.act),
        "w_gate_up": lambda: run.w_gate_up(p.grad_gu, p.x),
    }


def _triton(p: Problem) -> dict[str, Callable[[], object]]:
    return _runner(p, triton_expert_gemms(p.rows, p.hidden, p.ffn, p.experts))


def _chosen(p: Problem) -> dict[str, Callable[[], object]]:
    plan = choose_expert_gemms(p.rows, p.hidden, p.ffn, p.experts, p.x.device)
    if plan.row_align > 1:
        return _padded(p, plan)
    return _runner(p, plan)


def _padded(p: Problem, plan: ExpertGemms) -> dict[str, Callable[[], object]]:
    """The six GEMMs of ``plan`` on rows padded per expert to ``plan.row_align`` (empty rows
    are zero), as the dispatcher lays them out for such a plan."""
    experts = torch.repeat_interleave(torch.arange(p.experts, device=p.x.device), p.counts)
    order = torch.arange(p.rows, device=p.x.device)
    compact, _, offsets = aligned_rows(experts, order, p.counts, plan.row_align)
    used = (compact >= 0)[:, None]
    source = torch.where(compact >= 0, compact, 0)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, source) * used

    padded = Problem.__new__(Problem)
    padded.x, padded.act, padded.grad, padded.grad_gu = (
        pad(p.x),
        pad(p.act),
        pad(p.grad),
        pad(p.grad_gu),
    )
    padded.w_gu, padded.w_d, padded.offsets = p.w_gu, p.w_d, offsets
    padded.rows = compact.shape[0]
    return _runner(padded, plan)


_ROW_GEMMS = ("gate_up", "down", "d_act", "d_x")
_WEIGHT_GEMMS = ("w_down", "w_gate_up")
_TRITON_ROWS = PersistentTiles(block_m=128, block_n=256, block_k=64, num_stages=4, flatten=True)
_TRITON_WEIGHTS = PersistentTiles(block_m=64, block_n=128, block_k=256, num_stages=3)

VARIANTS: dict[str, tuple[PersistentTiles, PersistentTiles]] = {
    "Triton base (rows: flattened 128x256, 4 stages; weights: aligned 128x256, 3 stages)": (
        _TRITON_ROWS,
        _TRITON_WEIGHTS,
    ),
    "Triton, rows 3 stages": (replace(_TRITON_ROWS, num_stages=3), _TRITON_WEIGHTS),
    "Triton, rows in expert-column job order": (
        replace(_TRITON_ROWS, expert_columns=True),
        _TRITON_WEIGHTS,
    ),
    "Triton, rows in expert-column job order, 3 stages": (
        replace(_TRITON_ROWS, expert_columns=True, num_stages=3),
        _TRITON_WEIGHTS,
    ),
}
"""Kernel variants of this session (rows on packed rows, weight gradients on rows padded to
64 per expert), named for the table: (row-GEMM tiles, weight-gradient tiles)."""


def _variant(
    p: Problem, rows: PersistentTiles, weights: PersistentTiles
) -> dict[str, Callable[[], object]]:
    """The four row GEMMs on ``rows`` (packed rows) and the two weight gradients on
    ``weights`` (rows padded to 64 per expert, the unmasked aligned kernel)."""
    plan = ExpertGemms(**dict.fromkeys(_ROW_GEMMS, rows), **dict.fromkeys(_WEIGHT_GEMMS, weights))
    packed = _runner(p, plan)
    padded = _padded(p, replace(plan, row_align=64))
    return {gemm: packed[gemm] if gemm in _ROW_GEMMS else padded[gemm] for gemm in GEMMS}


def _dense(p: Problem) -> dict[str, Callable[[], object]]:
    gu, d = p.w_gu[0], p.w_d[0]
    return {
        "gate_up": lambda: p.x @ gu.t(),
        "down": lambda: p.act @ d.t(),
        "d_act": lambda: p.grad @ d,
        "d_x": lambda: p.grad_gu @ gu,
        "w_down": lambda: p.grad.t() @ p.act,
        "w_gate_up": lambda: p.grad_gu.t() @ p.x,
    }


def run_case(
    name: str,
    case: dict[str, int],
    reps: int,
    emit: Callable[[list[dict]], None] | None = None,
    only: list[str] | None = None,
) -> list[dict]:
    """Time every GEMM of one case with every implementation.

    Args:
        name: Case name.
        case: Shapes (hidden, experts, top_k, ffn, tokens).
        reps: Timed repetitions per GEMM.
        emit: Called with the rows so far after every implementation.
        only: Implementations whose name contains one of these words (default: all).

    Returns:
        One row per (implementation, GEMM).
    """
    device = torch.device("cuda")
    p = Problem(case, device)
    impls: dict[str, Callable[[Problem], dict]] = {
        "dense (same FLOPs)": _dense,
        "torch._grouped_mm": _grouped_mm,
        "torch._grouped_mm, [E, K, N] weights": _grouped_mm_kn,
        "bmm, equal groups": _batched,
        "bmm, padded to the largest expert": _batched_max,
        TRITON: _triton,
        CHOSEN: _chosen,
    }
    for label, (rows_tiles, weight_tiles) in VARIANTS.items():
        impls[label] = lambda q, r=rows_tiles, w=weight_tiles: _variant(q, r, w)
    if case["experts"] <= 16:
        impls["cuBLAS loop over experts"] = _loop
        impls["cuBLAS loop over experts, two streams"] = _loop_streams
    if only:
        impls = {key: value for key, value in impls.items() if any(w in key for w in only)}
    rows = []
    imbalance = max(p.sizes) / (p.rows / p.experts)
    for impl, make in impls.items():
        begin = time.perf_counter()
        try:
            fns = make(p)
        except Exception as exc:
            rows.append({"case": name, "impl": impl, "error": repr(exc)[:200]})
            continue
        for gemm in fns:
            row = {"case": name, "impl": impl, "gemm": gemm, "imbalance": imbalance}
            try:
                ms = _timed(fns[gemm], reps)
                row.update(ms=ms, tflops=p.flops(gemm) / ms / 1e9)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                traceback.print_exc()
            rows.append(row)
        print(f"{name}: {impl}: {time.perf_counter() - begin:.1f} s", flush=True)
        if emit is not None:
            emit(rows)
    return rows


def best_plan(case: dict[str, int], rows: list[dict]) -> ExpertGemms:
    """Per GEMM the fastest of the layer's plan and the Triton variants in ``rows``; the rows
    padded to 64 per expert when a weight gradient runs on a variant's aligned kernel.

    Args:
        case: Shapes (hidden, experts, top_k, ffn, tokens).
        rows: This case's rows of :func:`run_case`.

    Returns:
        The plan.
    """
    routed = case["tokens"] * case["top_k"]
    plan = choose_expert_gemms(
        routed, case["hidden"], case["ffn"], case["experts"], torch.device("cuda")
    )
    kernels: dict[str, tuple[float, object]] = {}
    for row in rows:
        if "ms" not in row:
            continue
        if row["impl"] == CHOSEN:
            kernel: object = getattr(plan, row["gemm"])
        elif row["impl"] in VARIANTS:
            rows_tiles, weight_tiles = VARIANTS[row["impl"]]
            kernel = rows_tiles if row["gemm"] in _ROW_GEMMS else weight_tiles
        else:
            continue
        if row["gemm"] not in kernels or row["ms"] < kernels[row["gemm"]][0]:
            kernels[row["gemm"]] = (row["ms"], kernel)
    fields = {gemm: kernel for gemm, (_, kernel) in kernels.items()}
    best = replace(plan, **fields)  # type: ignore[arg-type]
    aligned = any(isinstance(getattr(best, gemm), PersistentTiles) for gemm in _WEIGHT_GEMMS)
    return replace(best, row_align=64 if aligned else 1)


DENSE_LAYER = "dense SwiGLU layer of equal active parameters (fused gate/up, fused SwiGLU)"


def layer_ab(
    name: str, case: dict[str, int], candidates: dict[str, ExpertGemms], rounds: int = 4
) -> dict[str, object]:
    """Forward + backward of ``bench_moe.py``'s dropless layer on the shape's plan against
    each of ``candidates``, alternating ``rounds`` times in one process (one layer, its plan
    switched between timings), and of the dense layer of equal active parameters.

    Args:
        name: Case name.
        case: Shapes.
        candidates: Plans to compare, by name.
        rounds: Alternations.

    Returns:
        ``{"case", "plans": {name: repr}, "ms": {name: [ms per round]}}`` (``"plan"``: the
        shape's plan; :data:`DENSE_LAYER`: the dense layer).
    """
    from bench_moe import _dense_fused, _moe, _time  # type: ignore[import-not-found]

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(
        case["tokens"], case["hidden"], device=device, dtype=torch.bfloat16, generator=generator
    )
    grad = torch.randn_like(x)
    layer = _moe(case, device)
    dense = _dense_fused(case, device)
    plans: dict[str, ExpertGemms | None] = {"plan": None, **candidates}
    times: dict[str, list[float]] = {label: [] for label in plans}
    times[DENSE_LAYER] = []
    for _ in range(rounds):
        times[DENSE_LAYER].append(_time(dense, x.detach().clone(), grad, 2, 6))
        for label, plan in plans.items():
            layer.experts.gemm_plan = plan
            times[label].append(_time(layer, x.detach().clone(), grad, 2, 6))
    print(f"{name}: layer A/B {times}", flush=True)
    return {"case": name, "plans": {k: repr(v) for k, v in plans.items()}, "ms": times}


def _plan_of(case: dict[str, int]) -> ExpertGemms:
    routed = case["tokens"] * case["top_k"]
    return choose_expert_gemms(
        routed, case["hidden"], case["ffn"], case["experts"], torch.device("cuda")
    )


def _rows_on(plan: ExpertGemms, expert_columns: bool, default: PersistentTiles) -> ExpertGemms:
    """``plan`` with every row GEMM on Triton (its own tiles, else ``default``) in the given
    job order."""
    fields = {}
    for gemm in _ROW_GEMMS:
        kernel = getattr(plan, gemm)
        tiles = kernel if isinstance(kernel, PersistentTiles) else default
        fields[gemm] = replace(tiles, expert_columns=expert_columns)
    return replace(plan, **fields)  # type: ignore[arg-type]


def layer_candidates(case: dict[str, int], rows: list[dict]) -> dict[str, ExpertGemms]:
    """Plans to time against the shape's plan at layer level (those equal to it left out).

    Args:
        case: Shapes.
        rows: This case's rows of :func:`run_case`.

    Returns:
        By name: the plan's Triton row GEMMs in row-tile order and at 4 stages, every row GEMM
        on Triton (flattened 128x256, 4 stages; 3 stages from 1024 rows per
        expert) in either order, and the fastest kernel per GEMM of ``rows``.
    """
    plan = _plan_of(case)
    rows_per_expert = case["tokens"] * case["top_k"] // case["experts"]
    default = replace(_TRITON_ROWS, num_stages=3) if rows_per_expert >= 1024 else _TRITON_ROWS
    in_row_order = {
        gemm: replace(kernel, expert_columns=False)
        for gemm in _ROW_GEMMS
        if isinstance(kernel := getattr(plan, gemm), PersistentTiles)
    }
    at_four_stages = {
        gemm: replace(kernel, num_stages=4)
        for gemm in _ROW_GEMMS
        if isinstance(kernel := getattr(plan, gemm), PersistentTiles)
    }
    candidates = {
        "plan's Triton rows in row-tile order": replace(plan, **in_row_order),  # type: ignore[arg-type]
        "plan's Triton rows at 4 stages": replace(plan, **at_four_stages),  # type: ignore[arg-type]
        "every row GEMM on Triton, row-tile order": _rows_on(plan, False, default),
        "every row GEMM on Triton, expert-column order": _rows_on(plan, True, default),
        "fastest per GEMM of this run": best_plan(case, rows),
    }
    unique: dict[str, ExpertGemms] = {}
    for name, candidate in candidates.items():
        if candidate != plan and candidate not in unique.values():
            unique[name] = candidate
    return unique


def _markdown(device_name: str, rows: list[dict]) -> str:
    lines = [
        f"Expert GEMMs (forward + backward) on {device_name}, bf16, random top-k routing",
        "",
        "| case | implementation | " + " | ".join(GEMMS) + " | total ms | TFLOP/s |",
        "|---|---|" + "---|" * (len(GEMMS) + 2),
    ]
    table: dict[tuple[str, str], dict[str, dict]] = {}
    for row in rows:
        if "gemm" in row:
            table.setdefault((row["case"], row["impl"]), {})[row["gemm"]] = row
    for (case, impl), cells in table.items():
        parts = []
        total, flops, ok = 0.0, 0.0, True
        for gemm in GEMMS:
            cell = cells.get(gemm, {})
            if "ms" in cell:
                parts.append(f"{cell['ms']:.3f} ({cell['tflops']:.0f})")
                total += cell["ms"]
                flops += cell["tflops"] * cell["ms"]
            else:
                parts.append("err")
                ok = False
        summary = f"{total:.3f} | {flops / total:.0f}" if ok and total else " | "
        lines.append(f"| {case} | {impl} | " + " | ".join(parts) + f" | {summary} |")
    lines.append("")
    lines.append("Cells: ms (TFLOP/s). Total TFLOP/s is the FLOP-weighted mean.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the GEMM table and write ``moe_gemm.json`` / ``moe_gemm.md`` under ``--out``.

    Args:
        argv: Command-line arguments (default ``sys.argv``).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--cases",
        nargs="*",
        choices=list(CASES),
        help="case names, run in this order (default: all)",
    )
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per GEMM")
    parser.add_argument(
        "--only", nargs="*", help="implementations containing one of these words (default: all)"
    )
    parser.add_argument(
        "--ab-rounds", type=int, default=4, help="alternations of the layer A/B (default 4)"
    )
    parser.add_argument(
        "--layer-ab",
        action="store_true",
        help="after each case, time the dropless layer on its plan against the fastest kernel "
        "per GEMM of this run (alternating, moe_gemm_layer_ab.json)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name()
    rows: list[dict] = []

    def write(case_rows: list[dict]) -> None:
        every = rows + case_rows
        result = {"device": device_name, "torch": torch.__version__, "rows": every}
        (out / "moe_gemm.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "moe_gemm.md").write_text(_markdown(device_name, every))

    ab: list[dict[str, object]] = []
    for name in args.cases or list(CASES):
        case_rows = run_case(name, CASES[name], args.reps, write, args.only)
        rows.extend(case_rows)
        torch.cuda.empty_cache()
        if args.layer_ab:
            candidates = layer_candidates(CASES[name], case_rows)
            try:
                ab.append(layer_ab(name, CASES[name], candidates, args.ab_rounds))
            except Exception as exc:  # reported, not fatal
                ab.append({"case": name, "error": f"{type(exc).__name__}: {exc}"})
                traceback.print_exc()
            (out / "moe_gemm_layer_ab.json").write_text(json.dumps(ab, indent=2) + "\n")
            torch.cuda.empty_cache()
    print(_markdown(device_name, rows), flush=True)


if __name__ == "__main__":
    main()
