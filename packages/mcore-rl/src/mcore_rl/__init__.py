"""mcore-rl: GRPO post-training end to end."""

from mcore_rl._version import __version__
from mcore_rl.errors import PackingError, RLConfigError, RLError

__all__ = [
    "__version__",
    "RLError",
    "RLConfigError",
    "PackingError",
]
