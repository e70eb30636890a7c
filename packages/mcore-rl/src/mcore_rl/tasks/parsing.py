"""Safe parsing of the integers, lists and expressions that completions hold."""

from __future__ import annotations

import ast
import re

__all__ = ["parse_int", "parse_int_list", "evaluate_expression"]

_INT = re.compile(r"-?\d{1,12}")
_LIST = re.compile(r"-?\d{1,12}(,-?\d{1,12})*")
_MAX_EXPRESSION_CHARS = 64


def parse_int(text: str) -> int | None:
    """Parses a whole string as a decimal integer.

    Args:
        text: The text.

    Returns:
        The integer, or None if ``text`` is not exactly one integer.
    """
    text = text.strip()
    return int(text) if _INT.fullmatch(text) else None


def parse_int_list(text: str) -> list[int] | None:
    """Parses a comma-separated list of integers.

    Args:
        text: The text, e.g. ``"3,1,2"``.

    Returns:
        The integers, or None if ``text`` is not such a list.
    """
    text = text.replace(" ", "")
    return [int(t) for t in text.split(",")] if _LIST.fullmatch(text) else None


def evaluate_expression(text: str) -> tuple[int, list[int]] | None:
    """Evaluates an integer expression of ``+ - *`` and parentheses without ``eval``.

    Args:
        text: The expression.

    Returns:
        ``(value, literals)`` with the integer literals in order of appearance, or None if the
        text is not such an expression.
    """
    if not text or len(text) > _MAX_EXPRESSION_CHARS or not set(text) <= set("0123456789+-*() "):
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    literals: list[int] = []

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            return left * right
        raise ValueError("unsupported syntax")

    try:
        value = walk(tree.body)
    except ValueError:
        return None
    return value, literals
