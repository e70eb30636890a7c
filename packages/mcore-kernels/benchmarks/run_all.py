"""Run every mcore-kernels benchmark on one GPU, writing JSON and Markdown into ``--out``.

Each benchmark runs in its own process so that one's memory never skews another's.

Usage (from the repository root)::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-kernels/benchmarks/run_all.py --out DIR [--tune]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
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
    args = parser.parse_args()
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
