"""``python -m mcore_rl grpo ...``: the same as the ``mcore-rl`` command."""

import sys

from mcore_rl.cli import main

sys.exit(main())
