"""The symmetric-memory kernels' arithmetic and barrier bookkeeping under the Triton interpreter.

The peers are emulated in one process: each rank's symmetric buffers are CPU tensors and the
pointer tables hold their addresses, exactly as the GPU path builds them from the rendezvous.
Ranks run one after the other, so the test fills what the first barrier guarantees (every
peer's staging buffer) and gives every signal slot the credits the peers would send; afterwards
each slot must hold those credits again (every program sent and took exactly one signal per
barrier).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_kernels.reference import rms_norm_reference


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    # Per test, not for the whole session: GPU tests collected alongside must compile.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


_EPS = 1e-5
_CAPACITY_ROWS = 16


def _peers(world: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    partials = [torch.randn(tokens, hidden, generator=generator).to(dtype) for _ in range(world)]
    residual = torch.randn(tokens, hidden, generator=generator).to(dtype)
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(dtype)
    return {"partials": partials, "residual": residual, "weight": weight}


def _expected(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 sum in rank order, rounded once, then the residual add + RMSNorm reference."""
    total = torch.zeros_like(case["partials"][0], dtype=torch.float32)
    for partial in case["partials"]:
        total += partial.float()
    reduced = total.to(case["residual"].dtype)
    return rms_norm_reference(reduced, case["weight"], _EPS, residual=case["residual"])


