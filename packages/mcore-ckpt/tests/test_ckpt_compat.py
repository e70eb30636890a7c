"""Format-version fixtures load, and pickles naming renamed or removed classes load via the remap."""

from __future__ import annotations

import copyreg
import dataclasses
import io
import json
import pickle
import sys
import types
import zlib
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties

import mcore_ckpt
from mcore_ckpt.compat import load_pickle
from mcore_ckpt.errors import CheckpointCorruptError, CheckpointVersionError
from mcore_ckpt.format import DCP_METADATA_FILE, METADATA_FILE, READERS
from mcore_parallel.sharding import ShardedTensor

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _fixture_v1_expected() -> dict:
    return {
        "model": {
            "embedding.weight": torch.tensor(
                [[i / 4 for i in range(r * 3, r * 3 + 3)] for r in range(4)]
            ),
            "proj.weight": torch.tensor(
                [[-1.0, -0.5, 0.0, 0.5], [1.0, 1.5, 2.0, 2.5]], dtype=torch.bfloat16
            ),
            "norm.weight": torch.tensor([1.0, 2.0, 3.0]),
            "ids": torch.tensor([0, 1, 2, 3, 4]),
        },
        "optimizer": {
            "state": {"embedding.weight": {"exp_avg": torch.linspace(-1.0, 1.0, 12)}},
            "step": 3,
        },
        "config": {"name": "fixture-v1", "lr": 0.001},
    }


def _zeros_like(tree):
    if isinstance(tree, dict):
        return {k: _zeros_like(v) for k, v in tree.items()}
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else None


def test_every_readable_format_version_has_a_fixture():
    for version in READERS:
        assert (FIXTURES / f"v{version}" / "latest").is_file(), version
        assert (FIXTURES / f"make_fixture_v{version}.py").is_file(), version


def test_format_v1_fixture_loads_whole_tensors_and_objects():
    expected = _fixture_v1_expected()
    target = _zeros_like(expected)
    info = mcore_ckpt.load(FIXTURES / "v1", target)
    assert info.format_version == 1 and info.step == 3 and info.layout["world_size"] == 2
    for name, tensor in expected["model"].items():
        assert torch.equal(target["model"][name], tensor), name
    assert torch.equal(
        target["optimizer"]["state"]["embedding.weight"]["exp_avg"],
        expected["optimizer"]["state"]["embedding.weight"]["exp_avg"],
    )
    assert target["optimizer"]["step"] == 3
    assert target["config"] == expected["config"]


def test_format_v1_fixture_loads_as_blocks_of_another_layout():
    expected = _fixture_v1_expected()["model"]["embedding.weight"]
    block = ShardedTensor(torch.zeros(3, 2), (4, 3), (1, 1))
    mcore_ckpt.load(FIXTURES / "v1", {"model": {"embedding.weight": block}})
    assert torch.equal(block.local, expected[1:4, 1:3])


def test_format_v1_fixture_validates():
    info = mcore_ckpt.validate_checkpoint(FIXTURES / "v1")
    assert set(info.tensors) >= {"model.embedding.weight", "model.proj.weight"}


def _temporary_module(name: str, **classes: type) -> types.ModuleType:
    module = types.ModuleType(name)
    for cls_name, cls in classes.items():
        cls.__module__ = name
        cls.__qualname__ = cls_name
        setattr(module, cls_name, cls)
    sys.modules[name] = module
    return module


@dataclasses.dataclass
class RenamedConfig:
    width: int
    name: str


def test_object_of_a_removed_class_names_it_and_loads_after_registering_a_rename(tmp_path):
    @dataclasses.dataclass
    class OldConfig:
        width: int
        name: str

    _temporary_module("legacy_ckpt_objects", OldConfig=OldConfig)
    try:
        mcore_ckpt.save(tmp_path, {"config": OldConfig(width=64, name="tiny")})
    finally:
        del sys.modules["legacy_ckpt_objects"]
    target = {"config": None}
    with pytest.raises(
        CheckpointVersionError, match=r"legacy_ckpt_objects\.OldConfig.*register_class_rename"
    ):
        mcore_ckpt.load(tmp_path, target)
    mcore_ckpt.register_class_rename("legacy_ckpt_objects.OldConfig", RenamedConfig)
    try:
        mcore_ckpt.load(tmp_path, target)
    finally:
        mcore_ckpt.unregister_class_rename("legacy_ckpt_objects.OldConfig")
    assert target["config"] == RenamedConfig(width=64, name="tiny")


def _rewrite_file(checkpoint: Path, name: str, payload: bytes) -> None:
    """Replaces one file and records its size and checksum, as the writer would have."""
    (checkpoint / name).write_bytes(payload)
    metadata_path = checkpoint / METADATA_FILE
    raw = json.loads(metadata_path.read_text())
    raw["files"][name] = {
        "size": len(payload),
        "segment_bytes": 1 << 30,
        "crc32": [zlib.crc32(payload)],
    }
    metadata_path.write_text(json.dumps(raw))


