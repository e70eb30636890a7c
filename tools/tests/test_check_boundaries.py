"""The dependency-boundary checker on small synthetic workspaces."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import check_boundaries
import workspace


def _package(root: Path, name: str, deps: list[str], *, extras=None, test=None, src="", tests=""):
    pkg = root / "packages" / f"mcore-{name}"
    (pkg / "src" / f"mcore_{name}").mkdir(parents=True)
    (pkg / "tests").mkdir()
    extras_toml = ""
    if extras:
        extras_toml = "[project.optional-dependencies]\n" + "".join(
            f"{k} = {v!r}\n".replace("'", '"') for k, v in extras.items()
        )
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [project]
            name = "mcore-{name}"
            version = "0.1.0"
            dependencies = {deps!r}
            """
        ).replace("'", '"')
        + extras_toml
        + "[dependency-groups]\n"
        + f"test = {test or []!r}\n".replace("'", '"')
    )
    (pkg / "src" / f"mcore_{name}" / "__init__.py").write_text(textwrap.dedent(src))
    (pkg / "tests" / f"test_{name}.py").write_text(textwrap.dedent(tests))
    return pkg


def test_declared_sibling_and_stdlib_pass(tmp_path):
    _package(tmp_path, "leaf", ["torch>=2"], src="import os\nimport torch\n")
    pkg = _package(
        tmp_path,
        "top",
        ["mcore-leaf>=0.1,<0.2", "numpy"],
        src="import json\nimport mcore_leaf\nfrom numpy import linalg\n",
    )
    assert check_boundaries.check_package(pkg) == []


def test_undeclared_sibling_is_reported(tmp_path):
    _package(tmp_path, "leaf", [])
    pkg = _package(tmp_path, "top", [], src="from mcore_leaf import x\n")
    (violation,) = check_boundaries.check_package(pkg)
    assert violation.module == "mcore_leaf"
    assert "not declared" in violation.reason


def test_undeclared_third_party_is_reported_even_if_transitive(tmp_path):
    pkg = _package(tmp_path, "top", ["torch"], src="import torch\nimport numpy\n")
    assert [v.module for v in check_boundaries.check_package(pkg)] == ["numpy"]


def test_extra_must_be_imported_lazily(tmp_path):
    src = """
    import transformer_engine

    def use():
        import transformer_engine.pytorch
    """
    pkg = _package(tmp_path, "top", [], extras={"te": ["transformer-engine>=2"]}, src=src)
    (violation,) = check_boundaries.check_package(pkg)
    assert violation.line == 2
    assert "lazily" in violation.reason


def test_test_group_allowed_only_in_tests(tmp_path):
    pkg = _package(
        tmp_path,
        "top",
        [],
        test=["pytest", "transformers"],
        src="import transformers\n",
        tests="import pytest\nimport transformers\n",
    )
    violations = check_boundaries.check_package(pkg)
    assert [(v.path.parts[-3], v.module) for v in violations] == [("src", "transformers")]


def test_main_returns_nonzero_on_violation(tmp_path, capsys):
    _package(tmp_path, "top", [], src="import requests\n")
    assert check_boundaries.main([str(tmp_path)]) == 1
    assert "requests" in capsys.readouterr().out


def test_requirement_name_normalises_markers_and_case():
    assert workspace.requirement_name("Triton>=3.2; sys_platform == 'linux'") == "triton"
    assert workspace.requirement_name("safe_tensors.x[extra]>=1") == "safe-tensors-x"
    with pytest.raises(ValueError, match="requirement"):
        workspace.requirement_name(">=1")


def test_dependency_closure_follows_edges(tmp_path):
    _package(tmp_path, "leaf", [])
    _package(tmp_path, "mid", ["mcore-leaf>=0.1"])
    _package(tmp_path, "top", ["mcore-mid>=0.1", "torch"])
    assert workspace.dependency_closure("top", tmp_path) == {"top", "mid", "leaf"}


def test_real_workspace_has_no_violations():
    assert check_boundaries.main([str(workspace.ROOT)]) == 0
