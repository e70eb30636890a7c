"""The package's first contract: version, public names and the error hierarchy."""

import sys
from pathlib import Path

import pytest

import mcore_inference
from mcore_inference import errors

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def test_version_matches_pyproject():
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["version"]
    assert mcore_inference.__version__ == declared


def test_all_names_resolve():
    for name in mcore_inference.__all__:
        assert hasattr(mcore_inference, name), name


@pytest.mark.parametrize("name", errors.__all__[1:])
def test_errors_derive_from_package_base_and_builtin(name):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.InferenceError)
    builtin = [b for b in cls.__mro__[1:] if b.__module__ == "builtins" and b is not Exception]
    assert builtin, f"{name} must also derive from a builtin exception"
    with pytest.raises(builtin[0]):
        raise cls("message")
