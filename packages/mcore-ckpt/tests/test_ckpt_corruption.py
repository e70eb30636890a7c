"""Damaged checkpoints fail with errors that name the file at fault, in load, validate and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mcore_ckpt
from mcore_ckpt.cli import main
from mcore_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from mcore_ckpt.format import DCP_METADATA_FILE, METADATA_FILE
from mcore_ckpt.layout import LATEST_FILE


def _state() -> dict:
    return {"w": torch.arange(600.0).reshape(20, 30), "b": torch.ones(30), "step": 4}


def _target() -> dict:
    return {"w": torch.zeros(20, 30), "b": torch.zeros(30), "step": None}


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return mcore_ckpt.save(tmp_path, _state())


def _data_file(checkpoint: Path) -> Path:
    (data,) = checkpoint.glob("*.distcp")
    return data


def test_truncated_shard_file_fails_load_and_validate_naming_it(checkpoint):
    data = _data_file(checkpoint)
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CheckpointCorruptError, match=rf"{data.name} is truncated"):
        mcore_ckpt.load(checkpoint.parent, _target())
    with pytest.raises(CheckpointCorruptError, match=data.name):
        mcore_ckpt.validate_checkpoint(checkpoint)


def test_missing_shard_file_fails_naming_it(checkpoint):
    data = _data_file(checkpoint)
    data.unlink()
    with pytest.raises(CheckpointCorruptError, match=rf"{data.name} is missing"):
        mcore_ckpt.load(checkpoint, _target())


def test_altered_bytes_are_caught_by_verify_and_validate(checkpoint):
    data = _data_file(checkpoint)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=rf"{data.name} is corrupt: CRC-32"):
        mcore_ckpt.load(checkpoint, _target(), verify=True)
    with pytest.raises(CheckpointCorruptError, match=rf"{data.name} is corrupt"):
        mcore_ckpt.validate_checkpoint(checkpoint)


def test_unreadable_shard_that_fails_the_read_is_named_after_the_failure(checkpoint):
    data = _data_file(checkpoint)
    raw = bytearray(data.read_bytes())
    raw[:64] = bytes(64)  # wipes the serialisation header of the first record
    data.write_bytes(bytes(raw))
    target = _target()
    with pytest.raises(CheckpointCorruptError, match=rf"{data.name} is corrupt.*loading failed"):
        mcore_ckpt.load(checkpoint, target)


def test_garbled_storage_metadata_is_named(checkpoint):
    metadata = checkpoint / DCP_METADATA_FILE
    size = metadata.stat().st_size
    metadata.write_bytes(b"\x00" * size)
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata"):
        mcore_ckpt.load(checkpoint, _target())


def test_garbled_mcore_metadata_is_named(checkpoint):
    (checkpoint / METADATA_FILE).write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match=METADATA_FILE):
        mcore_ckpt.load(checkpoint, _target())


def test_latest_naming_a_missing_checkpoint_is_reported(checkpoint):
    (checkpoint.parent / LATEST_FILE).write_text("step_000000077\n")
    with pytest.raises(CheckpointCorruptError, match="step_000000077"):
        mcore_ckpt.load(checkpoint.parent, _target())


def _set_format_version(checkpoint: Path, version: int) -> None:
    path = checkpoint / METADATA_FILE
    raw = json.loads(path.read_text())
    raw["format_version"] = version
    path.write_text(json.dumps(raw))


def test_newer_format_version_says_which_and_to_upgrade(checkpoint):
    _set_format_version(checkpoint, 99)
    with pytest.raises(CheckpointVersionError, match=r"format_version=99.*upgrade mcore-ckpt"):
        mcore_ckpt.load(checkpoint, _target())


def test_retired_format_version_says_which_and_to_convert(checkpoint):
    _set_format_version(checkpoint, 0)
    with pytest.raises(CheckpointVersionError, match=r"format_version=0.*older mcore-ckpt"):
        mcore_ckpt.load(checkpoint, _target())


def test_nothing_is_written_into_the_target_when_a_file_is_missing(checkpoint):
    _data_file(checkpoint).unlink()
    target = _target()
    with pytest.raises(CheckpointCorruptError):
        mcore_ckpt.load(checkpoint, target)
    assert torch.equal(target["w"], torch.zeros(20, 30)) and target["step"] is None


def test_cli_validate_reports_ok_for_an_intact_checkpoint(checkpoint, capsys):
    assert main(["validate", str(checkpoint.parent)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK") and "2 tensors" in out and "1 objects" in out


def test_cli_validate_exits_1_naming_the_damaged_file(checkpoint, capsys):
    data = _data_file(checkpoint)
    data.write_bytes(data.read_bytes()[:10])
    assert main(["validate", str(checkpoint)]) == 1
    err = capsys.readouterr().err
    assert "CheckpointCorruptError" in err and data.name in err


def test_cli_on_a_path_without_checkpoint_exits_1(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no committed checkpoint" in capsys.readouterr().err
    with pytest.raises(CheckpointNotFoundError):
        mcore_ckpt.inspect_checkpoint(tmp_path)
