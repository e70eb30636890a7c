"""Entry point of the engine process: ``python -m mcore_inference.serve.engine_child CMD OUT PID``
(started by :class:`~mcore_inference.serve.engine_process.EngineProcess`, never by hand).

``CMD`` and ``OUT`` are the inherited file descriptors of the command and message pipes and
``PID`` the server's process id. A module of its own so that running it does not import the
module that defines the messages a second time under ``__main__``.
"""

import sys
from multiprocessing.connection import Connection

from mcore_inference.serve.engine_worker import child_main

if __name__ == "__main__":
    child_main(
        Connection(int(sys.argv[1]), writable=False),
        Connection(int(sys.argv[2]), readable=False),
        int(sys.argv[3]),
    )
