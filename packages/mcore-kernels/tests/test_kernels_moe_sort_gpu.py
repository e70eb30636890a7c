"""The counting sort of the routing assignments on the GPU at a layer shape: bitwise its torch
reference (a stable sort and the row rules), and two runs bitwise equal."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.moe.reference import expert_rows_reference
from mcore_kernels.moe.sort import expert_rows

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)


@pytest.mark.parametrize("capacity", [None, 3000, 400], ids=["dropless", "no-drop", "drops"])
def test_expert_rows_equal_their_reference_at_a_layer_shape(capacity):
    # 65536 assignments over 128 experts (Qwen3-30B-A3B at 8192 tokens), three without any.
    g = torch.Generator(device="cuda").manual_seed(3)
    experts = torch.randint(0, 125, (65536,), generator=g, device="cuda")
    counts = torch.bincount(experts, minlength=128)
    got = expert_rows(experts, counts, capacity)
    for a, b in zip(got, expert_rows_reference(experts, counts, capacity), strict=True):
        assert torch.equal(a, b) and a.dtype == b.dtype
    again = expert_rows(experts, counts, capacity)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
