"""Test setup of mcore-kernels: run the Triton kernels through the interpreter without a GPU.

Triton decides when a ``@triton.jit`` function is defined whether it is interpreted, so the
variable must be set before any kernel module is imported; CI sets it too. In a process where
the kernels were compiled for the GPU (a CUDA machine without ``TRITON_INTERPRET=1``), the tests
that run them on CPU tensors cannot work and are skipped: run ``pytest -m gpu`` there, and the
rest with ``TRITON_INTERPRET=1``.
"""

import os

import pytest
import torch
from _interpreter_speedups import install

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    install()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "interpreter: runs Triton kernels on CPU tensors (TRITON_INTERPRET=1)"
    )


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return
    skip = pytest.mark.skip(
        reason="kernels are compiled for the GPU in this run; set TRITON_INTERPRET=1"
    )
    for item in items:
        if "interpreter" in item.keywords and "gpu" not in item.keywords:
            item.add_marker(skip)
