"""Round trips of nested state dicts in one process, the commit layout and argument errors."""

from __future__ import annotations

import pytest
import torch

import mcore_ckpt
from mcore_ckpt.errors import (
    CheckpointConfigError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointTypeError,
)
from mcore_ckpt.layout import LATEST_FILE, read_latest
from mcore_parallel.sharding import ShardedTensor


def nested_state() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(5, 7, generator=generator),
            "half": torch.randn(3, 4, generator=generator).to(torch.bfloat16),
            "ids": torch.arange(9, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "scale": torch.tensor(0.5),
        },
        "layers": [{"a": torch.randn(2, generator=generator)}, {"b": torch.ones(3, 2)}],
        "step": 42,
        "config": {"name": "tiny", "betas": (0.9, 0.95)},
        "empty": {},
    }


def zeros_like_state(state: dict) -> dict:
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def assert_same(got, expected, path="") -> None:
    assert type(got) is type(expected), path
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), path
        for key in expected:
            assert_same(got[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{path}.{i}")
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), path
    else:
        assert got == expected, path


def test_nested_state_dict_round_trips_in_place(tmp_path):
    saved = nested_state()
    mcore_ckpt.save(tmp_path, saved)
    target = zeros_like_state(saved)
    tensors_before = target["model"]["w"]
    mcore_ckpt.load(tmp_path, target)
    assert_same(target, saved)
    assert target["model"]["w"] is tensors_before  # filled in place, not replaced


def test_load_casts_into_the_target_dtype_and_device_tensor(tmp_path):
    saved = {"w": torch.randn(4, 4)}
    mcore_ckpt.save(tmp_path, saved)
    target = {"w": torch.zeros(4, 4, dtype=torch.float64)}
    mcore_ckpt.load(tmp_path, target)
    assert torch.equal(target["w"], saved["w"].double())


def test_sharded_blocks_saved_in_one_process_load_as_other_blocks(tmp_path):
    full = torch.arange(48.0).reshape(6, 8)
    mcore_ckpt.save(tmp_path, {"w": ShardedTensor(full.clone(), (6, 8), (0, 0))})
    block = ShardedTensor(torch.zeros(4, 3), (6, 8), (1, 5))
    mcore_ckpt.load(tmp_path, {"w": block})
    assert torch.equal(block.local, full[1:5, 5:8])


def test_view_into_larger_storage_saves_only_its_block(tmp_path):
    big = torch.randn(1000, 100)
    view = big[10:12]
    path = mcore_ckpt.save(tmp_path, {"v": view})
    info = mcore_ckpt.read_checkpoint_info(path)
    assert info.total_bytes < big.numel() * big.element_size() // 10
    target = {"v": torch.zeros(2, 100)}
    mcore_ckpt.load(tmp_path, target)
    assert torch.equal(target["v"], view)


def test_partial_load_reads_only_requested_keys(tmp_path):
    saved = nested_state()
    mcore_ckpt.save(tmp_path, saved)
    target = {"model": {"w": torch.zeros(5, 7)}}
    mcore_ckpt.load(tmp_path, target)
    assert torch.equal(target["model"]["w"], saved["model"]["w"])


def test_steps_are_numbered_and_latest_names_the_newest(tmp_path):
    first = mcore_ckpt.save(tmp_path, {"x": torch.tensor(1.0)})
    second = mcore_ckpt.save(tmp_path, {"x": torch.tensor(2.0)})
    explicit = mcore_ckpt.save(tmp_path, {"x": torch.tensor(3.0)}, step=100)
    assert [first.name, second.name, explicit.name] == [
        "step_000000000",
        "step_000000001",
        "step_000000100",
    ]
    assert read_latest(tmp_path) == explicit.name
    target = {"x": torch.tensor(0.0)}
    mcore_ckpt.load(second, target)
    assert target["x"].item() == 2.0
    mcore_ckpt.load(tmp_path, target)
    assert target["x"].item() == 3.0


def test_keep_last_deletes_all_but_the_newest(tmp_path):
    for value in range(5):
        mcore_ckpt.save(tmp_path, {"x": torch.tensor(float(value))}, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [LATEST_FILE, "step_000000003", "step_000000004"]


def test_saving_an_existing_step_raises_and_keeps_it(tmp_path):
    mcore_ckpt.save(tmp_path, {"x": torch.tensor(1.0)}, step=5)
    with pytest.raises(CheckpointExistsError, match="step=5"):
        mcore_ckpt.save(tmp_path, {"x": torch.tensor(2.0)}, step=5)
    target = {"x": torch.tensor(0.0)}
    mcore_ckpt.load(tmp_path, target)
    assert target["x"].item() == 1.0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"keep_last": 0}, "keep_last"), ({"step": -1}, "step"), ({"io_threads": 0}, "io_threads")],
)
def test_out_of_range_arguments_raise_naming_them(tmp_path, kwargs, name):
    with pytest.raises(CheckpointConfigError, match=name):
        mcore_ckpt.save(tmp_path, {"x": torch.tensor(1.0)}, **kwargs)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda root: mcore_ckpt.save(None, {"x": torch.ones(1)}), "path=None"),
        (lambda root: mcore_ckpt.save(root, {"x": torch.ones(1)}, async_save="no"), "async_save"),
        (lambda root: mcore_ckpt.load(root, {"x": torch.ones(1)}, verify=1), "verify=1"),
    ],
)
def test_wrongly_typed_path_or_flag_raises_naming_it(tmp_path, call, match):
    with pytest.raises(CheckpointTypeError, match=match):
        call(tmp_path)
    assert not any(tmp_path.iterdir())


