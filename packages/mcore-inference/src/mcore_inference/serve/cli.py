"""``mcore-inference serve``: command-line options generated from :class:`ServeConfig`.

Each field becomes ``--field-name`` (booleans also get ``--no-field-name``), with the field's
docstring as help and its default; nothing is declared twice.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
from typing import Any

from mcore_inference.serve.config import ServeConfig

__all__ = ["add_serve_arguments", "config_from_arguments", "run_serve"]

_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str}


def _field_docs(cls: type) -> dict[str, str]:
    """The string literal under each annotated field of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one option per :class:`ServeConfig` field.

    Args:
        parser: The ``serve`` sub-command's parser.
    """
    docs = _field_docs(ServeConfig)
    for field in dataclasses.fields(ServeConfig):
        flag = "--" + field.name.replace("_", "-")
        annotation = str(field.type)
        help_text = docs.get(field.name, "")
        required = field.default is dataclasses.MISSING
        if annotation == "bool":
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text
            )
            continue
        base = annotation.split("|")[0].strip()
        parser.add_argument(
            flag,
            type=_TYPES[base],
            required=required,
            default=None if required else field.default,
            help=help_text + ("" if required else " (default: %(default)s)"),
        )


def config_from_arguments(args: argparse.Namespace) -> ServeConfig:
    """Build the config from parsed options.

    Args:
        args: Options parsed by a parser set up with :func:`add_serve_arguments`.

    Returns:
        The validated config.

    Raises:
        InferenceConfigError: If an option holds an invalid value.
    """
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)}
    return ServeConfig(**values)


def run_serve(args: argparse.Namespace) -> int:
    """Run ``mcore-inference serve`` with parsed options.

    Args:
        args: Options parsed by a parser set up with :func:`add_serve_arguments`.

    Returns:
        The exit status.
    """
    from mcore_inference.serve.server import serve

    return serve(config_from_arguments(args))
