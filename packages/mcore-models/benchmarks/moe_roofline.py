"""Roofline of the six expert GEMMs of every MoE benchmark case: FLOPs against bytes.

For each GEMM of the experts' forward + backward (``gate_up``, ``down``, ``d_act``, ``d_x``,
``w_down``, ``w_gate_up``; see ``bench_moe_gemm.py``) it counts the FLOPs and the bytes that
must cross HBM at least once (bf16 operands read once, results written once: the expert
weights or their gradients plus the routed rows), and gives the time floor of each on the
device's peak rates, the larger of the two, and the arithmetic intensity against the ridge
point. With ``--measured`` (a ``moe_gemm.json``), each GEMM's measured time for every
implementation is shown as a share of its floor.

The peak rates are the H200 SXM datasheet's (989 dense bf16 TFLOP/s, 4.8 TB/s HBM3e,
https://www.nvidia.com/en-us/data-center/h200/); no kernel reaches them, so the floors are
lower bounds. Pure arithmetic: runs anywhere.

    python3 packages/mcore-models/benchmarks/moe_roofline.py --out $OUT/moe \\
        [--measured $OUT/moe/moe_gemm.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_moe import CASES  # type: ignore[import-not-found]

GEMMS = ("gate_up", "down", "d_act", "d_x", "w_down", "w_gate_up")
PEAK_TFLOPS = 989.0
"""Dense bf16 tensor-core peak of an H200 SXM (datasheet), TFLOP/s."""
PEAK_TBPS = 4.8
"""HBM3e bandwidth of an H200 SXM (datasheet), TB/s."""


def gemm_costs(case: dict[str, int]) -> dict[str, tuple[float, float]]:
    """FLOPs and minimum HBM bytes of each expert GEMM of one case.

    Args:
        case: Shapes (hidden, experts, top_k, ffn, tokens).

    Returns:
        ``{gemm: (flops, bytes)}``.
    """
    h, e, f = case["hidden"], case["experts"], case["ffn"]
    r = case["tokens"] * case["top_k"]
    b = 2  # bf16
    w_gu, w_d = e * 2 * f * h * b, e * h * f * b
    return {
        "gate_up": (2.0 * r * h * 2 * f, r * h * b + w_gu + r * 2 * f * b),
        "down": (2.0 * r * f * h, r * f * b + w_d + r * h * b),
        "d_act": (2.0 * r * h * f, r * h * b + w_d + r * f * b),
        "d_x": (2.0 * r * 2 * f * h, r * 2 * f * b + w_gu + r * h * b),
        "w_down": (2.0 * r * h * f, r * h * b + r * f * b + w_d),
        "w_gate_up": (2.0 * r * 2 * f * h, r * 2 * f * b + r * h * b + w_gu),
    }


def _measured(path: Path | None) -> dict[tuple[str, str], dict[str, float]]:
    if path is None:
        return {}
    table: dict[tuple[str, str], dict[str, float]] = {}
    for row in json.loads(path.read_text())["rows"]:
        if "ms" in row and "gemm" in row:
            table.setdefault((row["case"], row["impl"]), {})[row["gemm"]] = row["ms"]
    return table


def markdown(measured: dict[tuple[str, str], dict[str, float]]) -> str:
    """The roofline table (and the measured shares of the floors) as Markdown.

    Args:
        measured: ``{(case, implementation): {gemm: ms}}``.

    Returns:
        Markdown text.
    """
    ridge = PEAK_TFLOPS / PEAK_TBPS
    lines = [
        f"Roofline of the expert GEMMs (peaks {PEAK_TFLOPS:.0f} TFLOP/s bf16, "
        f"{PEAK_TBPS} TB/s; ridge {ridge:.0f} FLOP/byte)",
        "",
        "| case | GEMM | GFLOP | MB moved | FLOP/byte | compute floor ms | memory floor ms "
        "| bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, case in CASES.items():
        total_c = total_m = total_f = 0.0
        for gemm, (flops, nbytes) in gemm_costs(case).items():
            c_ms = flops / PEAK_TFLOPS / 1e9
            m_ms = nbytes / PEAK_TBPS / 1e9
            total_c, total_m, total_f = total_c + c_ms, total_m + m_ms, total_f + max(c_ms, m_ms)
            bound = "compute" if c_ms >= m_ms else "memory"
            lines.append(
                f"| {name} | {gemm} | {flops / 1e9:.0f} | {nbytes / 1e6:.0f} | "
                f"{flops / nbytes:.0f} | {c_ms:.3f} | {m_ms:.3f} | {bound} |"
            )
        lines.append(
            f"| {name} | all six | | | | {total_c:.3f} | {total_m:.3f} | floor {total_f:.3f} ms |"
        )
    if measured:
        lines += [
            "",
            "Measured time as a multiple of each GEMM's floor (max of the two), from "
            "`moe_gemm.json`:",
            "",
            "| case | implementation | " + " | ".join(GEMMS) + " | all six |",
            "|---|---|" + "---|" * (len(GEMMS) + 1),
        ]
        for (name, impl), times in measured.items():
            if name not in CASES:
                continue
            costs = gemm_costs(CASES[name])
            cells, spent, floor = [], 0.0, 0.0
            for gemm in GEMMS:
                flops, nbytes = costs[gemm]
                gemm_floor = max(flops / PEAK_TFLOPS / 1e9, nbytes / PEAK_TBPS / 1e9)
                if gemm in times:
                    cells.append(f"{times[gemm] / gemm_floor:.2f}x")
                    spent, floor = spent + times[gemm], floor + gemm_floor
                else:
                    cells.append("")
            share = f"{spent / floor:.2f}x" if floor else ""
            lines.append(f"| {name} | {impl} | " + " | ".join(cells) + f" | {share} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Write ``moe_roofline.md`` under ``--out``.

    Args:
        argv: Command-line arguments (default ``sys.argv``).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--measured", type=Path, help="a moe_gemm.json to compare against")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(_measured(args.measured))
    (out / "moe_roofline.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
