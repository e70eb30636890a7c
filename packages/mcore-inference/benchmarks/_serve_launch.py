"""Starts ``mcore-inference serve`` for ``bench_serve.py`` from a JSON object of ServeConfig
fields (argv[1]), without the command line's tyro."""

import json
import sys

from mcore_inference.serve.config import ServeConfig
from mcore_inference.serve.server import serve

if __name__ == "__main__":
    sys.exit(serve(ServeConfig(**json.loads(sys.argv[1]))))
