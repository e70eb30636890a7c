"""Test setup of mcore-kernels: run the Triton kernels through the interpreter without a GPU.

Triton decides at kernel-definition time whether a ``@triton.jit`` function is interpreted, so
the variable must be set before any kernel module is imported; CI sets it too.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