def test_state_dict_that_is_not_a_dict_raises(tmp_path):
    with pytest.raises(CheckpointTypeError, match="state_dict must be a dict"):
        mcore_ckpt.save(tmp_path, [torch.ones(1)])  # type: ignore[arg-type]


def test_colliding_dotted_keys_raise(tmp_path):
    with pytest.raises(CheckpointTypeError, match=r"'a\.b'"):
        mcore_ckpt.save(tmp_path, {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})


def test_loading_a_key_absent_from_the_checkpoint_names_it(tmp_path):
    mcore_ckpt.save(tmp_path, {"x": torch.ones(2)})
    with pytest.raises(CheckpointMismatchError, match="'y'"):
        mcore_ckpt.load(tmp_path, {"x": torch.zeros(2), "y": torch.zeros(2)})


def test_loading_a_different_global_shape_names_both_shapes(tmp_path):
    mcore_ckpt.save(tmp_path, {"x": torch.ones(2, 3)})
    target = torch.zeros(3, 2)
    with pytest.raises(CheckpointMismatchError, match=r"\(3, 2\).*\(2, 3\)"):
        mcore_ckpt.load(tmp_path, {"x": target})
    assert torch.equal(target, torch.zeros(3, 2))


def test_loading_a_tensor_where_an_object_was_saved_raises(tmp_path):
    mcore_ckpt.save(tmp_path, {"x": 3})
    with pytest.raises(CheckpointMismatchError, match="Python object"):
        mcore_ckpt.load(tmp_path, {"x": torch.zeros(1)})


def test_loading_from_an_empty_directory_raises_not_found(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        mcore_ckpt.load(tmp_path, {"x": torch.zeros(1)})


def test_root_without_latest_marker_loads_the_newest_committed_checkpoint(tmp_path):
    # A crash between the rename of the first checkpoint and the marker update leaves this.
    mcore_ckpt.save(tmp_path, {"x": torch.tensor(1.0)})
    mcore_ckpt.save(tmp_path, {"x": torch.tensor(2.0)})
    (tmp_path / LATEST_FILE).unlink()
    target = {"x": torch.tensor(0.0)}
    info = mcore_ckpt.load(tmp_path, target)
    assert info.step == 1 and target["x"].item() == 2.0


class PendingParamGather:
    """Holds parameters whose all-gather is in flight until ``start_param_sync`` forces it,
    the contract of mcore-parallel's DistributedOptimizer and DistributedDataParallel."""

    def __init__(self, param: torch.Tensor, gathered: torch.Tensor) -> None:
        self.param = param
        self.gathered = gathered
        self.calls: list[bool] = []

    def start_param_sync(self, force_sync: bool = False) -> None:
        self.calls.append(force_sync)
        if force_sync:
            self.param.copy_(self.gathered)


@pytest.mark.parametrize("async_save", [False, True])
def test_pending_param_sync_is_forced_before_tensors_are_read(tmp_path, async_save):
    param = torch.zeros(4)
    owner = PendingParamGather(param, torch.arange(4.0))
    result = mcore_ckpt.save(tmp_path, {"w": param, "owner": owner}, async_save=async_save)
    if async_save:
        result.wait()
    assert owner.calls == [True]
    target = {"w": torch.zeros(4)}
    mcore_ckpt.load(tmp_path, target)
    assert torch.equal(target["w"], torch.arange(4.0))


def test_several_writer_threads_split_files_and_round_trip(tmp_path):
    saved = {f"w{i}": torch.full((64, 64), float(i)) for i in range(6)}
    path = mcore_ckpt.save(tmp_path, saved, io_threads=3)
    assert len(list(path.glob("*.distcp"))) == 3
    mcore_ckpt.validate_checkpoint(path)
    target = {name: torch.zeros(64, 64) for name in saved}
    mcore_ckpt.load(tmp_path, target, verify=True)
    for name, tensor in saved.items():
        assert torch.equal(target[name], tensor), name
