"""Run every mcore-models benchmark and write the results under ``--out``.

Run from the repository root on the GPU machine::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-models/benchmarks/run_all.py --out $OUT/models
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_train_step


def main() -> None:
    """Run the training-step benchmark (eager and with compiled layers)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args()
    bench_train_step.main(["--out", str(Path(args.out)), "--compile"])


if __name__ == "__main__":
    main()
