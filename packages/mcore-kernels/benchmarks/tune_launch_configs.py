"""Sweep the launch parameters of the mcore-kernels Triton kernels on one GPU.

For add + RMSNorm it times the forward and the backward launchers (no autograd) of every
candidate :class:`~mcore_kernels.rms_norm.RMSNormLaunch` at each hidden size of the benchmark
table and the row counts 1, 256, 4096, 8192 and 16384, as GPU time under CUDA graph replay over
enough input copies that every call reads from memory (no host launch cost, no L2 reuse).
Per hidden size the forward takes the (rows per program, warps) with the least geometric mean
of time / fastest time over the row counts, then the number of programs sharing a one-row call
the fastest at one row; the backward takes its layout (rows per iteration,
warps) the same way, each layout scored by its best grid at each row count, then that layout's
grid cap (programs per SM) and pipelining depth by the same rule. The number of rows never
picks the warps: they fix how a row is spread over the threads, hence the order of its
reductions, which keeps every row's result independent of the batch (the kernels shrink a row
block to the call's rows, which repeats the same row layout). For token log-probs it sweeps the vocabulary chunk, warps and
pipelining depth. Writes ``launch_configs.json`` and ``launch_configs.md``, whose "chosen" rows
are what ``LAUNCH_CONFIGS`` in ``rms_norm.py`` and ``_block_and_warps`` in ``token_logprobs.py``
hold.

Usage: ``python3 packages/mcore-kernels/benchmarks/tune_launch_configs.py --out DIR``
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _common import device_info, graph_us, input_sets, markdown_table, write_results
from triton.testing import do_bench

# The package exports functions named like these modules: fetch the modules themselves.
rms = importlib.import_module("mcore_kernels.rms_norm")
lp = importlib.import_module("mcore_kernels.token_logprobs")


HIDDEN = (2048, 4096, 8192)
ROWS = (1, 256, 4096, 8192, 16384)
EPS = 1e-6


def _us(make_calls) -> float | None:
    try:
        return graph_us(make_calls)
    except Exception as exc:  # a candidate that does not compile (shared memory, registers)
        print(f"skipped: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return None


def _ms(fn) -> float:
    return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))


def _timed(fn) -> float | None:
    try:
        return _ms(fn)
    except Exception as exc:  # a candidate that does not compile (shared memory, registers)
        print(f"skipped: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return None


def _choose(times: dict[Any, dict[int, float | None]]) -> tuple[Any, float]:
    """Candidate with the least geometric mean of time / fastest time over the row counts."""
    rows = {r for per_rows in times.values() for r in per_rows}
    best = {r: min(t[r] for t in times.values() if t.get(r) is not None) for r in rows}
    scores = {
        cand: math.exp(sum(math.log(t[r] / best[r]) for r in rows) / len(rows))
        for cand, t in times.items()
        if all(t.get(r) is not None for r in rows)
    }
    chosen = min(scores, key=scores.__getitem__)
    return chosen, scores[chosen]


def layouts(hidden: int, row_choices: tuple[int, ...], warp_choices: tuple[int, ...]):
    """(rows, warps) pairs giving each thread 8 to 64 elements of the tile."""
    return [(r, w) for r in row_choices for w in warp_choices if 8 <= r * hidden / (w * 32) <= 64]


def sweep_rms(entries: list[dict], chosen: list[list[Any]]) -> None:
    """Forward: (rows, warps) per hidden size. Backward: the layout (rows, warps) per hidden
    size, then its grid cap (programs per SM) and pipelining depth."""
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    for hidden in HIDDEN:
        fwd: dict[tuple, dict[int, float | None]] = {}
        bwd: dict[tuple, dict[int, float | None]] = {}
        for rows in ROWS:
            bytes_per_call = 4 * rows * hidden * 2
            sets = []
            for _ in range(input_sets(bytes_per_call)):
                x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
                r, dy, dh = (torch.randn_like(x) for _ in range(3))
                w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
                _, h, _ = rms._forward(x, w, EPS, r, True)
                sets.append((x, r, w, dy, dh, h))
            for fwd_rows, warps in layouts(hidden, (1, 2, 4), (2, 4, 8, 16, 32)):
                cfg = rms.RMSNormLaunch(
                    fwd_rows=fwd_rows,
                    fwd_warps=warps,
                    bwd_rows=1,
                    bwd_warps=4,
                    bwd_programs_per_sm=1,
                    bwd_stages=1,
                )
                fwd.setdefault((fwd_rows, warps), {})[rows] = _us(
                    lambda cfg=cfg, sets=sets: [
                        partial(rms._forward, x, w, EPS, r, False, cfg) for x, r, w, *_ in sets
                    ]
                )
            for (bwd_rows, warps), per_sm, stages in itertools.product(
                layouts(hidden, (1, 2, 4, 8), (4, 8, 16, 32)), (1, 2, 4, 8), (1, 2, 3)
            ):
                blocks = -(-rows // bwd_rows)
                if (per_sm > 1 and blocks <= multiprocessors * per_sm // 2) or (
                    blocks == 1 and stages > 1
                ):
                    continue  # the same launch as a smaller candidate
                cfg = rms.RMSNormLaunch(
                    fwd_rows=1,
                    fwd_warps=4,
                    bwd_rows=bwd_rows,
                    bwd_warps=warps,
                    bwd_programs_per_sm=per_sm,
                    bwd_stages=stages,
                )
                bwd.setdefault((bwd_rows, warps, per_sm, stages), {})[rows] = _us(
                    lambda cfg=cfg, sets=sets: [
                        partial(rms._backward, dy, dh, h, w, None, EPS, cfg)
                        for _, _, w, dy, dh, h in sets
                    ]
                )
            sets = []
        for kind, times, names in (
            ("rms_fwd", fwd, ("rows", "warps")),
            ("rms_bwd", bwd, ("rows", "warps", "programs_per_sm", "stages")),
        ):
            for cand, per_rows in times.items():
                for rows, us in per_rows.items():
                    entries.append(
                        {
                            "kernel": kind,
                            "shape": f"{rows}x{hidden}",
                            **dict(zip(names, cand, strict=True)),
                            "us": us,
                        }
                    )
        best, score = _choose(fwd)
        chosen.append(["rms_fwd", hidden, f"rows={best[0]}, warps={best[1]}", score])
        sweep_one_row(hidden, best, entries, chosen)
        sweep_register_cap(hidden, best, entries, chosen)
        # The layout must not depend on the number of rows (batch invariance): per layout, the
        # best grid and depth at each row count, then the layout of least geometric mean.
        per_layout: dict[tuple, dict[int, float | None]] = {}
        for (bwd_rows, warps, _, _), per_rows in bwd.items():
            slot = per_layout.setdefault((bwd_rows, warps), {})
            for rows, us in per_rows.items():
                if us is not None and (slot.get(rows) is None or us < slot[rows]):
                    slot[rows] = us
        layout, score = _choose(per_layout)
        grids = {cand[2:]: t for cand, t in bwd.items() if cand[:2] == layout}
        # Skipped duplicates take the time of the smaller candidate they equal.
        for (per_sm, stages), t in grids.items():
            for rows in ROWS:
                if t.get(rows) is None:
                    t[rows] = min(
                        (
                            u[rows]
                            for (p, s), u in grids.items()
                            if u.get(rows) is not None and p <= per_sm and s <= stages
                        ),
                        default=None,
                    )
        grid, grid_score = _choose(grids)
        chosen.append(
            [
                "rms_bwd",
                hidden,
                f"rows={layout[0]}, warps={layout[1]}, programs_per_sm={grid[0]}, stages={grid[1]}",
                score * grid_score,
            ]
        )
        print("rms", hidden, chosen[-2:], flush=True)


def _forward_sets(rows: int, hidden: int) -> list[tuple[torch.Tensor, ...]]:
    """Enough bf16 ``(x, residual, weight)`` input sets of ``rows x hidden`` that a cycle
    through them reads from memory, not L2."""
    sets = []
    for _ in range(input_sets(4 * rows * hidden * 2)):
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
        sets.append((x, torch.randn_like(x), w))
    return sets


def _forward_launch(layout: tuple[int, int], **fields: int) -> rms.RMSNormLaunch:
    """A launch configuration timed forward only: the forward ``layout`` (rows, warps) and
    ``fields``, the backward fields at their smallest."""
    fwd_rows, fwd_warps = layout
    return rms.RMSNormLaunch(
        fwd_rows=fwd_rows,
        fwd_warps=fwd_warps,
        bwd_rows=1,
        bwd_warps=4,
        bwd_programs_per_sm=1,
        bwd_stages=1,
        **fields,
    )


def sweep_one_row(
    hidden: int, layout: tuple[int, int], entries: list[dict], chosen: list[list[Any]]
) -> None:
    """The one-row forward of a chosen layout: how many programs share the row (each reduces
    the whole row with the layout, the same bits, and stores its share), timed at one bf16 row;
    the fastest is kept."""
    sets = _forward_sets(1, hidden)
    times: dict[int, float] = {}
    for programs in (1, 2, 4, 8):
        cfg = _forward_launch(layout, row_programs=programs)
        us = _us(
            lambda cfg=cfg: [partial(rms._forward, x, w, EPS, r, False, cfg) for x, r, w in sets]
        )
        entries.append(
            {
                "kernel": "rms_fwd_one_row",
                "shape": f"1x{hidden}",
                "row_programs": programs,
                "us": us,
            }
        )
        if us is not None:
            times[programs] = us
    if times:
        best = min(times, key=times.__getitem__)
        # Score: the chosen time over one program's (below 1.0: sharing the row wins).
        own = times.get(1)
        chosen.append(
            ["rms_fwd_one_row", hidden, f"row_programs={best}", times[best] / own if own else 1.0]
        )


REGISTER_CAPS = (0, 48, 64, 80)
"""ptxas register caps of the specialised forward timed per chosen layout (0: none)."""


def sweep_register_cap(
    hidden: int, layout: tuple[int, int], entries: list[dict], chosen: list[list[Any]]
) -> None:
    """The specialised forward of a chosen layout under each register cap (another schedule,
    the same arithmetic), timed at 256, 4096 and 16384 bf16 rows; the cap of least geometric
    mean of time / fastest time is kept."""
    times: dict[int, dict[int, float | None]] = {cap: {} for cap in REGISTER_CAPS}
    for rows in (256, 4096, 16384):
        sets = _forward_sets(rows, hidden)
        for cap in REGISTER_CAPS:
            cfg = _forward_launch(layout, fwd_max_registers=cap)
            us = _us(
                lambda cfg=cfg, sets=sets: [
                    partial(rms._forward, x, w, EPS, r, False, cfg) for x, r, w in sets
                ]
            )
            times[cap][rows] = us
            entries.append(
                {
                    "kernel": "rms_fwd_register_cap",
                    "shape": f"{rows}x{hidden}",
                    "fwd_max_registers": cap,
                    "us": us,
                }
            )
        sets = []
    if all(all(t is not None for t in per_rows.values()) for per_rows in times.values()):
        best, score = _choose(times)
        chosen.append(["rms_fwd_register_cap", hidden, f"fwd_max_registers={best}", score])


def sweep_logprobs(entries: list[dict], chosen: list[list[Any]]) -> None:
    shapes = ((1024, 151936), (8192, 151936), (8192, 50257))
    fwd: dict[tuple, dict[int, float | None]] = {}
    bwd: dict[tuple, dict[int, float | None]] = {}
    for index, (rows, vocab) in enumerate(shapes):
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
        targets = torch.randint(0, vocab, (rows,), device="cuda")
        _, _, lse, _ = lp._forward(logits, targets, 1.0, None, False, -100)
        grad = torch.randn(rows, device="cuda")
        for block, warps, stages in itertools.product((1024, 2048, 4096), (4, 8, 16), (1,)):
            fwd.setdefault((block, warps, stages), {})[index] = _timed(
                partial(
                    lp._forward, logits, targets, 1.0, None, False, -100, (block, warps, stages)
                )
            )
        for block, warps in itertools.product((1024, 2048, 4096), (4, 8, 16)):
            bwd.setdefault((block, warps), {})[index] = _timed(
                partial(
                    lp._backward,
                    grad,
                    None,
                    logits,
                    targets,
                    lse,
                    lse,
                    1.0,
                    0,
                    -100,
                    (block, warps),
                )
            )
        del logits
    for kind, times, names in (
        ("logprobs_fwd", fwd, ("block_v", "warps", "stages")),
        ("logprobs_bwd", bwd, ("block_v", "warps")),
    ):
        for cand, per_shape in times.items():
            for index, ms in per_shape.items():
                rows, vocab = shapes[index]
                entries.append(
                    {
                        "kernel": kind,
                        "shape": f"{rows}x{vocab}",
                        **dict(zip(names, cand, strict=True)),
                        "ms": ms,
                    }
                )
        best, score = _choose(times)
        chosen.append(
            [kind, "all", ", ".join(f"{n}={v}" for n, v in zip(names, best, strict=True)), score]
        )
        print(kind, best, score, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the result files")
    parser.add_argument("--only", choices=("rms", "logprobs"), help="sweep one kernel family")
    args = parser.parse_args()
    entries: list[dict] = []
    chosen: list[list[Any]] = []
    if args.only in (None, "rms"):
        sweep_rms(entries, chosen)
        _write(args.out, entries, chosen)
    if args.only in (None, "logprobs"):
        sweep_logprobs(entries, chosen)
        _write(args.out, entries, chosen)


HOW_CHOSEN = """How the launch configuration of a call is chosen per shape (mcore-kernels 0.2)

