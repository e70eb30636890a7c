"""L2 prefetch: argument checks, a no-op on the CPU, and on a GPU a hint that changes nothing
(eager, inside a CUDA graph on a side stream)."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.errors import KernelDeviceError, KernelValueError
from mcore_kernels.l2_prefetch import l2_prefetch


def test_rejects_bad_arguments():
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(KernelValueError, match="programs"):
        l2_prefetch(a, programs=0)
    with pytest.raises(KernelValueError, match="first is not contiguous"):
        l2_prefetch(a.t())
    with pytest.raises(KernelValueError, match="second has 4-byte elements"):
        l2_prefetch(a, torch.zeros(3))
    if torch.cuda.is_available():
        with pytest.raises(KernelDeviceError, match="second is on"):
            l2_prefetch(a, a.cuda())


def test_cpu_tensors_are_left_alone():
    a = torch.arange(10, dtype=torch.float32)
    before = a.clone()
    l2_prefetch(a, torch.empty(0))
    assert torch.equal(a, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_prefetch_changes_no_value_eager_and_in_a_graph():
    generator = torch.Generator(device="cuda").manual_seed(0)
    # Odd sizes: the last line of each tensor is partial; an empty second tensor too.
    first = torch.randn(1000, 129, device="cuda", generator=generator).to(torch.bfloat16)
    second = torch.randn(77, device="cuda", generator=generator).to(torch.bfloat16)
    copies = first.clone(), second.clone()
    x = torch.randn(8, 129, device="cuda", generator=generator).to(torch.bfloat16)
    l2_prefetch(first, second)
    l2_prefetch(second, torch.empty(0, device="cuda", dtype=torch.bfloat16), programs=1)
    expected = x @ first.t()
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            l2_prefetch(first, second, programs=4)
        out = x @ first.t()
        torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert torch.equal(first, copies[0]) and torch.equal(second, copies[1])
