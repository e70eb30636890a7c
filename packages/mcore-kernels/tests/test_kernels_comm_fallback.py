"""The collective path of ``fused_rs_add_rmsnorm_ag`` on real gloo groups of 2 and 4 ranks.

mcore-kernels may not depend on mcore-parallel, so the ranks are started by the suite's own
helper (``_kernels_spawn.run_ranks``). Each spawned group runs every multi-rank check once and returns its observations; the
tests then assert on them against a single-process torch reference.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kernels_spawn import run_ranks

from mcore_kernels.comm import fused_rs_add_rmsnorm_ag, rs_add_rmsnorm_ag_collectives
from mcore_kernels.errors import (
    KernelDeviceError,
    KernelDtypeError,
    KernelShapeError,
    KernelValueError,
)

_TIMEOUT_S = 60.0
_EPS = 1e-6
# (tokens, hidden): a single decode token, a count no world size divides, a larger batch.
_SHAPES = ((1, 16), (5, 48), (8, 32))


def _inputs(
    world: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every rank's partials, the residual and the weight, the same on every rank.

    Values are multiples of 1/8 below 4 in magnitude: their sums are exact in bfloat16, so the
    reference does not depend on the order in which a backend reduces.
    """
    generator = torch.Generator().manual_seed(seed)
    partials = [
        (torch.randint(-24, 25, (tokens, hidden), generator=generator) / 8).to(dtype)
        for _ in range(world)
    ]
    residual = (torch.randint(-24, 25, (tokens, hidden), generator=generator) / 8).to(dtype)
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(dtype)
    return partials, residual, weight


