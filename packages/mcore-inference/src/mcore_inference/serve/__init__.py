"""``mcore-inference serve``: an OpenAI-compatible HTTP server over the inference engine.

The HTTP layer (starlette, uvicorn) comes with the ``serve`` extra and is imported only when an
application is built or run; the protocol, the engine loop and the metrics are plain Python.

Modules, one concern each: :mod:`~mcore_inference.serve.config` (options),
:mod:`~mcore_inference.serve.protocol` (request validation), :mod:`~mcore_inference.serve.responses`
(response bodies), :mod:`~mcore_inference.serve.text` (detokenization, stop strings),
:mod:`~mcore_inference.serve.engine_loop` (the engine on a thread, and what both placements of the
engine share), :mod:`~mcore_inference.serve.engine_process` (the engine in a child process, the
default: the server's side), :mod:`~mcore_inference.serve.engine_worker` (the child's side),
:mod:`~mcore_inference.serve.engine_spec` (what a child is given and reports),
:mod:`~mcore_inference.serve.engine_ranks` (the ranks of ``--tp N`` and their control channel),
:mod:`~mcore_inference.serve.generation` (one request's choices), :mod:`~mcore_inference.serve.metrics` (Prometheus text),
:mod:`~mcore_inference.serve.app` (routes), :mod:`~mcore_inference.serve.server` (loading and
running).
"""

from mcore_inference.serve.app import ServerState, build_app
from mcore_inference.serve.config import ServeConfig
from mcore_inference.serve.engine_loop import (
    EngineLoop,
    EngineLoopStoppedError,
    LoopFrontend,
    QueueFullError,
)
from mcore_inference.serve.engine_process import (
    EngineInfo,
    EngineProcess,
    EngineProcessError,
    EngineSpec,
)
from mcore_inference.serve.generation import GenerationJob, ModelLimits
from mcore_inference.serve.metrics import ServerMetrics
from mcore_inference.serve.protocol import ProtocolError
from mcore_inference.serve.server import load_server_state, serve

__all__ = [
    "EngineInfo",
    "EngineLoop",
    "EngineLoopStoppedError",
    "EngineProcess",
    "EngineProcessError",
    "EngineSpec",
    "GenerationJob",
    "LoopFrontend",
    "ModelLimits",
    "ProtocolError",
    "QueueFullError",
    "ServeConfig",
    "ServerMetrics",
    "ServerState",
    "build_app",
    "load_server_state",
    "serve",
]
