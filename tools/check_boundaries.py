"""Fail when a package imports a sibling or third-party package it does not declare.

Every module under ``packages/*/src`` and ``packages/*/tests`` is parsed with ``ast`` (nothing is
imported). Allowed imports:

- ``src/``: the standard library, the package itself, its ``dependencies``; its optional extras
  only inside a function body (a lazy import behind the extra);
- ``tests/``: the same plus the package's ``test`` dependency group, extras anywhere.

Usage: ``python tools/check_boundaries.py [ROOT]``; exit status 1 lists every violation.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workspace import ROOT, declared

# Distributions whose import name is not their normalised name with "-" -> "_".
IMPORT_NAMES: dict[str, set[str]] = {
    "pyyaml": {"yaml"},
    "pillow": {"PIL"},
    "scikit-learn": {"sklearn"},
    "transformer-engine": {"transformer_engine"},
    "liger-kernel": {"liger_kernel"},
    "pytest-timeout": {"pytest_timeout"},
    "matplotlib": {"matplotlib", "mpl_toolkits"},
}


def import_names(distribution: str) -> set[str]:
    """Top-level module names a distribution provides."""
    return IMPORT_NAMES.get(distribution, {distribution.replace("-", "_")})


@dataclass(frozen=True)
class Violation:
    """One undeclared import."""

    path: Path
    line: int
    module: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: import of '{self.module}' {self.reason}"


def _imports(tree: ast.AST):
    """Yield (top-level module, line, inside_function) for every absolute import."""

    def visit(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name.split(".")[0], child.lineno, in_function
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                yield child.module.split(".")[0], child.lineno, in_function
            yield from visit(child, nested)

    yield from visit(tree, False)


def check_package(package_dir: Path) -> list[Violation]:
    """Check every module of one package.

    Args:
        package_dir: ``packages/mcore-<x>``.

    Returns:
        The violations found, empty when the package respects its declarations.
    """
    decl = declared(package_dir)
    own = package_dir.name.replace("-", "_")
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    runtime = {m for d in decl["dependencies"] for m in import_names(d)} | {own}
    extras = {m for d in decl["extras"] for m in import_names(d)}
    test = {m for d in decl["test"] for m in import_names(d)}
    violations = []
    for kind in ("src", "tests"):
        for path in sorted((package_dir / kind).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            local = {p.stem for p in path.parent.glob("*.py")} if kind == "tests" else set()
            for module, line, in_function in _imports(tree):
                if module in stdlib or module in runtime or module in local:
                    continue
                if kind == "tests" and (module in test or module in extras):
                    continue
                if kind == "src" and module in extras:
                    if in_function:
                        continue
                    reason = "belongs to an optional extra and must be imported lazily"
                else:
                    reason = f"is not declared by {package_dir.name}"
                violations.append(
                    Violation(path.relative_to(package_dir.parent.parent), line, module, reason)
                )
    return violations


def main(argv: list[str] | None = None) -> int:
    """Check all packages under ``ROOT/packages``; print violations; return the exit status."""
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else ROOT
    packages = sorted(p for p in (root / "packages").iterdir() if (p / "pyproject.toml").exists())
    violations = [v for p in packages for v in check_package(p)]
    for violation in violations:
        print(violation)
    print(f"dependency boundaries: {len(packages)} packages, {len(violations)} violation(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
