"""Runs every mcore-parallel model-parallel benchmark; results go under ``--out``.

Run from the repository root on a machine with 2 GPUs:

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-parallel/benchmarks/run_all.py --out $OUT
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

BENCHMARKS = {"bench_tp_mlp.py": "tp_mlp.json"}
# Scripts that run one process per GPU under torchrun (they spawn gloo ranks themselves on CPU).
TORCHRUN_BENCHMARKS = {"bench_context_parallel.py": "context_parallel.json"}


def main() -> None:
    """Runs each benchmark script in its own process, writing ``<out>/<name>.json`` and ``.md``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory of the results")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny CPU check of the scripts")
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the torchrun benchmarks")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent
    for script, result in BENCHMARKS.items():
        command = [sys.executable, str(here / script), "--out", str(args.out / result)]
        subprocess.run(command + (["--cpu-smoke"] if args.cpu_smoke else []), check=True)
    for script, result in TORCHRUN_BENCHMARKS.items():
        launcher = [sys.executable]
        if not args.cpu_smoke:
            launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus)]
        command = [*launcher, str(here / script), "--out", str(args.out / result)]
        subprocess.run(command + (["--cpu-smoke"] if args.cpu_smoke else []), check=True)


if __name__ == "__main__":
    main()
