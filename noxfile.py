"""Session matrix of the mcore monorepo: `uv run nox -l` lists it, `uv run nox -t tests` tests."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2024.10.9"
nox.options.default_venv_backend = "uv"
nox.options.error_on_external_run = True
nox.options.sessions = []

ROOT = Path(__file__).resolve().parent

# Every session writes bytecode caches, whatever the calling shell says: the tests start hundreds
# of Python processes (ranks, Ray actors, reward pools, servers, CLI runs), and without `.pyc`
# files each of them compiles torch's and transformers' sources again (`import torch,
# transformers` takes 5.3 s instead of 2.7 s on the 2-core CI machine).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.path.insert(0, str(ROOT / "tools"))

from workspace import PACKAGES, dependency_closure  # noqa: E402

_LIST_DISTRIBUTIONS = (
    "import importlib.metadata as m, json, re; "
    "print(json.dumps({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower(): d.version "
    "for d in m.distributions()}))"
)

# Per-package test environments: the kernels run under the Triton interpreter on CPU.
TEST_ENV = {"kernels": {"TRITON_INTERPRET": "1"}}


def _sync(session: nox.Session, *args: str) -> None:
    """Install from the lock into this session's venv (and nothing more)."""
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    session.run_install("uv", "sync", "--locked", *args, env=env, external=True)


def _test_session(name: str) -> None:
    @nox.session(name=f"tests-{name}", tags=["tests"])
    def tests(session: nox.Session) -> None:
        _sync(session, "--package", f"mcore-{name}", "--group", "test")
        # pytest exits 5 when it collects nothing: that is a failure here, as any non-zero code.
        session.run(
            "pytest",
            f"packages/mcore-{name}/tests",
            "-p",
            "no:cacheprovider",
            *session.posargs,
            env=TEST_ENV.get(name, {}),
        )

    tests.__doc__ = f"Test mcore-{name} in a venv holding only it and its declared dependencies."


for _name in PACKAGES:
    _test_session(_name)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + format check, the dependency-boundary check, and the tools' tests.

    The tools' tests include every package's contract (version, public names, error
    hierarchy), so the session installs the six packages.
    """
    _sync(session, "--all-packages", "--group", "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "tools/check_boundaries.py")
    session.run("pytest", "tools/tests", "-q", "-p", "no:cacheprovider")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the sources of all packages."""
    _sync(session, "--all-packages", "--group", "dev")
    session.run("mypy", *(f"packages/mcore-{name}/src" for name in PACKAGES))


@nox.session
def docs(session: nox.Session) -> None:
    """Sphinx docs with warnings as errors (SKIP_AUTODOC=true: prose only)."""
    _sync(session, "--only-group", "docs")
    out = ROOT / "docs" / "_build" / "html"
    shutil.rmtree(ROOT / "docs" / "api-guide" / "reference", ignore_errors=True)
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", str(out))


@nox.session
def build(session: nox.Session) -> None:
    """Build every wheel, then install each alone and check it pulls only its declared edges."""
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for name in PACKAGES:
        session.run(
            "uv",
            "build",
            "--package",
            f"mcore-{name}",
            "--no-sources",
            "-o",
            str(dist),
            external=True,
        )
    wheels = {name: next(dist.glob(f"mcore_{name}-*.whl")) for name in PACKAGES}
    for name, wheel in wheels.items():
        venv = Path(session.create_tmp()) / f"wheel-{name}"
        shutil.rmtree(venv, ignore_errors=True)
        session.run("uv", "venv", "--quiet", str(venv), external=True)
        python = str(venv / "bin" / "python")
        # Siblings resolve from dist/ (no mcore-* exists on the index): --find-links dist.
        session.run(
            "uv",
            "pip",
            "install",
            "--quiet",
            "--python",
            python,
            "--find-links",
            str(dist),
            # Same name and version as an earlier build: never reuse uv's cached copy of a sibling.
            *(f"--refresh-package=mcore-{n}" for n in PACKAGES),
            str(wheel),
            external=True,
            env={"UV_LINK_MODE": "symlink"},
        )
        # The installed distributions, read by the venv's own interpreter (last output line).
        report = session.run(python, "-c", _LIST_DISTRIBUTIONS, external=True, silent=True)
        versions = json.loads(report.strip().splitlines()[-1])
        installed = {dist_name for dist_name in versions if dist_name.startswith("mcore-")}
        allowed = {f"mcore-{n}" for n in dependency_closure(name)}
        if installed - allowed:
            session.error(
                f"mcore-{name} wheel pulled undeclared packages: {sorted(installed - allowed)}"
            )
        if installed != allowed:
            session.error(
                f"mcore-{name} wheel is missing declared packages: {sorted(allowed - installed)}"
            )
        for dep in installed:
            expected = wheels[dep.removeprefix("mcore-")].name.split("-")[1]
            if versions[dep] != expected:
                session.error(f"{dep} {versions[dep]} was installed, not the {expected} from dist/")
        session.run(
            python,
            "-c",
            f"import mcore_{name}; print(mcore_{name}.__name__, mcore_{name}.__version__)",
            external=True,
        )
        shutil.rmtree(venv, ignore_errors=True)
    session.log(f"built and checked {len(wheels)} wheels in {dist}")
