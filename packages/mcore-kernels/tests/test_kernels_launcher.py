"""CachedLauncher: which launches compile, which reuse a kept kernel, and with what arguments.

A stand-in for a ``@triton.jit`` function records every launch, so the caching logic runs on
the CPU; the GPU tests of the kernels check the same path against the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from mcore_kernels._triton_utils import CachedLauncher


class _Compiled:
    """What ``kernel[grid](...)`` returns on a GPU: a launcher plus its handles."""

    def __init__(self, log: list, fail: bool) -> None:
        self.function = "function-handle"
        self.packed_metadata = "metadata"
        self._log = log
        self._fail = fail

    def run(self, *args):
        if self._fail:
            raise TypeError("another calling convention")
        self._log.append(("cached", args))


class _FakeJit:
    """Records compilations (``fn[grid](...)``) and hands out one compiled kernel each."""

    arg_names = ("x_ptr", "out_ptr", "n", "scale", "BLOCK")

    def __init__(self, fail_cached: bool = False) -> None:
        self.compiled: list = []
        self.log: list = []
        self.fail_cached = fail_cached

    def __getitem__(self, grid):
        def launch(*args, num_warps, **constexprs):
            self.compiled.append((grid, args, constexprs, num_warps))
            return _Compiled(self.log, self.fail_cached)

        return launch


@pytest.fixture
def stream(monkeypatch):
    # The cached path asks torch for the device's current stream; the CPU has none.
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1234, raising=False)


def test_second_launch_reuses_the_kernel_with_addresses_for_tensors(stream):
    fn = _FakeJit()
    launcher = CachedLauncher(fn)
    x, out = torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        launcher((4,), (x, out, 64, 0.5), {"BLOCK": 16}, 4, 0)
    assert len(fn.compiled) == 1
    assert len(fn.log) == 2
    _, args = fn.log[0]
    # grid, stream, handles, no hooks, then the arguments with tensors as device addresses and
    # the constexprs at the end.
    assert args[:9] == (4, 1, 1, 1234, "function-handle", "metadata", None, None, None)
    assert args[9:] == (x.data_ptr(), out.data_ptr(), 64, 0.5, 16)


def test_each_specialisation_compiles_once(stream):
    fn = _FakeJit()
    launcher = CachedLauncher(fn)
    x32, x16, out = torch.zeros(64), torch.zeros(64, dtype=torch.float16), torch.zeros(64)
    calls = [
        (x32, out, 64, 0.5),
        (x16, out, 64, 0.5),  # another dtype
        (x32, out, 1, 0.5),  # n == 1 is specialised away
        (x32, out, 65, 0.5),  # n not divisible by 16
        (x32[1:], out, 63, 0.5),  # an address not 16-byte aligned
        (x32, out, 128, 2.0),  # the same specialisation as the first
    ]
    for args in calls:
        launcher((4,), args, {"BLOCK": 16}, 4, 0)
    launcher((4,), calls[0], {"BLOCK": 32}, 4, 0)  # another constexpr
    launcher((4,), calls[0], {"BLOCK": 16}, 8, 0)  # other warps
    assert len(fn.compiled) == 7
    assert len(fn.log) == 1


def test_keyed_launch_uses_the_callers_key(stream):
    fn = _FakeJit()
    launcher = CachedLauncher(fn)
    x, out = torch.zeros(64), torch.zeros(64)
    args = (x, out, 64, 0.5)
    addresses = (x.data_ptr(), out.data_ptr(), 64, 0.5)
    for programs in (3, 5):
        launcher.keyed("k", programs, args, addresses, {"BLOCK": 16}, 4, 0)
    assert len(fn.compiled) == 1 and fn.compiled[0][0] == (3,)
    assert fn.log == [
        ("cached", (5, 1, 1, 1234, "function-handle", "metadata", None, None, None, *addresses, 16))
    ]
    # The generic path shares what the keyed one compiled.
    launcher((2,), args, {"BLOCK": 16}, 4, 0)
    assert len(fn.compiled) == 1 and len(fn.log) == 2


def test_a_launcher_that_rejects_the_call_falls_back_for_good(stream):
    fn = _FakeJit(fail_cached=True)
    launcher = CachedLauncher(fn)
    x, out = torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        launcher((4,), (x, out, 64, 0.5), {"BLOCK": 16}, 4, 0)
    # First compiled, second tried the cached launch (rejected) and went through fn[grid],
    # third went straight to fn[grid].
    assert len(fn.compiled) == 3
    assert fn.log == []


def test_host_tensor_descriptors_key_on_dtype_block_and_padding_and_pass_through(stream):
    from triton.tools.tensor_descriptor import TensorDescriptor

    fn = _FakeJit()
    launcher = CachedLauncher(fn)
    a = torch.zeros(64, 32)
    out = torch.zeros(64)

    def desc(t, block, padding="zero"):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, padding)

    first = desc(a, [16, 16])
    launcher((4,), (first, out, 64, 0.5), {"BLOCK": 16}, 4, 0)
    # Another tensor of the same dtype, the same block: the kept kernel, the descriptor itself
    # handed to the compiled launcher (which encodes it).
    other = desc(torch.zeros(128, 32), [16, 16])
    launcher((4,), (other, out, 64, 0.5), {"BLOCK": 16}, 4, 0)
    assert len(fn.compiled) == 1
    assert fn.log[0][1][9] is other
    # Each of these is another specialisation: block shape, dtype, padding.
    launcher((4,), (desc(a, [16, 32]), out, 64, 0.5), {"BLOCK": 16}, 4, 0)
    launcher((4,), (desc(a.half(), [16, 16]), out, 64, 0.5), {"BLOCK": 16}, 4, 0)
    launcher((4,), (desc(a, [16, 16], "nan"), out, 64, 0.5), {"BLOCK": 16}, 4, 0)
    assert len(fn.compiled) == 4


def test_num_stages_is_part_of_the_key_and_reaches_the_compiler(stream):
    fn = _FakeJit()
    launcher = CachedLauncher(fn)
    x, out = torch.zeros(64), torch.zeros(64)
    launcher((4,), (x, out, 64, 0.5), {"BLOCK": 16}, 4, 0)
    launcher((4,), (x, out, 64, 0.5), {"BLOCK": 16}, 4, 0, num_stages=3)
    launcher((4,), (x, out, 64, 0.5), {"BLOCK": 16}, 4, 0, num_stages=3)
    assert len(fn.compiled) == 2
    assert "num_stages" not in fn.compiled[0][2]
    assert fn.compiled[1][2]["num_stages"] == 3
    assert len(fn.log) == 1
