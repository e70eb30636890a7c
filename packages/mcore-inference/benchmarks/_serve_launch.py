"""Starts ``mcore-inference serve`` for ``bench_serve.py`` from a JSON object of ServeConfig
fields (argv[1]), without the command line's tyro.

With ``--plain-http`` (argv[2]) uvloop and httptools are hidden, so that uvicorn runs on
asyncio's own event loop and the pure-Python h11 parser even where the faster ones are
installed (to measure what they bring).
"""

import json
import sys

if __name__ == "__main__":
    if sys.argv[2:] == ["--plain-http"]:
        sys.modules["uvloop"] = None  # type: ignore[assignment]
        sys.modules["httptools"] = None  # type: ignore[assignment]
    from mcore_inference.serve.config import ServeConfig
    from mcore_inference.serve.server import serve

    sys.exit(serve(ServeConfig(**json.loads(sys.argv[1]))))
