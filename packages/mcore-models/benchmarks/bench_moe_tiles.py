"""Tile sweep of the persistent Triton grouped GEMMs, per expert GEMM and layer shape.

For the fine-grained cases of ``bench_moe.py`` (Qwen3-30B-A3B, DeepSeek-V3 at 8192 tokens)
the tokens are routed by the random top-k router of ``bench_moe_gemm.py`` and each expert GEMM
is timed with a short list of tile configurations of
:class:`~mcore_kernels.moe.grouped_mm.PersistentTiles` (row tiles: height, width, pipelining
depth, flattened loops; weight gradients: row chunk, tile, pipelining depth), next to
``torch._grouped_mm``, batched cuBLAS GEMMs on equal groups (no partial tile: a bound) and the
dense GEMM of the same FLOPs. Rows are packed, or padded to 64 per expert (``aligned_rows``, as
the layer's plan lays them out when it asks for ``row_align``); FLOPs are counted on the routed
rows. The winners are written into
``mcore_kernels.moe.expert_gemms`` by hand: nothing is tuned at run time.

Writes ``moe_tiles.json`` and ``moe_tiles.md`` under ``--out`` after every row and stops
starting new rows after ``--budget`` seconds.

Run from the repository root on the GPU machine::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:):packages/mcore-models/benchmarks
    python3 packages/mcore-models/benchmarks/bench_moe_tiles.py --out $OUT/moe
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from bench_moe import CASES  # type: ignore[import-not-found]
from bench_moe_gemm import (  # type: ignore[import-not-found]
    Problem,
    _batched,
    _dense,
    _grouped_mm,
    _runner,
    _timed,
)

from mcore_kernels.moe.expert_gemms import ExpertGemms
from mcore_kernels.moe.grouped_mm import PersistentTiles
from mcore_kernels.moe.rows import aligned_rows

ROW_GEMMS = ("gate_up", "down", "d_act", "d_x")
WEIGHT_GEMMS = ("w_down", "w_gate_up")


def _t(**fields: object) -> PersistentTiles:
    return PersistentTiles(**fields)  # type: ignore[arg-type]


ROW_TILES = {
    "128x256 s3 flat": _t(block_m=128, block_n=256, block_k=64, num_stages=3, flatten=True),
    "128x256 s4 flat": _t(block_m=128, block_n=256, block_k=64, num_stages=4, flatten=True),
    "64x256 w4 s4": _t(block_m=64, block_n=256, block_k=64, num_warps=4, num_stages=4),
    "64x128 w4 s5": _t(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=5),
}

WEIGHT_TILES = {
    "64/128x256 s3": _t(block_m=64, block_n=128, block_k=256, num_stages=3),
    "64/256x128 s3": _t(block_m=64, block_n=256, block_k=128, num_stages=3),
    "32/128x256 s5": _t(block_m=32, block_n=128, block_k=256, num_stages=5),
    "64/128x128 w4 s4": _t(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4),
}


def _pad(p: Problem, align: int) -> Problem:
    """``p`` with every expert's rows padded to a multiple of ``align`` (empty rows zero), as
    the dispatcher lays them out for a plan with ``row_align``."""
    experts = torch.repeat_interleave(torch.arange(p.experts, device=p.x.device), p.counts)
    order = torch.arange(p.rows, device=p.x.device)
    compact, _, offsets = aligned_rows(experts, order, p.counts, align)
    used = (compact >= 0)[:, None]
    source = torch.where(compact >= 0, compact, 0)
    padded = Problem.__new__(Problem)
    for name in ("x", "act", "grad", "grad_gu"):
        setattr(padded, name, getattr(p, name).index_select(0, source) * used)
    padded.w_gu, padded.w_d, padded.offsets = p.w_gu, p.w_d, offsets
    padded.rows = compact.shape[0]
    return padded


Job = tuple[str, str, str, int, Callable[[], Callable[[], object]], dict, Problem | None]


def _jobs(name: str, p: Problem, align: int, with_base: bool) -> list[Job]:
    """Rows of one case on rows packed (``align`` 1) or padded per expert."""
    jobs: list[Job] = []
    if with_base:
        for label, fns in (
            ("dense", _dense(p)),
            ("torch._grouped_mm", _grouped_mm(p)),
            ("bmm equal groups", _batched(p)),
        ):
            for gemm in ROW_GEMMS + WEIGHT_GEMMS:
                jobs.append((name, gemm, label, 1, lambda f=fns, g=gemm: f[g], {}, None))
    rows_p = _pad(p, align) if align > 1 else p
    for gemm in ROW_GEMMS:
        for label, tiles in ROW_TILES.items():
            plan = ExpertGemms(**{gemm: tiles})  # type: ignore[arg-type]
            make = lambda g=gemm, pl=plan: _runner(rows_p, pl)[g]  # noqa: E731
            jobs.append((name, gemm, label, align, make, asdict(tiles), rows_p))
    if align > 1:
        for gemm in WEIGHT_GEMMS:
            for label, tiles in WEIGHT_TILES.items():
                plan = ExpertGemms(**{gemm: tiles}, row_align=align)  # type: ignore[arg-type]
                make = lambda g=gemm, pl=plan: _runner(rows_p, pl)[g]  # noqa: E731
                jobs.append((name, gemm, label, align, make, asdict(tiles), rows_p))
    return jobs


def _error(fn: Callable[[], object], p: Problem, gemm: str) -> float:
    """Largest difference to ``torch._grouped_mm`` on the same rows, relative to its largest
    magnitude (rows of the row GEMMs past the last expert are not compared)."""
    got = fn()
    want = _grouped_mm(p)[gemm]()
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    if gemm in ROW_GEMMS:
        end = int(p.offsets[-1])
        got, want = got[:end], want[:end]
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def run(
    cases: list[str], budget: float, reps: int, emit: Callable[[list[dict]], None]
) -> list[dict]:
    """Time every (case, GEMM, kernel) row until ``budget`` seconds have passed.

    DeepSeek-V3 on rows padded to 64 and Qwen3 on packed rows (what the layer runs) first,
    then the other layout of each.

    Args:
        cases: Case names of ``bench_moe.CASES``.
        budget: Seconds after which no new row starts.
        reps: Timed repetitions per row.
        emit: Called with all rows after every row.

    Returns:
        The rows.
    """
    begin = time.perf_counter()
    rows: list[dict] = []
    device = torch.device("cuda")
    problems = {name: Problem(CASES[name], device) for name in cases}
    order = [(name, 64 if name.startswith("deepseek") else 1, True) for name in cases]
    order += [(name, 1 if name.startswith("deepseek") else 64, False) for name in cases]
    for name, align, with_base in order:
        p = problems[name]
        for case, gemm, label, row_align, make, tiles_fields, rows_p in _jobs(
            name, p, align, with_base
        ):
            if time.perf_counter() - begin > budget:
                print(f"budget of {budget:.0f} s spent: stopping", flush=True)
                return rows
            row: dict = {"case": case, "gemm": gemm, "kernel": label, "row_align": row_align}
            if tiles_fields:
                row["tiles"] = tiles_fields
            try:
                fn = make()
                ms = _timed(fn, reps)
                row.update(ms=ms, tflops=p.flops(gemm) / ms / 1e9)
                if rows_p is not None:
                    row["rel_err"] = _error(fn, rows_p, gemm)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            shown = (
                f"{row['ms']:.3f} ms {row['tflops']:.0f} TF err {row.get('rel_err', 0):.1e}"
                if "ms" in row
                else row["error"]
            )
            elapsed = time.perf_counter() - begin
            print(
                f"[{elapsed:5.1f} s] {case} {gemm} [{label}, rows/{row_align}]: {shown}", flush=True
            )
            emit(rows)
    return rows


def markdown(device_name: str, rows: list[dict]) -> str:
    """Per case and GEMM: every kernel's ms (TFLOP/s) and the best Triton tile.

    Args:
        device_name: GPU name.
        rows: Rows of :func:`run`.

    Returns:
        The Markdown table.
    """
    lines = [
        f"Grouped GEMM tile sweep on {device_name}, bf16, random top-k routing",
        "",
        "| case | GEMM | kernel | rows padded to | ms | TFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cell = (
            f"{row['ms']:.3f} | {row['tflops']:.0f}"
            if "ms" in row
            else f"error | {row['error'][:60]}"
        )
        lines.append(
            f"| {row['case']} | {row['gemm']} | {row['kernel']} | {row['row_align']} | {cell} |"
        )
    lines += ["", "Best Triton tile per case and GEMM:", ""]
    best: dict[tuple[str, str], dict] = {}
    for row in rows:
        if "ms" in row and "tiles" in row:
            key = (row["case"], row["gemm"])
            if key not in best or row["ms"] < best[key]["ms"]:
                best[key] = row
    for (case, gemm), row in best.items():
        lines.append(
            f"- {case} {gemm}: {row['kernel']} (rows padded to {row['row_align']}) "
            f"{row['ms']:.3f} ms, {row['tflops']:.0f} TFLOP/s"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the sweep and write ``moe_tiles.json`` / ``moe_tiles.md`` under ``--out``.

    Args:
        argv: Command-line arguments (default ``sys.argv``).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--cases", nargs="*", default=["deepseek-v3", "qwen3-30b-a3b"], choices=list(CASES)
    )
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for new rows")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per row")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name()

    def write(rows: list[dict]) -> None:
        result = {"device": device_name, "torch": torch.__version__, "rows": rows}
        (out / "moe_tiles.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "moe_tiles.md").write_text(markdown(device_name, rows))

    rows = run(args.cases, args.budget, args.reps, write)
    write(rows)
    print(markdown(device_name, rows), flush=True)


if __name__ == "__main__":
    main()
