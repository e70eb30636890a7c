"""The MoE benchmark's rotated windows on the CPU: the round order, the medians and per-round
ratios against hand-computed values, the layers sharing weights, and the ratio rows of the
smoke shape timed in rounds (timing itself is not checked: only the bookkeeping)."""

from __future__ import annotations

import ctypes
import importlib
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

# The benchmark scripts are this package's own files, not an installed module: they import
# each other from their folder, as when run as scripts.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench_moe = importlib.import_module("bench_moe")
moe_windows = importlib.import_module("moe_windows")


def test_rotation_opens_each_round_with_the_next_layer_and_alternates_direction() -> None:
    orders = moe_windows.rotation(5, 5)
    assert orders == [
        [0, 1, 2, 3, 4],
        [1, 0, 4, 3, 2],
        [2, 3, 4, 0, 1],
        [3, 2, 1, 0, 4],
        [4, 0, 1, 2, 3],
    ]
    for count in (1, 2, 4, 5):
        orders = moe_windows.rotation(count, count)
        assert all(sorted(order) == list(range(count)) for order in orders)
        assert sorted(order[0] for order in orders) == list(range(count))


def test_rotation_every_layer_follows_both_neighbours() -> None:
    predecessors: dict[int, set[int]] = {layer: set() for layer in range(4)}
    for order in moe_windows.rotation(4, 4):
        for before, after in itertools.pairwise(order):
            predecessors[after].add(before)
    assert predecessors[1] == {0, 2}
    assert predecessors[2] == {1, 3}


@pytest.mark.parametrize(("count", "rounds"), [(0, 3), (3, 0)])
def test_rotation_rejects_no_layers_or_rounds(count: int, rounds: int) -> None:
    with pytest.raises(ValueError, match="must be at least 1"):
        moe_windows.rotation(count, rounds)


def test_spread_gives_median_min_max() -> None:
    assert moe_windows.spread([4.0, 2.0, 3.0, 10.0]) == {"median": 3.5, "min": 2.0, "max": 10.0}
    with pytest.raises(ValueError, match="windows is empty"):
        moe_windows.spread([])


def test_round_ratios_divide_the_faster_peer_of_each_round() -> None:
    separate = [3.0, 2.0, 4.0]
    fused = [2.5, 2.5, 2.0]
    layer = [5.0, 4.0, 4.0]
    assert moe_windows.round_ratios([separate, fused], layer) == [0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="a peer has 2 windows, the layer 3"):
        moe_windows.round_ratios([[1.0, 2.0]], layer)
    with pytest.raises(ValueError, match="peers is empty"):
        moe_windows.round_ratios([], layer)


class _FakeNvml:
    """Answers ``nvmlDeviceGetClockInfo`` with a fixed SM clock (or an error code)."""

    def __init__(self, mhz: int, status: int = 0) -> None:
        self.mhz, self.status, self.calls = mhz, status, 0

    def nvmlDeviceGetClockInfo(self, handle, clock_type: int, out) -> int:
        assert clock_type == moe_windows.NVML_CLOCK_SM
        self.calls += 1
        out._obj.value = self.mhz
        return self.status


def test_clock_sampler_averages_the_samples_inside_a_window() -> None:
    library = _FakeNvml(1500)
    sampler = moe_windows.ClockSampler(library, ctypes.c_void_p(), interval=0.001)
    assert sampler.read() == 1500
    begin = time.perf_counter()
    sampler.start()
    time.sleep(0.05)
    sampler.close()
    end = time.perf_counter()
    assert library.calls > 2
    assert sampler.mean(begin, end) == 1500
    assert sampler.mean(end + 1.0, end + 2.0) is None
    assert moe_windows.ClockSampler(_FakeNvml(1500, status=3), None, 0.01).read() is None
    assert moe_windows.ClockSampler.open(torch.device("cpu")) is None


