"""``mcore-ckpt inspect``, ``validate`` and ``convert`` on the committed v1 fixture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mcore_ckpt.cli import main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "v1"


def test_inspect_lists_tensors_with_shape_dtype_sharding_and_versions(capsys):
    assert main(["inspect", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "format      v1, step 3" in out
    assert "mcore-ckpt 0.1.0" in out and "torch " in out
    lines = {
        line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")
    }
    assert lines["model.embedding.weight"][:2] == ["4x3", "float32"]
    assert " ".join(lines["model.embedding.weight"][2:6]) == "2 chunks along dim"
    assert lines["model.proj.weight"][:2] == ["2x4", "bfloat16"]
    assert lines["model.norm.weight"][2] == "whole"
    assert "optimizer.step" in lines and "config" in lines


def test_inspect_json_is_machine_readable(capsys):
    assert main(["inspect", "--json", str(FIXTURE)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format_version"] == 1
    assert report["layout"] == {"world_size": 2}
    assert report["tensors"]["model.proj.weight"] == {
        "shape": [2, 4],
        "dtype": "bfloat16",
        "sharding": "2 chunks along dim 1",
        "bytes": 16,
    }
    assert report["total_bytes"] == sum(report["files"].values())


def test_validate_accepts_the_fixture(capsys):
    assert main(["validate", str(FIXTURE / "step_000000003")]) == 0
    assert capsys.readouterr().out.startswith("OK ")


def test_unknown_command_is_a_usage_error():
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(FIXTURE)])
    assert exit_info.value.code == 2


def test_convert_writes_full_tensors_and_objects_into_one_torch_file(tmp_path, capsys):
    output = tmp_path / "full.pt"
    assert main(["convert", str(FIXTURE), str(output)]) == 0
    assert "wrote" in capsys.readouterr().out
    flat = torch.load(output, weights_only=False)
    assert torch.equal(flat["model.embedding.weight"], (torch.arange(12.0) / 4).reshape(4, 3))
    assert flat["model.proj.weight"].dtype == torch.bfloat16
    assert flat["optimizer.step"] == 3
    assert flat["config"] == {"name": "fixture-v1", "lr": 0.001}
    assert [p.name for p in tmp_path.iterdir()] == ["full.pt"]


@pytest.mark.parametrize("where", ["missing_dir", "is_a_dir"])
def test_convert_to_an_unwritable_output_exits_1_naming_it(tmp_path, capsys, where):
    output = tmp_path / "absent" / "full.pt" if where == "missing_dir" else tmp_path
    assert main(["convert", str(FIXTURE), str(output)]) == 1
    err = capsys.readouterr().err
    assert "CheckpointWriteError" in err and f"output={str(output)!r}" in err