def _reference(
    partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process reference: sum, add, RMSNorm in float32."""
    total = torch.stack([p.double() for p in partials]).sum(0).to(partials[0].dtype)
    hidden = total + residual
    h = hidden.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(residual.dtype), hidden


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _checks_on_rank(rank: int, world: int) -> dict[str, Any]:
    handler = _ListHandler()
    logging.getLogger("mcore_kernels.comm").addHandler(handler)
    logging.getLogger("mcore_kernels.comm").setLevel(logging.INFO)
    observed: dict[str, Any] = {"results": {}}
    for index, (tokens, hidden) in enumerate(_SHAPES):
        for dtype in (torch.bfloat16, torch.float32):
            partials, residual, weight = _inputs(world, tokens, hidden, dtype, seed=index)
            residual_before = residual.clone()
            normed, new_residual = fused_rs_add_rmsnorm_ag(
                partials[rank], residual, weight, _EPS, None
            )
            observed["results"][(tokens, hidden, dtype)] = (normed, new_residual)
            observed.setdefault("residual_untouched", []).append(
                torch.equal(residual, residual_before)
            )
    # In place: the new residual overwrites the residual, the normed rows a given buffer.
    partials, residual, weight = _inputs(world, 6, 24, torch.bfloat16, seed=7)
    expected = fused_rs_add_rmsnorm_ag(partials[rank], residual.clone(), weight, _EPS, None)
    normed_out = torch.empty_like(residual)
    returned = fused_rs_add_rmsnorm_ag(
        partials[rank], residual, weight, _EPS, None, out=(normed_out, residual)
    )
    observed["out_in_place"] = (
        returned[0] is normed_out
        and returned[1] is residual
        and torch.equal(normed_out, expected[0])
        and torch.equal(residual, expected[1])
    )
    # A subgroup: the op must use the group's own ranks, not the world's.
    subgroup = dist.new_group([0, 1])
    if rank in (0, 1):
        partials, residual, weight = _inputs(2, 3, 16, torch.float32, seed=11)
        observed["subgroup"] = fused_rs_add_rmsnorm_ag(
            partials[rank], residual, weight, _EPS, subgroup
        )
    # Matching the unfused sequence exactly, with random (inexact) values.
    generator = torch.Generator().manual_seed(100 + rank)
    partial = torch.randn(5, 40, generator=generator).to(torch.bfloat16)
    residual = torch.randn(5, 40, generator=torch.Generator().manual_seed(99)).bfloat16()
    weight = torch.randn(40, generator=torch.Generator().manual_seed(98)).bfloat16()
    observed["random"] = fused_rs_add_rmsnorm_ag(partial, residual, weight, _EPS, None)
    observed["random_collectives"] = rs_add_rmsnorm_ag_collectives(
        partial, residual, weight, _EPS, None
    )
    observed["log"] = list(handler.messages)
    return observed


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def gloo_run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    return world, run_ranks(_checks_on_rank, world, timeout_s=_TIMEOUT_S)


def test_fallback_matches_single_process_reference(
    gloo_run: tuple[int, list[dict[str, Any]]],
) -> None:
    world, observed = gloo_run
    for index, (tokens, hidden) in enumerate(_SHAPES):
        for dtype in (torch.bfloat16, torch.float32):
            partials, residual, weight = _inputs(world, tokens, hidden, dtype, seed=index)
            expected_normed, expected_residual = _reference(partials, residual, weight, _EPS)
            tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
            for rank in range(world):
                normed, new_residual = observed[rank]["results"][(tokens, hidden, dtype)]
                assert normed.shape == (tokens, hidden) and normed.dtype == dtype
                torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
                torch.testing.assert_close(normed, expected_normed, rtol=tolerance, atol=tolerance)


def test_fallback_results_are_bitwise_identical_across_ranks(
    gloo_run: tuple[int, list[dict[str, Any]]],
) -> None:
    world, observed = gloo_run
    for key, (normed, new_residual) in observed[0]["results"].items():
        for rank in range(1, world):
            other_normed, other_residual = observed[rank]["results"][key]
            assert torch.equal(normed, other_normed), key
            assert torch.equal(new_residual, other_residual), key


def test_fallback_leaves_residual_untouched_and_fills_out_in_place(
    gloo_run: tuple[int, list[dict[str, Any]]],
) -> None:
    _, observed = gloo_run
    for per_rank in observed:
        assert all(per_rank["residual_untouched"])
        assert per_rank["out_in_place"]


def test_fallback_reduces_over_the_given_subgroup_only(
    gloo_run: tuple[int, list[dict[str, Any]]],
) -> None:
    _, observed = gloo_run
    partials, residual, weight = _inputs(2, 3, 16, torch.float32, seed=11)
    expected = _reference(partials, residual, weight, _EPS)
    for rank in (0, 1):
        normed, new_residual = observed[rank]["subgroup"]
        torch.testing.assert_close(new_residual, expected[1], rtol=0, atol=0)
        torch.testing.assert_close(normed, expected[0], rtol=1e-5, atol=1e-5)


def test_fused_equals_unfused_collective_sequence_bitwise(
    gloo_run: tuple[int, list[dict[str, Any]]],
) -> None:
    _, observed = gloo_run
    for per_rank in observed:
        for got, want in zip(per_rank["random"], per_rank["random_collectives"], strict=True):
            assert torch.equal(got, want)


def test_fallback_reason_is_logged_once_per_process(
    gloo_run: tuple[int, list[dict[str, Any]]],
) -> None:
    _, observed = gloo_run
    for per_rank in observed:
        assert len(per_rank["log"]) == 1, per_rank["log"]
        assert "cpu" in per_rank["log"][0].lower()


def _valid_args() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.zeros(4, 8), torch.zeros(4, 8), torch.ones(8)


@pytest.mark.parametrize(
    ("change", "error", "fragment"),
    [
        ({"partial": torch.zeros(4, 8, dtype=torch.int32)}, KernelDtypeError, "partial.dtype"),
        ({"partial": torch.zeros(2, 4, 8)}, KernelShapeError, "partial.shape"),
        ({"residual": torch.zeros(3, 8)}, KernelShapeError, "residual.shape"),
        ({"residual": torch.zeros(4, 8, dtype=torch.float16)}, KernelDtypeError, "residual.dtype"),
        ({"weight": torch.ones(7)}, KernelShapeError, "weight.shape"),
        ({"weight": "ones"}, KernelDtypeError, "weight must be a torch.Tensor"),
        ({"eps": -1.0}, KernelValueError, "eps=-1.0"),
        ({"eps": float("nan")}, KernelValueError, "eps=nan"),
        ({"group": "tp"}, KernelValueError, "group='tp'"),
        ({"out": (torch.empty(4, 8),)}, KernelShapeError, "out="),
        ({"out": (torch.empty(4, 8), torch.empty(4, 9))}, KernelShapeError, "out[1]"),
    ],
)
def test_bad_arguments_raise_typed_errors_naming_them(
    change: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    partial, residual, weight = _valid_args()
    kwargs: dict[str, Any] = {
        "partial": partial,
        "residual": residual,
        "weight": weight,
        "eps": _EPS,
        "group": None,
    }
    out = change.pop("out", None)
    kwargs.update(change)
    with pytest.raises(error, match=fragment.replace("[", r"\[").replace("(", r"\(")):
        fused_rs_add_rmsnorm_ag(**kwargs, out=out)


def test_call_without_initialised_process_group_raises() -> None:
    partial, residual, weight = _valid_args()
    assert not dist.is_initialized()
    with pytest.raises(KernelValueError, match="not initialised"):
        fused_rs_add_rmsnorm_ag(partial, residual, weight, _EPS, None)


def test_tensors_on_different_devices_raise() -> None:
    partial, residual, weight = _valid_args()
    with pytest.raises(KernelDeviceError, match="weight is on meta"):
        fused_rs_add_rmsnorm_ag(partial, residual, weight.to("meta"), _EPS, None)