def _symmetric_buffers(world: int, hidden: int, dtype: torch.dtype, barriers: int) -> dict:
    from mcore_kernels.comm.symmetric import SIGNAL_PAD_SLOTS

    staging = [torch.zeros(_CAPACITY_ROWS, hidden, dtype=dtype) for _ in range(world)]
    output = [torch.zeros(2, _CAPACITY_ROWS, hidden, dtype=dtype) for _ in range(world)]
    credits = torch.zeros(SIGNAL_PAD_SLOTS // world, world, dtype=torch.int32)
    credits += barriers
    signal = []
    for rank in range(world):
        pad = credits.clone()
        pad[:, rank] = 0
        signal.append(pad.reshape(-1))
    return {
        "staging": staging,
        "output": output,
        "signal": signal,
        "staging_table": torch.tensor([t.data_ptr() for t in staging], dtype=torch.int64),
        "output_table": torch.tensor([t.data_ptr() for t in output], dtype=torch.int64),
        "signal_table": torch.tensor([t.data_ptr() for t in signal], dtype=torch.int64),
        "initial_signal": [pad.clone() for pad in signal],
    }


def _run_one_shot(case: dict, world: int) -> tuple[list, dict]:
    from mcore_kernels.comm.symmetric import launch_one_shot

    tokens, hidden = case["residual"].shape
    buffers = _symmetric_buffers(world, hidden, case["residual"].dtype, barriers=2)
    for rank in range(world):
        buffers["staging"][rank][:tokens] = case["partials"][rank]
    results = []
    for rank in range(world):
        normed = torch.empty_like(case["residual"])
        new_residual = torch.empty_like(case["residual"])
        launch_one_shot(
            case["partials"][rank],
            case["residual"],
            case["weight"],
            _EPS,
            normed,
            new_residual,
            buffers["staging_table"],
            buffers["signal_table"],
            rank,
            world,
        )
        results.append((normed, new_residual))
    return results, buffers


def _run_two_shot(case: dict, world: int) -> tuple[list, dict]:
    from mcore_kernels.comm.symmetric import launch_two_shot

    tokens, hidden = case["residual"].shape
    buffers = _symmetric_buffers(world, hidden, case["residual"].dtype, barriers=2)
    for rank in range(world):
        buffers["staging"][rank][:tokens] = case["partials"][rank]
    outputs = [
        (torch.empty_like(case["residual"]), torch.empty_like(case["residual"]))
        for _ in range(world)
    ]
    for phase in ("reduce", "gather"):
        for rank in range(world):
            launch_two_shot(
                case["partials"][rank],
                case["residual"],
                case["weight"],
                _EPS,
                outputs[rank][0],
                outputs[rank][1],
                buffers["staging_table"],
                buffers["output_table"],
                buffers["signal_table"],
                rank,
                world,
                _CAPACITY_ROWS,
                reduce=phase == "reduce",
                gather=phase == "gather",
            )
    return outputs, buffers


_CASES = [
    # (world, tokens, hidden, dtype): odd hidden sizes exercise the column mask, token counts
    # that no world size divides exercise the last slice's missing rows.
    (2, 1, 48, torch.bfloat16),
    (2, 5, 40, torch.float32),
    (4, 7, 24, torch.float16),
    (3, 4, 33, torch.bfloat16),
]


@pytest.mark.parametrize(("world", "tokens", "hidden", "dtype"), _CASES)
def test_one_shot_matches_reference_bitwise_on_every_rank(
    world: int, tokens: int, hidden: int, dtype: torch.dtype
) -> None:
    case = _peers(world, tokens, hidden, dtype, seed=tokens * 7 + hidden)
    expected_normed, expected_residual = _expected(case)
    results, _ = _run_one_shot(case, world)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for normed, new_residual in results:
        assert torch.equal(new_residual, expected_residual)
        torch.testing.assert_close(normed, expected_normed, rtol=tolerance, atol=tolerance)
        assert torch.equal(normed, results[0][0])


@pytest.mark.parametrize(("world", "tokens", "hidden", "dtype"), _CASES)
def test_two_shot_matches_reference_bitwise_on_every_rank(
    world: int, tokens: int, hidden: int, dtype: torch.dtype
) -> None:
    case = _peers(world, tokens, hidden, dtype, seed=tokens * 11 + hidden)
    expected_normed, expected_residual = _expected(case)
    results, _ = _run_two_shot(case, world)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for normed, new_residual in results:
        assert torch.equal(new_residual, expected_residual)
        torch.testing.assert_close(normed, expected_normed, rtol=tolerance, atol=tolerance)
        assert torch.equal(normed, results[0][0])


def test_one_shot_and_two_shot_agree_bitwise() -> None:
    case = _peers(4, 6, 32, torch.bfloat16, seed=3)
    one, _ = _run_one_shot(case, 4)
    two, _ = _run_two_shot(case, 4)
    for (normed_a, residual_a), (normed_b, residual_b) in zip(one, two, strict=True):
        assert torch.equal(normed_a, normed_b)
        assert torch.equal(residual_a, residual_b)


@pytest.mark.parametrize("strategy", ["one_shot", "two_shot"])
def test_barrier_sends_and_takes_one_signal_per_program_and_barrier(strategy: str) -> None:
    world, tokens = 3, 5
    case = _peers(world, tokens, 16, torch.float32, seed=5)
    run = _run_one_shot if strategy == "one_shot" else _run_two_shot
    _, buffers = run(case, world)
    programs = tokens if strategy == "one_shot" else -(-tokens // world)
    for rank in range(world):
        pad = buffers["signal"][rank].view(-1, world)
        initial = buffers["initial_signal"][rank].view(-1, world)
        # Programs that ran: credits consumed and re-sent by the peers; the others untouched.
        assert torch.equal(pad, initial)
        assert int(pad[:programs].sum()) == 2 * programs * (world - 1)


def test_staging_buffer_holds_this_ranks_partial_after_the_call() -> None:
    world, tokens, hidden = 2, 3, 16
    case = _peers(world, tokens, hidden, torch.bfloat16, seed=9)
    _, buffers = _run_one_shot(case, world)
    for rank in range(world):
        assert torch.equal(buffers["staging"][rank][:tokens], case["partials"][rank])


@pytest.mark.parametrize("strategy", ["one_shot", "two_shot"])
def test_programs_that_loop_over_several_rows_cover_every_token_once(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mcore_kernels.comm import symmetric

    # Fewer programs than rows, as on a GPU with more tokens than MAX_PROGRAMS.
    monkeypatch.setattr(symmetric, "MAX_PROGRAMS", 2)
    world, tokens = 2, 7
    case = _peers(world, tokens, 24, torch.bfloat16, seed=13)
    expected_normed, expected_residual = _expected(case)
    run = _run_one_shot if strategy == "one_shot" else _run_two_shot
    results, _ = run(case, world)
    for normed, new_residual in results:
        assert torch.equal(new_residual, expected_residual)
        torch.testing.assert_close(normed, expected_normed, rtol=2e-2, atol=2e-2)


def _single_rank_workspace(hidden: int, dtype: torch.dtype) -> Any:
    """A one-rank workspace over CPU tensors, as ``get_workspace`` builds one on GPUs."""
    from mcore_kernels.comm.symmetric import SymmetricWorkspace

    buffers = _symmetric_buffers(1, hidden, dtype, barriers=0)
    return SymmetricWorkspace(
        rank=0,
        world=1,
        capacity_rows=_CAPACITY_ROWS,
        buffers=(*buffers["staging"], *buffers["output"], *buffers["signal"]),
        handles=(),
        staging_table=buffers["staging_table"],
        output_table=buffers["output_table"],
        signal_table=buffers["signal_table"],
    )


@pytest.mark.parametrize("strategy", ["auto", "one_shot", "two_shot"])
def test_symmetric_entry_writes_out_in_place_including_the_residual(strategy: str) -> None:
    from mcore_kernels.comm.symmetric import symmetric_rs_add_rmsnorm_ag

    case = _peers(1, 5, 24, torch.bfloat16, seed=21)
    expected_normed, expected_residual = _expected(case)
    workspace = _single_rank_workspace(24, torch.bfloat16)
    residual = case["residual"].clone()
    normed_out = torch.empty_like(residual)
    returned = symmetric_rs_add_rmsnorm_ag(
        case["partials"][0],
        residual,
        case["weight"],
        _EPS,
        workspace,
        out=(normed_out, residual),
        strategy=strategy,
    )
    assert returned[0] is normed_out and returned[1] is residual
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(normed_out, expected_normed, rtol=2e-2, atol=2e-2)


def test_symmetric_entry_copies_into_non_contiguous_out() -> None:
    from mcore_kernels.comm.symmetric import symmetric_rs_add_rmsnorm_ag

    case = _peers(1, 4, 16, torch.float32, seed=22)
    expected_normed, expected_residual = _expected(case)
    workspace = _single_rank_workspace(16, torch.float32)
    normed_out = torch.empty(16, 4).t()
    residual_out = torch.empty(16, 4).t()
    symmetric_rs_add_rmsnorm_ag(
        case["partials"][0],
        case["residual"],
        case["weight"],
        _EPS,
        workspace,
        out=(normed_out, residual_out),
    )
    assert torch.equal(residual_out, expected_residual)
    torch.testing.assert_close(normed_out, expected_normed, rtol=1e-5, atol=1e-5)


def test_symmetric_entry_rejects_unknown_strategy_and_too_many_tokens() -> None:
    from mcore_kernels.comm.symmetric import symmetric_rs_add_rmsnorm_ag
    from mcore_kernels.errors import KernelShapeError, KernelValueError

    workspace = _single_rank_workspace(8, torch.float32)
    weight = torch.ones(8)
    with pytest.raises(KernelValueError, match="strategy='three_shot'"):
        symmetric_rs_add_rmsnorm_ag(
            torch.zeros(2, 8), torch.zeros(2, 8), weight, _EPS, workspace, strategy="three_shot"
        )
    rows = _CAPACITY_ROWS + 1
    with pytest.raises(KernelShapeError, match=f"{rows} tokens"):
        symmetric_rs_add_rmsnorm_ag(
            torch.zeros(rows, 8), torch.zeros(rows, 8), weight, _EPS, workspace
        )


@pytest.mark.parametrize(
    ("tokens", "world", "expected"),
    [(512, 2, "one_shot"), (4096, 2, "one_shot"), (64, 4, "one_shot"), (65, 4, "two_shot")],
)
def test_strategy_choice_keeps_one_shot_for_two_ranks_and_small_calls(
    tokens: int, world: int, expected: str
) -> None:
    from mcore_kernels.comm.symmetric import choose_strategy

    assert choose_strategy(tokens, world) == expected


def test_unavailable_reason_names_cpu_tensors_and_a_forced_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mcore_kernels.comm.availability import symmetric_memory_unavailable_reason

    assert "cpu" in str(symmetric_memory_unavailable_reason(torch.zeros(2, 8), None))
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    assert "MCORE_KERNELS_BACKEND=torch" in str(
        symmetric_memory_unavailable_reason(torch.zeros(2, 8), None)
    )


@pytest.mark.parametrize(
    ("tokens", "hidden", "world", "fragment"),
    [
        (4096, 16384, 8, None),
        (1, 4096, 9, "9 ranks"),
        (1, 16385, 2, "hidden=16385"),
        (4097, 4096, 2, "tokens=4097"),
    ],
)
def test_size_limits_send_larger_calls_to_the_collective_path(
    tokens: int, hidden: int, world: int, fragment: str | None
) -> None:
    from mcore_kernels.comm.availability import size_limit_reason

    reason = size_limit_reason(tokens, hidden, world)
    if fragment is None:
        assert reason is None
    else:
        assert reason is not None and fragment in reason
