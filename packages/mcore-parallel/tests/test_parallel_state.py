"""ParallelState: group layout on 8 ranks, world size 1, invalid layouts, destroy and default."""

import os

import pytest
import torch.distributed as dist

from mcore_parallel import state as state_module
from mcore_parallel.errors import ParallelConfigError, ParallelStateError, ParallelTypeError
from mcore_parallel.state import initialize
from mcore_parallel.testing import free_port, run_distributed

_INVALID_LAYOUTS = [
    {"tp": 3},  # 8 ranks not divisible by 3
    {"tp": 2, "pp": 2, "cp": 1, "ep": 4},  # ep=4 does not divide dp*cp=2
    {"tp": 0},
    {"pp": -1},
    {"ep": 2.0},
]


def _layout_and_errors() -> dict:
    state = initialize(tp=2, pp=2, ep=2)
    layout = {
        name: getattr(state, f"{name}_ranks")
        for name in ("tp", "cp", "ep", "dp", "pp", "expert_dp", "dp_cp", "mp")
    }
    layout.update(
        rank=state.rank,
        world_size=state.world_size,
        sizes={
            name: getattr(state, f"{name}_size")
            for name in ("tp", "cp", "ep", "dp", "pp", "expert_dp", "dp_cp", "mp")
        },
        tp_rank=state.tp_rank,
        pp_rank=state.pp_rank,
        dp_rank=state.dp_rank,
        ep_rank=state.ep_rank,
        first=state.is_first_stage,
        last=state.is_last_stage,
        prev=state.pp_prev_rank,
        next=state.pp_next_rank,
        embedding=state.embedding_ranks,
        in_embedding=state.embedding_group is not None,
        device=str(state.device),
    )
    # The tp group really connects the listed ranks: an all-reduce of global ranks sums them.
    probe = __import__("torch").tensor([float(state.rank)])
    dist.all_reduce(probe, group=state.tp_group)
    layout["tp_sum"] = probe.item()
    errors = {}
    for kwargs in _INVALID_LAYOUTS:
        try:
            initialize(**kwargs)
        except ParallelConfigError as error:
            errors[str(kwargs)] = str(error)
    state.destroy()
    try:
        _ = state.tp_group
    except ParallelStateError:
        layout["destroyed_raises"] = True
    layout["default_still_up"] = dist.is_initialized()
    return {"layout": layout, "errors": errors}