add + RMSNorm. The numerics of a row (the order of its reductions) depend on the row width
only, so a row's result is bitwise the same whatever the number of rows in the call.

1. Once per (hidden size, device), `rms_norm._launch` (cached) builds the plan: the row
   block width is the hidden size rounded up to a power of two, at most `MAX_BLOCK` = 8192
   (wider rows are streamed in 8192-wide chunks, one row per program, and the forward stores
   `rstd` for the backward); `LAUNCH_CONFIGS` gives that width's entry (the table below).
2. Per call, from the number of rows: a row block holds `fwd_rows` (`bwd_rows`) rows, or the
   next power of two of the call's rows when it has fewer (the same one-row layout repeated);
   the forward launches one program per row block; the backward launches at most
   `bwd_programs_per_sm` x multiprocessors programs, each walking row blocks at a fixed stride
   and writing one float32 partial weight gradient summed in program order by a second kernel
   (one program writes the weight gradient itself), and pipelines its row loop `bwd_stages`
   deep only when a program walks several row blocks.
3. Which kernel: contiguous rows exactly one block wide (2048, 4096, 8192 ...) in whole row
   blocks run specialised kernels without masks, row count or stride arguments (the forward,
   and the backward of a call that is one row block); other shapes run the general kernels
   (masks, 64-bit offsets only from 2**31 elements). Both give the same bits (tests on the
   interpreter and the GPU).
