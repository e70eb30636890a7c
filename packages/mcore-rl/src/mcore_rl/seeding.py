"""Seeds derived from the run's seed, so every step, rank and purpose samples independently."""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]


def derive_seed(*parts: int | str) -> int:
    """Derives a 31-bit seed from parts, so every step and rank samples independently.

    Args:
        *parts: Seed, step, rank, purpose ...

    Returns:
        A non-negative seed.
    """
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