def test_layout_tp2_pp2_ep2_on_8_ranks_and_invalid_layouts_raise():
    results = run_distributed(_layout_and_errors, 8)
    by_rank = {r["layout"]["rank"]: r["layout"] for r in results}
    # Ranks tp-cp-ep-dp-pp, tp contiguous: dp = 8 / (2*2) = 2, expert_dp = dp*cp/ep = 1.
    expected = {
        0: {"tp": [0, 1], "dp": [0, 2], "pp": [0, 4], "ep": [0, 2], "expert_dp": [0]},
        1: {"tp": [0, 1], "dp": [1, 3], "pp": [1, 5], "ep": [1, 3], "expert_dp": [1]},
        2: {"tp": [2, 3], "dp": [0, 2], "pp": [2, 6], "ep": [0, 2], "expert_dp": [2]},
        5: {"tp": [4, 5], "dp": [5, 7], "pp": [1, 5], "ep": [5, 7], "expert_dp": [5]},
        7: {"tp": [6, 7], "dp": [5, 7], "pp": [3, 7], "ep": [5, 7], "expert_dp": [7]},
    }
    for rank, groups in expected.items():
        for name, ranks in groups.items():
            assert by_rank[rank][name] == ranks, (rank, name)
    for rank, layout in by_rank.items():
        assert layout["world_size"] == 8
        assert layout["cp"] == [rank]
        assert layout["dp_cp"] == layout["dp"]
        assert layout["mp"] == sorted([r for r in range(8) if (r % 4) // 2 == (rank % 4) // 2])
        assert layout["sizes"] == {
            "tp": 2,
            "cp": 1,
            "ep": 2,
            "dp": 2,
            "pp": 2,
            "expert_dp": 1,
            "dp_cp": 2,
            "mp": 4,
        }
        assert layout["tp_rank"] == rank % 2
        assert layout["pp_rank"] == rank // 4
        assert layout["first"] == (rank < 4)
        assert layout["last"] == (rank >= 4)
        partner = rank + 4 if rank < 4 else rank - 4
        assert layout["prev"] == partner and layout["next"] == partner
        assert layout["embedding"] == sorted([rank, partner])
        assert layout["in_embedding"]
        assert layout["device"] == "cpu"
        assert layout["tp_sum"] == sum(layout["tp"])
        assert layout["destroyed_raises"]
        assert layout["default_still_up"], "destroy() must not tear down a group it did not create"
    errors = results[0]["errors"]
    assert set(errors) == {str(kwargs) for kwargs in _INVALID_LAYOUTS}
    assert "world_size=8" in errors[str({"tp": 3})] and "3" in errors[str({"tp": 3})]
    assert (
        "ep=4" in errors[str(_INVALID_LAYOUTS[1])] and "dp*cp" in errors[str(_INVALID_LAYOUTS[1])]
    )
    assert "tp=0" in errors[str({"tp": 0})]


def _cp_expert_layout() -> dict:
    state = initialize(tp=1, cp=2, ep=4)
    return {
        "cp": state.cp_ranks,
        "dp": state.dp_ranks,
        "dp_cp": state.dp_cp_ranks,
        "ep": state.ep_ranks,
        "expert_dp": state.expert_dp_ranks,
    }


def _single_rank() -> dict:
    state = initialize()
    result = {name: getattr(state, f"{name}_size") for name in ("tp", "pp", "dp", "ep")}
    result["first_and_last"] = state.is_first_stage and state.is_last_stage
    state_module.set_default(state)
    result["default_is_state"] = state_module.get_default() is state
    state.destroy()
    try:
        state_module.get_default()
    except ParallelStateError:
        result["default_cleared"] = True
    return result


def test_world_size_1_is_all_ones_and_default_is_cleared_on_destroy():
    (result,) = run_distributed(_single_rank, 1)
    assert result == {
        "tp": 1,
        "pp": 1,
        "dp": 1,
        "ep": 1,
        "first_and_last": True,
        "default_is_state": True,
        "default_cleared": True,
    }


def _initialize_from_environment() -> dict:
    # run_distributed initialised torch.distributed; start over as a torchrun-launched script,
    # on a port picked just now (a port picked in the parent could be taken by then).
    port = [free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    os.environ["MASTER_PORT"] = str(port[0])
    dist.destroy_process_group()
    state = initialize(tp=2, backend="gloo")
    result = {"world_size": state.world_size, "tp_ranks": state.tp_ranks}
    state.destroy()
    result["default_destroyed"] = not dist.is_initialized()
    return result


def test_initialize_sets_up_torch_distributed_from_the_environment():
    results = run_distributed(_initialize_from_environment, 2)
    assert results == [{"world_size": 2, "tp_ranks": [0, 1], "default_destroyed": True}] * 2


def test_initialize_without_environment_raises(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ParallelStateError, match="RANK"):
        initialize()


def test_set_default_rejects_non_state():
    with pytest.raises(ParallelTypeError, match="ParallelState"):
        state_module.set_default("tp=2")


def test_get_default_without_state_raises():
    state_module.set_default(None)
    with pytest.raises(ParallelStateError, match="set_default"):
        state_module.get_default()


def _etp_layouts() -> dict:
    # tp=2 dense, experts over ep=4 with etp=1: every rank holds whole experts of its own.
    narrow = initialize(tp=2, ep=4, etp=1)
    result = {
        "rank": narrow.rank,
        "narrow": {n: getattr(narrow, f"{n}_ranks") for n in ("tp", "ep", "etp", "expert_dp")},
    }
    # Default etp = tp: the expert layout of earlier versions (experts replicated over tp).
    default = initialize(tp=2, ep=2)
    result["default"] = {n: getattr(default, f"{n}_ranks") for n in ("tp", "ep", "etp")}
    try:
        initialize(tp=2, ep=8, etp=1)
    except ParallelConfigError as error:
        result["error"] = str(error)
    return result


def test_expert_tensor_parallel_size_reshapes_only_the_expert_groups():
    results = run_distributed(_etp_layouts, 4)
    for result in results:
        rank = result["rank"]
        assert result["narrow"] == {
            "tp": [rank - rank % 2, rank - rank % 2 + 1],
            "ep": [0, 1, 2, 3],
            "etp": [rank],
            "expert_dp": [rank],
        }
        assert result["default"]["etp"] == result["default"]["tp"]
        assert result["default"]["ep"] == [rank % 2, rank % 2 + 2]
        assert "ep*etp = 8*1" in result["error"] and "tp*cp*dp" in result["error"]


def _accessor_checks() -> dict:
    state = initialize(tp=2, cp=2)
    result: dict = {"rank": state.rank, "rank_is_global_int": isinstance(state.rank, int)}
    result["same"] = all(
        state.group(name) is getattr(state, f"{name}_group")
        and state.size(name) == getattr(state, f"{name}_size") == len(state.ranks(name))
        and state.rank_in(name) == getattr(state, f"{name}_rank")
        and state.ranks(name) == getattr(state, f"{name}_ranks")
        and state.ranks(name)[state.rank_in(name)] == state.rank
        for name in state_module.DIMENSIONS
    )
    result["cp"] = (state.ranks("cp"), state.rank_in("cp"), state.size("cp"))
    # state.rank stays the global int and also answers rank(name).
    result["rank_call"] = [
        state.rank(name) == state.rank_in(name) for name in state_module.DIMENSIONS
    ]
    result["rank_arithmetic"] = (state.rank + 1, f"{state.rank}", [10, 11, 12, 13][state.rank])
    result["hasattr_unknown"] = hasattr(state, "foo_group") or hasattr(state, "tp_colour")
    try:
        state.size("tensor")
    except ParallelConfigError as error:
        result["error"] = str(error)
    state.destroy()
    try:
        state.group("cp")
    except ParallelStateError as error:
        result["destroyed"] = str(error)
    return result


def test_one_accessor_serves_every_dimension_and_the_attribute_spellings():
    for result in run_distributed(_accessor_checks, 4):
        rank = result["rank"]
        assert result["rank_is_global_int"] and result["same"]
        # tp=2 contiguous, cp=2 next: cp partners differ by 2.
        assert result["cp"] == ([rank % 2, rank % 2 + 2], rank // 2, 2)
        assert all(result["rank_call"])
        assert result["rank_arithmetic"] == (rank + 1, str(rank), 10 + rank)
        assert not result["hasattr_unknown"]
        assert "name='tensor'" in result["error"] and "'expert_dp'" in result["error"]
        assert "group('cp')" in result["destroyed"] and "destroy()" in result["destroyed"]
