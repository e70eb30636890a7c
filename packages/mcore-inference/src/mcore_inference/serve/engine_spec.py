"""What the server tells an engine process to build, and what it reports back once built.

:class:`EngineSpec` goes to every engine process (:mod:`mcore_inference.serve.engine_worker`)
first; :class:`EngineInfo` comes back when its engine is ready.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_inference.config import InferenceConfig

__all__ = ["EngineInfo", "EngineProcessError", "EngineSpec"]


class EngineProcessError(RuntimeError):
    """The engine process could not start (the checkpoint did not load, or it died)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineSpec:
    """What the child process loads and how it builds its engine."""

    model: str
    """Hugging Face checkpoint directory."""
    device: str
    """Device of the model and the KV cache (``cuda``, ``cuda:1``, ``cpu``)."""
    dtype: str | None
    """Parameter dtype; None keeps the checkpoint's."""
    engine: InferenceConfig
    """The engine's configuration."""
    admission_window_ms: float = 0.0
    """Milliseconds that requests arriving while others run are held, to join the batch
    together (0 admits each at once)."""
    tp: int = 1
    """Tensor-parallel size: the number of engine processes (rank ``r`` on ``cuda:r`` when
    ``device`` is ``cuda``)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineInfo:
    """Sizes of a built engine and its model (for the startup line and request checks)."""

    parameters: int
    """Parameter count of the model."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Hidden size."""
    num_attention_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads."""
    vocab_size: int
    """Vocabulary size."""
    dtype: str
    """Parameter dtype (``bfloat16``)."""
    device: str
    """Device of the parameters."""
    kv_blocks: int
    """KV-cache blocks that can be handed out."""
    max_batch_size: int
    """The engine's ``max_batch_size``."""
    pid: int
    """Process that runs the engine (rank 0's)."""
    tp: int = 1
    """Tensor-parallel size (engine processes)."""
    pids: tuple[int, ...] = ()
    """Process of each rank (filled in by :meth:`EngineProcess.launch`)."""
    devices: tuple[str, ...] = ()
    """Device of each rank (filled in by :meth:`EngineProcess.launch`)."""

    @classmethod
    def of(cls, engine: Any, pid: int) -> EngineInfo:
        """Describe an engine.

        Args:
            engine: An :class:`~mcore_inference.InferenceEngine`.
            pid: The process that runs it.

        Returns:
            Its sizes; ``parameters`` counts the whole model's also when this rank holds only
            its tensor-parallel slices.
        """
        from mcore_parallel.sharding import get_partition_dims

        model = engine.model
        config = model.config
        parameter = next(model.parameters())
        tp = engine.groups.tp_size

        def whole(tensor: Any) -> int:
            split = get_partition_dims(tensor).keys() & {"tp", "etp"}
            return tensor.numel() * (tp if split else 1)

        return cls(
            parameters=sum(whole(p) for p in model.parameters()),
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_kv_heads=config.num_kv_heads,
            vocab_size=config.vocab_size,
            dtype=str(parameter.dtype).removeprefix("torch."),
            device=str(parameter.device),
            kv_blocks=engine.allocator.capacity,
            max_batch_size=engine.config.max_batch_size,
            pid=pid,
            tp=tp,
            pids=(pid,),
            devices=(str(parameter.device),),
        )