class _Broken(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel here")


def test_rotate_times_every_layer_once_per_round_and_reports_a_failing_layer() -> None:
    torch.manual_seed(0)
    modules = {"a": nn.Linear(8, 8), "b": nn.Linear(8, 8), "broken": _Broken(8, 8)}
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    rounds_seen: list[int] = []
    timed = moe_windows.rotate(
        modules,
        x,
        grad,
        warmup=1,
        iters=2,
        rounds=3,
        emit=lambda fields: rounds_seen.append(fields["a"]["rounds"]),
    )
    assert rounds_seen == [1, 2, 3]
    assert timed["broken"] == {"error": "RuntimeError: no kernel here"}
    for name in ("a", "b"):
        fields = timed[name]
        assert fields["rounds"] == 3 and len(fields["windows_ms"]) == 3
        assert fields["ms"] == statistics.median(fields["windows_ms"])
        assert fields["ms_min"] == min(fields["windows_ms"])
        assert fields["ms_max"] == max(fields["windows_ms"])
        assert fields["ms_from_idle"] == statistics.median(fields["windows_ms_from_idle"])
        assert fields["steady_steps"] == 2  # the CPU times iters steps
        assert "sm_mhz" not in fields and "peak_gib" not in fields
    # Each step clears the gradients (no accumulation across windows).
    assert all(param.grad is None for param in modules["a"].parameters())


def test_share_weights_makes_equal_moe_layers_use_one_set_of_parameters() -> None:
    case = bench_moe.SMOKE["smoke"]
    cpu = torch.device("cpu")
    dropless = bench_moe._moe(case, cpu)
    capacity = bench_moe._moe(case, cpu, capacity_factor=1.25)
    reference = bench_moe._moe(case, cpu, capacity_factor=1.25)
    assert bench_moe._share_weights(capacity, dropless)
    for (name, shared), (_, own) in zip(
        capacity.named_parameters(), dropless.named_parameters(), strict=True
    ):
        assert shared is own, name
    x = torch.randn(case["tokens"], case["hidden"])
    torch.testing.assert_close(capacity(x), reference(x), rtol=0, atol=0)
    dense = bench_moe._dense_fused(case, cpu)
    assert not bench_moe._share_weights(dense, dropless)


def test_run_case_times_the_ratio_rows_in_rounds_and_divides_medians(tmp_path: Path) -> None:
    emitted: list[list[dict]] = []
    rows = bench_moe.run_case(
        "smoke",
        bench_moe.SMOKE["smoke"],
        torch.device("cpu"),
        smoke=True,
        profiles=None,
        emit=lambda rows: emitted.append(json.loads(json.dumps(rows))),
        rounds=3,
        only=["dense SwiGLU", "(default", "default:", "grouped_mm experts", "expert loop"],
    )
    names = [row["implementation"] for row in rows]
    assert names[:2] == [bench_moe.DENSE, bench_moe.DENSE_FUSED]
    assert set(names) == {*bench_moe.RATIO_ROWS, "mcore MoELayer dropless, expert loop"}
    by_name = {row["implementation"]: row for row in rows}
    dense = min(by_name[bench_moe.DENSE]["ms"], by_name[bench_moe.DENSE_FUSED]["ms"])
    for name in bench_moe.RATIO_ROWS:
        row = by_name[name]
        assert "error" not in row, row.get("error")
        assert row["rounds"] == 3 and row["ms"] == statistics.median(row["windows_ms"])
        assert row["throughput_vs_dense"] == pytest.approx(dense / row["ms"])
        assert len(row["throughput_vs_dense_rounds"]) == 3
        assert row["speedup_vs_hf_grouped_mm"] == pytest.approx(
            by_name[bench_moe.HF_GROUPED]["ms"] / row["ms"]
        )
    for name in (bench_moe.DEFAULT, bench_moe.DROP_AND_PAD):
        # The experts alone are timed in the same rounds as their layer.
        row = by_name[name]
        assert len(row["experts_windows_ms"]) == 3
        assert row["experts_ms"] == statistics.median(row["experts_windows_ms"])
        assert row["non_gemm_share"] == pytest.approx(1.0 - row["experts_ms"] / row["ms"])
    single = by_name["mcore MoELayer dropless, expert loop"]
    assert "windows_ms" not in single and single["throughput_vs_dense"] == pytest.approx(
        dense / single["ms"]
    )
    # Rows are published after every round (three) and every row afterwards (six).
    assert len(emitted) == 3 + len(rows)
    assert [row["rounds"] for row in emitted[0]] == [1] * 5
    table = bench_moe._markdown("cpu", rows)
    assert " (3) |" in table and "rounds: vs dense" in table


def test_run_case_with_zero_rounds_times_every_row_once() -> None:
    rows = bench_moe.run_case(
        "smoke",
        bench_moe.SMOKE["smoke"],
        torch.device("cpu"),
        smoke=True,
        profiles=None,
        rounds=0,
        only=["dense SwiGLU"],
    )
    assert len(rows) == 2
    assert all("windows_ms" not in row and "ms" in row for row in rows)
