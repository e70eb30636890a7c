"""Runs every mcore-rl benchmark and writes the results under ``--out``.

Run from the repository root::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-rl/benchmarks/run_all.py --out $OUT
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def main() -> None:
    """Runs the one-step GRPO benchmark (its own process, so it owns its process group)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args, rest = parser.parse_known_args()
    here = Path(__file__).resolve().parent
    out = Path(args.out) / "rl"
    command = [sys.executable, str(here / "grpo_step.py"), "--out", str(out), *rest]
    subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
