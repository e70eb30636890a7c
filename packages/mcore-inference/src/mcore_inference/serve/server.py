"""Load a checkpoint, build the engine and run the HTTP server until SIGTERM or SIGINT.

Shutdown is uvicorn's graceful one: the listening socket closes, in-flight requests get up to
``timeout_graceful_shutdown`` seconds to finish and are then cancelled (which aborts them in the
engine), and the application's lifespan stops the engine loop and closes the engine, releasing
the KV cache, CUDA graphs and their memory. The process then exits with status 0.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import torch

from mcore_inference.config import InferenceConfig
from mcore_inference.engine import InferenceEngine
from mcore_inference.errors import InferenceConfigError
from mcore_inference.serve.app import ServerState, build_app
from mcore_inference.serve.config import ServeConfig
from mcore_inference.serve.engine_loop import EngineLoop, LoopFrontend
from mcore_inference.serve.engine_process import EngineInfo, EngineProcess, EngineSpec
from mcore_inference.serve.generation import ModelLimits
from mcore_inference.serve.metrics import ServerMetrics

__all__ = ["check_tensor_parallel", "load_server_state", "model_summary", "serve"]


def _architecture(directory: Path) -> str:
    file = directory / "config.json"
    if not file.is_file():
        return "unknown architecture"
    config = json.loads(file.read_text())
    names = config.get("architectures") or [config.get("model_type", "unknown architecture")]
    return str(names[0])


def model_summary(state: ServerState, info: EngineInfo, directory: Path) -> str:
    """One line describing the served model, the engine's sizes and where the engine runs.

    Args:
        state: The server state.
        info: The engine's sizes (:attr:`EngineProcess.info` or ``EngineInfo.of(engine)``).
        directory: The checkpoint directory.

    Returns:
        The summary (architecture, parameters of the whole model, shape, dtype, devices,
        tensor-parallel size, cache, batch, context, engine processes).
    """
    limits = state.limits
    if info.pid == os.getpid():
        where = "on a thread of the server"
    elif info.tp > 1:
        where = f"in processes {', '.join(map(str, info.pids))} (rank 0 answers the server)"
    else:
        where = f"in process {info.pid}"
    devices = "+".join(info.devices) if info.tp > 1 else info.device
    return (
        f"model {state.model_name!r}: {_architecture(directory)}, "
        f"{info.parameters / 1e6:.2f}M parameters, "
        f"{info.num_layers} layers, hidden {info.hidden_size}, "
        f"{info.num_attention_heads} heads ({info.num_kv_heads} KV), vocab {info.vocab_size}, "
        f"{info.dtype} on {devices}, tp {info.tp}; "
        f"KV cache {limits.kv_blocks} blocks x {limits.block_size} tokens, "
        f"batch {info.max_batch_size}, context {limits.max_sequence_length} tokens; "
        f"engine {where}"
    )


def check_tensor_parallel(directory: Path, tp: int, device: str) -> None:
    """Check ``--tp`` against the checkpoint and the machine before any rank starts.

    Args:
        directory: The checkpoint directory.
        tp: The tensor-parallel size.
        device: The engine's device (``cuda`` or ``cpu``).

    Raises:
        InferenceConfigError: If ``tp`` does not divide the model's attention heads, KV heads,
            FFN size or vocabulary, or exceeds the number of visible GPUs on CUDA.
        CheckpointFormatError: If ``config.json`` describes an unsupported architecture.
    """
    if tp == 1:
        return
    from mcore_models.gpt.hf import config_from_hf

    file = directory / "config.json"
    if file.is_file():
        model = config_from_hf(json.loads(file.read_text()))
        sizes = {
            "attention heads": model.num_attention_heads,
            "KV heads": model.num_kv_heads,
            "FFN size": model.ffn_hidden_size,
            "vocabulary": model.vocab_size,
        }
        for what, value in sizes.items():
            if value % tp:
                listed = ", ".join(f"{name} {size}" for name, size in sizes.items())
                raise InferenceConfigError(
                    f"tp={tp} does not divide the model's {what} ({value}); expected a "
                    f"tensor-parallel size that divides each of: {listed}"
                )
    if device.startswith("cuda"):
        visible = torch.cuda.device_count()
        if tp > visible:
            raise InferenceConfigError(
                f"tp={tp} needs {tp} GPUs (one per rank); {visible} are visible"
            )


def load_server_state(config: ServeConfig) -> ServerState:
    """Load the tokenizer, start the engine (in a child process unless
    ``config.engine_process`` is False) and build the server state.

    Args:
        config: Server options.

    Returns:
        The state the routes need (the engine's loop is not started yet; in a child process
        the engine is built and ready).

    Raises:
        InferenceConfigError: If ``config.model`` is not a directory, or ``config.tp`` does
            not fit the model or the visible GPUs.
        TokenizerUnavailableError: If the tokenizer cannot be loaded.
        CheckpointFormatError: If the weights cannot be loaded (engine on a thread).
        EngineProcessError: If the engine process fails to load the weights or dies.
    """
    from mcore_inference.hf_tokenizer import HFTokenizer

    directory = Path(config.model)
    if not directory.is_dir():
        raise InferenceConfigError(
            f"model={config.model!r}; expected a Hugging Face checkpoint directory"
        )
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_tensor_parallel(directory, config.tp, device)
    tokenizer = HFTokenizer(directory)
    engine_config = InferenceConfig(
        max_batch_size=config.max_batch_size,
        max_sequence_length=config.max_sequence_length,
        block_size=config.block_size,
        num_blocks=config.num_blocks,
        max_tokens_per_step=config.max_tokens_per_step,
        use_cuda_graphs=config.use_cuda_graphs,
        cuda_graph_mixed_steps=config.cuda_graph_mixed_steps,
        seed=config.seed,
    )
    loop: LoopFrontend
    if config.engine_process:
        spec = EngineSpec(
            model=str(directory),
            device=device,
            dtype=config.dtype,
            engine=engine_config,
            admission_window_ms=config.admission_window_ms,
            tp=config.tp,
        )
        process = EngineProcess(spec, max_waiting_requests=config.max_waiting_requests)
        info = process.launch()
        loop = process
    else:
        from mcore_models import GPTModel

        model = GPTModel.from_hf(directory, dtype=config.dtype, device=device).eval()
        engine = InferenceEngine(model, engine_config)
        engine.capture_graphs()
        info = EngineInfo.of(engine, os.getpid())
        loop = EngineLoop(engine, max_waiting_requests=config.max_waiting_requests)
    name = config.served_model_name or directory.resolve().name
    limits = ModelLimits(
        vocab_size=info.vocab_size,
        max_sequence_length=config.max_sequence_length,
        block_size=config.block_size,
        kv_blocks=info.kv_blocks,
    )
    return ServerState(
        loop=loop,
        tokenizer=tokenizer,
        model_name=name,
        limits=limits,
        metrics=ServerMetrics(loop, name),
        shutdown_timeout=max(60.0, config.timeout_graceful_shutdown),
        engine_info=info,
    )


class _Signals:
    """SIGTERM/SIGINT before the server runs exit at once; after it, they were handled.

    uvicorn captures both signals while it serves, shuts down gracefully, restores the previous
    handlers and raises the captured signal again; this handler is that previous handler, so the
    re-raised signal ends nothing more and the process exits with status 0.
    """

    def __init__(self) -> None:
        self.serving = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.serving:
            raise SystemExit(128 + signum)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def _run(server: Any, sock: socket.socket, address: str, out: TextIO) -> None:
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        print(
            f"mcore-inference serve: listening on {address} (OpenAI API at {address}/v1)", file=out
        )
        out.flush()
    await task


def serve(config: ServeConfig, *, out: TextIO | None = None) -> int:
    """Run the server until SIGTERM or SIGINT (needs the ``serve`` extra).

    Prints the model summary once loaded and the address once listening.

    Args:
        config: Server options.
        out: Stream of the startup lines (default: standard output).

    Returns:
        The exit status (0 after a graceful shutdown).
    """
    import uvicorn

    out = out if out is not None else sys.stdout
    signals = _Signals()
    previous = {s: signal.signal(s, signals) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        state = load_server_state(config)
        assert state.engine_info is not None
        # Everything loaded so far (torch, the app, an engine on a thread) lives as long as the
        # server: out of the collector's generations, the full collections that the garbage of
        # every streamed token triggers do not walk it (pauses of milliseconds otherwise).
        gc.collect()
        gc.freeze()
        summary = model_summary(state, state.engine_info, Path(config.model))
        print(f"mcore-inference serve: {summary}", file=out)
        out.flush()
        sock = _listen(config.host, config.port)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        address = f"http://{shown}:{port}"
        server = uvicorn.Server(
            uvicorn.Config(
                build_app(state),
                log_level=config.log_level,
                timeout_graceful_shutdown=config.timeout_graceful_shutdown,
                access_log=False,
                lifespan="on",
            )
        )
        signals.serving = True
        asyncio.run(_run(server, sock, address, out))
        del state
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print("mcore-inference serve: stopped", file=out)
        out.flush()
        return 0 if server.started else 1
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
