"""Version of mcore-rl: the installed distribution's, else the source tree's pyproject.toml."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["__version__"]

try:
    __version__: str = version("mcore-rl")
except PackageNotFoundError:
    # Running from a source checkout on PYTHONPATH (as on GPU machines), not installed.
    _pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    _match = re.search(r'^version = "([^"]+)"', _pyproject.read_text(), re.MULTILINE)
    __version__ = _match.group(1) if _match else "0.0.0+unknown"
