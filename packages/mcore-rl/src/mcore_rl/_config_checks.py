"""Field checks shared by the sections of :class:`~mcore_rl.config.GRPOConfig`."""

from __future__ import annotations

from typing import Literal, get_args, get_origin, get_type_hints

from mcore_rl.errors import RLConfigError


def check_minimums(owner: object, minimums: dict[str, int]) -> None:
    """Checks that each named field that is set is at least its minimum.

    Args:
        owner: The config section.
        minimums: Lowest allowed value by field name (None values pass).

    Raises:
        RLConfigError: Naming the first field below its minimum.
    """
    for name, low in minimums.items():
        value = getattr(owner, name)
        if value is not None and value < low:
            raise RLConfigError(f"{name}={value} must be >= {low}")


def check_choices(owner: object) -> None:
    """Checks every ``Literal`` field of a section against its choices.

    tyro checks them on the command line; the Python API needs the same check.

    Args:
        owner: The config section.

    Raises:
        RLConfigError: Naming the first field whose value is not one of its choices.
    """
    for name, hint in get_type_hints(type(owner)).items():
        if get_origin(hint) is Literal and getattr(owner, name) not in get_args(hint):
            raise RLConfigError(
                f"{name}={getattr(owner, name)!r} is unknown, expected one of {get_args(hint)}"
            )
