"""Every package's first contract: version, public names and the error hierarchy."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workspace

# The root of each package's error hierarchy; every other name in its ``errors.__all__``
# derives from it and from a builtin exception.
BASE_ERRORS = {
    "parallel": "ParallelError",
    "kernels": "KernelError",
    "models": "ModelError",
    "ckpt": "CheckpointError",
    "inference": "InferenceError",
    "rl": "RLError",
}

ERROR_CASES = [
    (name, error)
    for name in workspace.PACKAGES
    for error in importlib.import_module(f"mcore_{name}.errors").__all__
    if error != BASE_ERRORS[name]
]


def test_every_package_names_its_base_error():
    assert sorted(BASE_ERRORS) == sorted(workspace.PACKAGES)


@pytest.mark.parametrize("name", workspace.PACKAGES)
def test_version_matches_pyproject(name):
    package = importlib.import_module(f"mcore_{name}")
    pyproject = workspace.load_pyproject(workspace.ROOT / "packages" / f"mcore-{name}")
    assert package.__version__ == pyproject["project"]["version"]


@pytest.mark.parametrize("name", workspace.PACKAGES)
def test_all_names_resolve(name):
    package = importlib.import_module(f"mcore_{name}")
    for public in package.__all__:
        assert hasattr(package, public), public


@pytest.mark.parametrize(("name", "error"), ERROR_CASES)
def test_errors_derive_from_package_base_and_builtin(name, error):
    errors = importlib.import_module(f"mcore_{name}.errors")
    cls = getattr(errors, error)
    assert issubclass(cls, getattr(errors, BASE_ERRORS[name]))
    builtin = [b for b in cls.__mro__[1:] if b.__module__ == "builtins" and b is not Exception]
    assert builtin, f"{error} must also derive from a builtin exception"
    with pytest.raises(builtin[0]):
        raise cls("message")