def test_storage_metadata_pickled_as_a_removed_subclass_loads_after_a_rename(tmp_path):
    """The MCoreMetadata situation: the storage metadata pickle names a planner subclass."""

    @dataclasses.dataclass
    class MCoreMetadata(Metadata):
        mcore_data: dict = dataclasses.field(default_factory=dict)

    checkpoint = mcore_ckpt.save(tmp_path, {"w": torch.arange(6.0)})
    original = pickle.loads((checkpoint / DCP_METADATA_FILE).read_bytes())
    _temporary_module("legacy_dcp_planner", MCoreMetadata=MCoreMetadata)
    try:
        legacy = MCoreMetadata(
            state_dict_metadata=original.state_dict_metadata,
            planner_data=original.planner_data,
            storage_data=original.storage_data,
            mcore_data={"w": {"nd_reformulated_orig_global_shape": None}},
        )
        _rewrite_file(checkpoint, DCP_METADATA_FILE, pickle.dumps(legacy))
    finally:
        del sys.modules["legacy_dcp_planner"]
    target = {"w": torch.zeros(6)}
    with pytest.raises(CheckpointVersionError, match=r"legacy_dcp_planner\.MCoreMetadata"):
        mcore_ckpt.load(tmp_path, target)
    mcore_ckpt.register_class_rename(
        "legacy_dcp_planner.MCoreMetadata", "torch.distributed.checkpoint.metadata.Metadata"
    )
    try:
        assert mcore_ckpt.class_renames()["legacy_dcp_planner.MCoreMetadata"].endswith(".Metadata")
        mcore_ckpt.load(tmp_path, target)
    finally:
        mcore_ckpt.unregister_class_rename("legacy_dcp_planner.MCoreMetadata")
    assert torch.equal(target["w"], torch.arange(6.0))


# TensorProperties pickles as NEWOBJ + BUILD(state tuple); torch releases differ in the tuple's
# length (5 fields up to torch 2.11, strides appended in 2.15). These helpers write the state
# an older (first 5 fields) or a newer (one more field appended) torch would have written,
# whatever torch runs the test.
_CORE_FIELDS = 5
_STATE_OF = {
    "older torch": lambda state: state[:_CORE_FIELDS],
    "newer torch": lambda state: (*state, ("field-of-a-later-torch",)),
    "damaged": lambda state: state[:3],
}


class _StatePickler(pickle.Pickler):
    def __init__(self, file, fit):
        super().__init__(file, protocol=4)
        self._fit = fit

    def reducer_override(self, obj):
        if type(obj) is TensorProperties:
            return copyreg.__newobj__, (TensorProperties,), self._fit(tuple(obj.__getstate__()))
        return NotImplemented


def _pickle_as_written_by(obj, writer: str) -> bytes:
    buffer = io.BytesIO()
    _StatePickler(buffer, _STATE_OF[writer]).dump(obj)
    return buffer.getvalue()


@pytest.mark.parametrize("writer", ["older torch", "newer torch"])
def test_tensor_properties_pickled_by_another_torch_unpickle_as_this_torchs_class(writer):
    written = TensorProperties(dtype=torch.bfloat16, pin_memory=True)
    loaded = load_pickle(io.BytesIO(_pickle_as_written_by(written, writer)))
    assert type(loaded) is TensorProperties
    core = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    assert [getattr(loaded, f) for f in core] == [getattr(written, f) for f in core]
    assert pickle.loads(pickle.dumps(loaded)) == loaded


@pytest.mark.parametrize("writer", ["older torch", "newer torch"])
def test_checkpoint_whose_storage_metadata_another_torch_wrote_loads_and_validates(
    tmp_path, writer
):
    state = {
        "w": torch.arange(6.0),
        "h": ShardedTensor(torch.linspace(-1, 1, 8).to(torch.bfloat16), (8,), (0,)),
    }
    checkpoint = mcore_ckpt.save(tmp_path, state)
    metadata = pickle.loads((checkpoint / DCP_METADATA_FILE).read_bytes())
    _rewrite_file(checkpoint, DCP_METADATA_FILE, _pickle_as_written_by(metadata, writer))
    mcore_ckpt.validate_checkpoint(tmp_path)
    target = {
        "w": torch.zeros(6),
        "h": ShardedTensor(torch.zeros(8, dtype=torch.bfloat16), (8,), (0,)),
    }
    mcore_ckpt.load(tmp_path, target)
    assert torch.equal(target["w"], torch.arange(6.0))
    assert torch.equal(target["h"].local, torch.linspace(-1, 1, 8).to(torch.bfloat16))


def test_storage_metadata_with_a_damaged_tensor_properties_state_names_the_file(tmp_path):
    checkpoint = mcore_ckpt.save(tmp_path, {"w": torch.arange(6.0)})
    metadata = pickle.loads((checkpoint / DCP_METADATA_FILE).read_bytes())
    _rewrite_file(checkpoint, DCP_METADATA_FILE, _pickle_as_written_by(metadata, "damaged"))
    with pytest.raises(
        CheckpointCorruptError, match=r"\.metadata is unreadable.*at least 5 fields"
    ):
        mcore_ckpt.load(tmp_path, {"w": torch.zeros(6)})
