"""The benchmark's move-only floor (``benchmarks/_move_floor.py``): its launch space and that
its kernel moves the two tensors unchanged (through the interpreter on CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.interpreter

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "_move_floor.py"


def _module():
    spec = importlib.util.spec_from_file_location("_move_floor_under_test", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("rows", "hidden"), [(1, 2048), (256, 4096), (16384, 8192)])
def test_move_configs_cover_row_shares_and_fit_the_call(rows, hidden):
    configs = _module().move_configs(rows, hidden)
    assert configs
    for elements, warps in configs:
        # Whole programs of 8, 16 or 32 elements per thread, at most the whole call.
        assert rows * hidden % elements == 0 and elements <= rows * hidden
        assert elements // (32 * warps) in (8, 16, 32)
    # A program of one row is always among them (the layout of one row per program).
    assert any(elements == hidden for elements, _ in configs)


def test_move_kernel_copies_both_tensors_unchanged():
    module = _module()
    x = torch.randn(4, 2048, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.ones(2048, dtype=torch.bfloat16)
    for name, call in module.move_floor_calls(4, 2048).items():
        out, residual_out = call(x, residual, weight)
        assert torch.equal(out, x) and torch.equal(residual_out, residual), name
        assert out.data_ptr() != x.data_ptr()
