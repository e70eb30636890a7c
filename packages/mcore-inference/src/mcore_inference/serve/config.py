"""Options of ``mcore-inference serve`` (:class:`ServeConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_inference.errors import InferenceConfigError

__all__ = ["ServeConfig"]

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InferenceConfigError(f"{name}={value!r}; expected an integer >= {minimum}")


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """What ``mcore-inference serve`` loads and how it listens, batches and sheds load.

    Raises:
        InferenceConfigError: If a field holds an invalid value.
    """

    model: str
    """Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json)."""
    served_model_name: str | None = None
    """Model name clients send and ``/v1/models`` lists; None uses the directory's name."""
    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0`` for every interface)."""
    port: int = 8000
    """TCP port to listen on; 0 picks a free one (the startup line prints it)."""
    device: str | None = None
    """Device of the model and KV cache; None picks ``cuda`` when available, else ``cpu``."""
    tp: int = 1
    """Tensor-parallel size: the engine runs as this many processes, rank ``r`` on GPU ``r``
    of the visible ones (NCCL; gloo processes on the CPU), rank 0 answering the server. Must
    divide the model's attention heads, KV heads, FFN size and vocabulary; on CUDA at most the
    number of visible GPUs."""
    dtype: str | None = None
    """Parameter dtype (e.g. ``bfloat16``); None keeps the checkpoint's."""
    max_batch_size: int = 64
    """Most requests decoding at the same time (the engine's ``max_batch_size``)."""
    max_sequence_length: int = 2048
    """Most tokens of one request, prompt plus generated tokens."""
    num_blocks: int | None = None
    """KV-cache blocks; None sizes the cache for ``max_batch_size`` full-length requests."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    max_tokens_per_step: int | None = None
    """Token budget of one engine step; None keeps the engine's default."""
    use_cuda_graphs: bool = True
    """Replay CUDA graphs for decode steps on a GPU."""
    cuda_graph_mixed_steps: bool = True
    """Replay the decode graphs also for steps that prefill the requests arriving while others
    decode (``InferenceConfig.cuda_graph_mixed_steps``); False runs those steps eagerly."""
    engine_process: bool = True
    """Run the engine in a child process of its own (the HTTP work then never holds up an
    engine step on the GIL); False runs it on a thread of the server process."""
    admission_window_ms: float = 0.0
    """Hold requests that arrive while others run for up to this many milliseconds, so that
    a burst joins the batch in one prefill step instead of one per engine step (fewer mixed
    prefill-and-decode steps, which run without CUDA graphs); 0 admits each request at once.
    Engine process only."""
    max_waiting_requests: int = 256
    """Requests allowed to wait for a batch slot; beyond it new requests get 503."""
    timeout_graceful_shutdown: int = 30
    """Seconds a SIGTERM waits for in-flight requests before aborting them."""
    seed: int = 0
    """Seed from which requests without a ``seed`` draw theirs."""
    log_level: str = "warning"
    """Log level of the HTTP server (``critical`` ... ``trace``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InferenceConfigError(
                f"model={self.model!r}; expected a checkpoint directory path"
            )
        if self.served_model_name is not None and (
            not isinstance(self.served_model_name, str) or not self.served_model_name
        ):
            raise InferenceConfigError(
                f"served_model_name={self.served_model_name!r}; expected None or a non-empty string"
            )
        _check_int("port", self.port, 0)
        if self.port > 65535:
            raise InferenceConfigError(f"port={self.port}; expected at most 65535")
        for name in ("max_batch_size", "max_sequence_length", "block_size"):
            _check_int(name, getattr(self, name), 1)
        for name in ("num_blocks", "max_tokens_per_step"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if not isinstance(self.cuda_graph_mixed_steps, bool):
            raise InferenceConfigError(
                f"cuda_graph_mixed_steps={self.cuda_graph_mixed_steps!r}; expected True or False"
            )
        if not isinstance(self.engine_process, bool):
            raise InferenceConfigError(
                f"engine_process={self.engine_process!r}; expected True or False"
            )
        _check_int("tp", self.tp, 1)
        if self.tp > 1 and not self.engine_process:
            raise InferenceConfigError(
                f"tp={self.tp} needs engine_process=True (the ranks are engine processes)"
            )
        if self.tp > 1 and self.device not in (None, "cuda", "cpu"):
            raise InferenceConfigError(
                f"device={self.device!r} with tp={self.tp}; expected 'cuda' (rank r runs on GPU "
                "r of the visible ones: choose them with CUDA_VISIBLE_DEVICES), 'cpu' or None"
            )
        window = self.admission_window_ms
        if (
            isinstance(window, bool)
            or not isinstance(window, (int, float))
            or not (0 <= window <= 1000)
        ):
            raise InferenceConfigError(
                f"admission_window_ms={window!r}; expected a number of milliseconds in [0, 1000]"
            )
        if window and not self.engine_process:
            raise InferenceConfigError(
                f"admission_window_ms={window} needs engine_process=True (the engine thread "
                "admits every request at once)"
            )
        _check_int("max_waiting_requests", self.max_waiting_requests, 0)
        _check_int("seed", self.seed, 0)
        _check_int("timeout_graceful_shutdown", self.timeout_graceful_shutdown, 0)
        if self.log_level not in _LOG_LEVELS:
            raise InferenceConfigError(
                f"log_level={self.log_level!r}; expected one of {', '.join(_LOG_LEVELS)}"
            )
