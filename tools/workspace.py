"""Read the workspace's package table and dependency edges from the pyproject files."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

# Topological order: a package comes after everything it depends on.
PACKAGES = ["parallel", "kernels", "models", "ckpt", "inference", "rl"]

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirement_name(requirement: str) -> str:
    """Return the normalised distribution name of a PEP 508 requirement string.

    Args:
        requirement: A requirement such as ``"triton>=3.2; sys_platform == 'linux'"``.

    Returns:
        The lower-case name with ``_`` and ``.`` replaced by ``-`` (``"triton"``).

    Raises:
        ValueError: If the string does not start with a distribution name.
    """
    match = _NAME.match(requirement)
    if not match:
        raise ValueError(f"requirement={requirement!r} does not start with a distribution name")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def load_pyproject(package_dir: Path) -> dict:
    """Parse ``package_dir/pyproject.toml``."""
    return tomllib.loads((package_dir / "pyproject.toml").read_text())


def declared(package_dir: Path) -> dict[str, set[str]]:
    """Return the distributions a package declares, by kind.

    Args:
        package_dir: The package's directory (holding its pyproject.toml).

    Returns:
        ``{"dependencies": ..., "extras": ..., "test": ...}``, each a set of normalised names.
    """
    data = load_pyproject(package_dir)
    project = data["project"]
    extras = {
        requirement_name(r)
        for reqs in project.get("optional-dependencies", {}).values()
        for r in reqs
    }
    test = {
        requirement_name(r)
        for r in data.get("dependency-groups", {}).get("test", [])
        if isinstance(r, str)
    }
    return {
        "dependencies": {requirement_name(r) for r in project.get("dependencies", [])},
        "extras": extras,
        "test": test,
    }


def dependency_closure(name: str, root: Path = ROOT) -> set[str]:
    """Return ``name`` and every mcore package it reaches through declared dependencies.

    Args:
        name: A package short name such as ``"models"``.
        root: The repository root.

    Returns:
        Short names, ``name`` included.
    """
    seen: set[str] = set()
    stack = [name]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        deps = declared(root / "packages" / f"mcore-{current}")["dependencies"]
        stack.extend(d.removeprefix("mcore-") for d in deps if d.startswith("mcore-"))
    return seen
