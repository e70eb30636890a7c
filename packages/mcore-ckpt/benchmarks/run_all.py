"""Runs every mcore-ckpt benchmark and writes the results under ``--out``.

From the repository root on the GPU machine::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-ckpt/benchmarks/run_all.py --out $OUT

Extra arguments (``--params``, ``--repeats``, ``--dir`` ...) are passed to
``bench_checkpoint.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
