"""Run every mcore-kernels benchmark on one GPU, writing JSON and Markdown into ``--out``.

Each benchmark runs in its own process so that one's memory never skews another's.

Usage (from the repository root)::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-kernels/benchmarks/run_all.py --out DIR [--tune] [--warm-jobs N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["bench_rms_norm.py", "bench_token_logprobs.py", "bench_paged_attention.py"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the result files")
    parser.add_argument(
        "--tune", action="store_true", help="also sweep the kernels' launch parameters"
    )
    parser.add_argument("--only-tune", action="store_true", help="only sweep the launch parameters")
    parser.add_argument(
        "--warm-jobs",
        type=int,
        default=min(os.cpu_count() or 1, 15),
        help="processes that compile the add + RMSNorm implementations in parallel first "
        "(0: compile inside the timed run, one shape after another)",
    )
    parser.add_argument(
        "--only",
        choices=[name.removesuffix(".py") for name in BENCHMARKS],
        help="run this benchmark alone (to split the run over two device calls)",
    )
    args = parser.parse_args()
    if args.only:
        BENCHMARKS[:] = [f"{args.only}.py"]
    if args.warm_jobs > 0 and not args.only_tune and "bench_rms_norm.py" in BENCHMARKS:
        # Fills the Triton and Inductor disk caches: the timed run loads instead of compiling.
        started = time.perf_counter()
        jobs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "bench_rms_norm.py"),
                    "--warm-shard",
                    f"{i}/{args.warm_jobs}",
                ]
            )
            for i in range(args.warm_jobs)
        ]
        codes = [job.wait() for job in jobs]
        print(
            f"== warm-up: {args.warm_jobs} jobs, exit codes {sorted(set(codes))}, "
            f"{time.perf_counter() - started:.1f} s",
            flush=True,
        )
    scripts = [] if args.only_tune else list(BENCHMARKS)
    if args.tune or args.only_tune:
        scripts.append("tune_launch_configs.py")
    failed = []
    for script in scripts:
        print(f"== {script}", flush=True)
        if subprocess.run(
            [sys.executable, str(HERE / script), "--out", str(args.out)], check=False
        ).returncode:
            failed.append(script)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
