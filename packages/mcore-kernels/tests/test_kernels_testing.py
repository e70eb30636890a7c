"""The host-read probe of :mod:`mcore_kernels.testing` flags ops that read device values on the
host and lets pure device ops through unrecorded."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.testing import HostReadProbe

SCALAR_READ = str(torch.ops.aten._local_scalar_dense.default)


def test_probe_sees_a_scalar_read():
    with HostReadProbe() as probe:
        assert int(torch.arange(3).sum()) == 3
        assert bool(torch.ones(2).any())
    assert probe.seen == [SCALAR_READ] * 2


@pytest.mark.parametrize(
    ("read", "op"),
    [
        (lambda t: t.sum().item(), SCALAR_READ),
        (lambda t: float(t[0]), SCALAR_READ),
        (lambda t: 1 if t.sum() > 0 else 0, SCALAR_READ),
        (lambda t: t.nonzero(), str(torch.ops.aten.nonzero.default)),
        (lambda t: torch.where(t > 2), str(torch.ops.aten.nonzero.default)),
        (lambda t: torch.equal(t, t), str(torch.ops.aten.equal.default)),
        (lambda t: torch.allclose(t, t), str(torch.ops.aten.allclose.default)),
        (lambda t: torch.unique_consecutive(t), str(torch.ops.aten.unique_consecutive.default)),
        (
            lambda t: t.repeat_interleave(torch.ones(6, dtype=torch.long)),
            str(torch.ops.aten.repeat_interleave.Tensor),
        ),
    ],
)
def test_probe_flags_each_host_read(read, op):
    with HostReadProbe() as probe:
        read(torch.arange(6.0))
    assert probe.seen == [op]


def test_probe_ignores_pure_device_ops_and_returns_their_results():
    t = torch.arange(6.0)
    with HostReadProbe() as probe:
        out = (t * 2 + 1).softmax(0).cumsum(0)[torch.tensor([1, 2])]
        out = out + torch.where(t > 2, t, 0).masked_fill(t < 1, 5)[:2] + t.topk(2).values
        index = t.argmax()
        size = t.shape[0] + t.numel()
    assert probe.seen == []
    expected = (t * 2 + 1).softmax(0).cumsum(0)[torch.tensor([1, 2])]
    expected = expected + torch.where(t > 2, t, 0).masked_fill(t < 1, 5)[:2] + t.topk(2).values
    torch.testing.assert_close(out, expected)
    assert int(index) == 5 and size == 12


def test_each_probe_records_only_its_own_block():
    with HostReadProbe() as first:
        torch.arange(3).sum().item()
    with HostReadProbe() as second:
        torch.arange(3) + 1
    assert first.seen == [SCALAR_READ]
    assert second.seen == []
