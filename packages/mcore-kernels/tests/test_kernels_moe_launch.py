"""The MoE kernels' launch helper: a kept compiled kernel on CUDA devices, ``kernel[grid]`` on
the CPU (the interpreter) and with ``CACHED_LAUNCH`` off.

A stand-in for a ``@triton.jit`` function records every launch, so the routing of the calls is
checked on the CPU; the GPU tests of the MoE kernels run the same path on compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.moe import _launch


class _Compiled:
    function = "function-handle"
    packed_metadata = "metadata"

    def __init__(self, log: list) -> None:
        self._log = log

    def run(self, *args):
        self._log.append(("cached", args))


class _FakeJit:
    arg_names = ("x_ptr", "n", "BLOCK")

    def __init__(self) -> None:
        self.compiled: list = []
        self.log: list = []

    def __getitem__(self, grid):
        def go(*args, num_warps, **options):
            self.compiled.append((grid, args, num_warps, options))
            return _Compiled(self.log)

        return go


@pytest.fixture
def stream(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 99, raising=False)


def test_cuda_launches_reuse_the_compiled_kernel(stream):
    fn = _FakeJit()
    x = torch.zeros(32)
    for _ in range(3):
        _launch.launch(fn, (2,), (x, 32), {"BLOCK": 16}, device=torch.device("cuda", 0))
    assert len(fn.compiled) == 1 and fn.compiled[0][2] == 4
    assert [entry[1][:4] for entry in fn.log] == [(2, 1, 1, 99)] * 2
    assert fn.log[0][1][9:] == (x.data_ptr(), 32, 16)


def test_cpu_and_switched_off_launches_go_through_the_jit_path(stream, monkeypatch):
    fn = _FakeJit()
    x = torch.zeros(32)
    for _ in range(2):
        _launch.launch(fn, (2,), (x, 32), {"BLOCK": 16}, device=x.device, num_stages=3)
    monkeypatch.setattr(_launch, "CACHED_LAUNCH", False)
    for _ in range(2):
        _launch.launch(fn, (2,), (x, 32), {"BLOCK": 16}, device=torch.device("cuda", 0))
    assert len(fn.compiled) == 4 and fn.log == []
    assert fn.compiled[0] == ((2,), (x, 32), 4, {"BLOCK": 16, "num_stages": 3})
    assert fn.compiled[2] == ((2,), (x, 32), 4, {"BLOCK": 16})