4. Loads: a forward whose `x` fits in half of the L2 cache loads its rows with the
   evict-first hint and the weight with evict-last; larger calls load plainly.
5. One row exactly one block wide (a decode step, a one-token call) runs on `row_programs`
   programs of the entry's layout: each loads and reduces the whole row (the same bits) and
   stores its share of the columns; 1 is the specialised kernel's single program.
   `fwd_max_registers` (0: ptxas chooses) caps the registers of the specialised forward's
   threads (ptxas `maxnreg`: another schedule, the same arithmetic); 64 at width 8192. The
   tuner times caps 0 / 48 / 64 / 80 for the chosen forward layout at 256, 4096 and 16384 rows
   ("rms_fwd_register_cap").
6. A repeated call of the same (rows, hidden, device, dtypes) reuses the compiled kernel and
   grid from a table (no plan, key or constexpr work on the host).

token log-probs: one program per row; the vocabulary chunk and warps depend on the vocabulary
size only (`token_logprobs._block_and_warps`: forward 1024-wide chunks and 4 warps, backward
2048-wide chunks and 16 warps).

Where the numbers come from: `benchmarks/tune_launch_configs.py` times every candidate's
launcher (no autograd) at rows 1, 256, 4096, 8192 and 16384 of each hidden size, GPU time
under CUDA graph replay over L2-cold input copies, and picks per hidden size the candidate of
least geometric mean of time / fastest time over the row counts (score 1.0 = fastest at every
row count); the backward's layout first, then its grid cap and depth. For the chosen forward
layout it then times one bf16 row on 1, 2, 4 and 8 programs and keeps the fastest
("rms_fwd_one_row": its time over one program's). The chosen rows are copied into
`LAUNCH_CONFIGS` by hand.
"""


def in_use_table() -> str:
    """The launch table the package holds now (``LAUNCH_CONFIGS``), as Markdown."""
    rows = [
        [
            width,
            c.fwd_rows,
            c.fwd_warps,
            c.bwd_rows,
            c.bwd_warps,
            c.bwd_programs_per_sm,
            c.bwd_stages,
            c.row_programs,
            c.fwd_max_registers,
        ]
        for width, c in sorted(rms.LAUNCH_CONFIGS.items())
    ]
    header = [
        "row block width",
        "fwd rows",
        "fwd warps",
        "bwd rows",
        "bwd warps",
        "bwd programs/SM",
    ]
    return markdown_table(
        [*header, "bwd stages", "one-row programs", "fwd register cap (0: none)"], rows
    )


def _write(out: Path, entries: list[dict], chosen: list[list[Any]]) -> None:
    payload = {
        **device_info(),
        "benchmark": "launch-parameter sweep",
        "chosen": chosen,
        "results": entries,
    }
    table = (
        HOW_CHOSEN
        + "\n`LAUNCH_CONFIGS` when this sweep ran:\n\n"
        + in_use_table()
        + f"\nThis sweep on {payload['device']} (bf16): chosen per hidden size (vocabulary for "
        "log-probs), least geometric mean of time / fastest time over the row counts "
        f"{ROWS} (score 1.0 = fastest at every row count).\n\n"
        + markdown_table(["kernel", "hidden", "chosen", "score"], chosen)
    )
    write_results(out, "launch_configs", payload, table)


if __name__ == "__main__":
    main()
