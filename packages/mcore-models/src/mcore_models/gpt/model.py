"""GPTModel: a Llama/Qwen-style decoder in plain torch (parallelism lives in parallelize.py)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mcore_kernels import RMSNorm
from mcore_models.errors import ModelInputError, PackedSeqError
from mcore_models.gpt.attention_backends import build_attention_mask
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.kv_cache import KVCache
from mcore_models.gpt.layer import DecoderLayer, add_rms_norm
from mcore_models.gpt.rope import RotaryEmbedding
from mcore_models.packed_seq import PackedSeqParams

if TYPE_CHECKING:
    from mcore_parallel.state import ParallelState

__all__ = ["GPTModel"]


class GPTModel(nn.Module):
    """Decoder-only transformer of the Llama / Qwen2 / Qwen3 family.

    Token embedding, ``num_layers`` pre-norm decoder layers (RMSNorm, RoPE, grouped-query
    attention, SwiGLU MLP), a final RMSNorm and the output layer (optionally tied to the
    embedding).

    With a ``state`` whose tensor-parallel size is above 1, the model is built whole from
    ``config.seed`` and then sharded in place by
    :func:`mcore_models.gpt.parallelize.parallelize`, so every TP size starts from the same
    weights.

    Args:
        config: Model config.
        state: Parallel state (``mcore_parallel.ParallelState``) or None for a single rank.
        device: Device to build the parameters on (default: the current default device).

    Raises:
        ModelConfigError: If the config cannot be sharded over the tensor-parallel group.
    """

    def __init__(
        self,
        config: GPTConfig,
        state: ParallelState | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.state = state
        self.tp_group: Any = None
        """Tensor-parallel process group once parallelized (vocabulary-sharded), else None."""
        target = torch.device(device) if device is not None else torch.empty(0).device
        # NOTE: build on the meta device and materialise once, so that large models do not
        # pay for torch's default initialisation before ours (or before loading weights).
        with torch.device("meta"):
            self.embedding = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
            self.final_norm = RMSNorm(config.hidden_size, config.norm_eps, dtype=config.dtype)
            self.output_layer: nn.Linear | None = None
            if not config.tie_word_embeddings:
                self.output_layer = nn.Linear(
                    config.hidden_size, config.vocab_size, bias=False, dtype=config.dtype
                )
        self.to_empty(device=target)
        self.rotary = RotaryEmbedding(
            config.kv_channels, config.rope_theta, config.rope_scaling, device=target
        )
        self._initialize_weights(target)
        if state is not None and (state.tp_size > 1 or state.ep_size > 1):
            from mcore_models.gpt.parallelize import parallelize

            parallelize(self, state)

    @torch.no_grad()
    def _initialize_weights(self, device: torch.device) -> None:
        generator = torch.Generator(device=device).manual_seed(self.config.seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif self.config.perform_initialization:
                param.normal_(0.0, self.config.init_std, generator=generator)
        for module in self.modules():
            # Buffers materialised by to_empty() hold garbage; modules that own some reset them.
            reset_buffers = getattr(module, "reset_buffers", None)
            if callable(reset_buffers):
                reset_buffers()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        packed_seq_params: PackedSeqParams | None = None,
        kv_cache: KVCache | None = None,
        return_hidden: bool = False,
        gather_logits: bool = True,
    ) -> torch.Tensor:
        """Run the model.

        Args:
            input_ids: ``[B, T]`` token ids.
            position_ids: ``[B, T]`` positions; default ``0 .. T-1`` per row, or restarting at
                0 in each packed sequence. Required with ``kv_cache``.
            packed_seq_params: Boundaries of several sequences packed into the single row of
                ``input_ids`` (B must be 1); attention never crosses them.
            kv_cache: Caller-owned :class:`mcore_models.KVCache` that stores this step's keys
                and values and attends; B must be 1 (the new tokens of all requests in one
                row). The model keeps no state between calls.
            return_hidden: Return the final-normed hidden states ``[B, T, hidden]`` instead of
                logits (for a fused log-prob head; see :meth:`compute_logits`).
            gather_logits: Under tensor parallelism, gather the logits to the full vocabulary
                (default); False returns this rank's vocabulary shard ``[B, T, V / tp]``.

        Returns:
            float32 logits ``[B, T, vocab_size]`` (or the vocabulary shard), or hidden states.

        Raises:
            ModelInputError: If ``input_ids`` or ``position_ids`` are malformed or the
                arguments do not go together.
            PackedSeqError: If the packed sequences do not cover the row exactly.
            AttentionBackendError: If the attention backend cannot serve the request.
        """
        position_ids = self._check_inputs(input_ids, position_ids, packed_seq_params, kv_cache)
        mask = None
        if kv_cache is None:
            mask = build_attention_mask(
                self.config.attention_backend,
                input_ids.shape[1],
                input_ids.device,
                packed_seq_params,
            )
        hidden = self.embedding(input_ids)
        cos, sin = self.rotary(position_ids)
        fused_group = self._fused_reduction_group()
        residual: torch.Tensor | None = None
        recompute = self.config.activation_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                hidden, residual = checkpoint(
                    layer, hidden, residual, cos, sin, mask, kv_cache, use_reentrant=False
                )
            else:
                hidden, residual = layer(
                    hidden, residual, cos, sin, mask, kv_cache, fused_group=fused_group
                )
        hidden, _ = add_rms_norm(self.final_norm, hidden, residual, partial_group=fused_group)
        if self.config.sequence_parallel and self.tp_group is not None:
            from mcore_models.gpt.parallelize import gather_sequence

            hidden = gather_sequence(hidden, self.tp_group)
        if return_hidden:
            return hidden
        return self.compute_logits(hidden, gather=gather_logits)

    def _fused_reduction_group(self) -> Any:
        """The TP group when the fused reduce-scatter/add/norm/all-gather path applies."""
        if (
            self.tp_group is None
            or not self.config.inference_fuse_tp_communication
            or self.config.sequence_parallel
            or torch.is_grad_enabled()
            or not all(
                isinstance(layer, DecoderLayer) and layer.supports_fused_reduction()
                for layer in self.layers
            )
        ):
            return None
        return self.tp_group

    def output_weight(self) -> torch.Tensor:
        """The weight of the output layer (the embedding weight when tied).

        Returns:
            ``[vocab_size, hidden]`` weight (this rank's vocabulary shard under TP).
        """
        if self.output_layer is None:
            return self.embedding.weight
        return self.output_layer.weight

    def compute_logits(
        self, hidden: torch.Tensor, *, gather: bool = True, upcast: bool = True
    ) -> torch.Tensor:
        """Project final-normed hidden states to logits.

        Args:
            hidden: ``[..., hidden]`` output of ``forward(..., return_hidden=True)`` (the full
                sequence, also under sequence parallelism).
            gather: Under tensor parallelism, all-gather the vocabulary shards (default).
            upcast: Return float32 (default); False keeps the parameter dtype, for a log-prob
                head such as ``mcore_kernels.token_logprobs`` that reads bf16 logits directly.

        Returns:
            ``[..., vocab_size]`` logits, or ``[..., vocab_size / tp]`` when ``gather`` is
            False under tensor parallelism.
        """
        if self.tp_group is None:
            logits = F.linear(hidden, self.output_weight())
        else:
            from mcore_models.gpt.parallelize import gather_vocab_shards, vocab_parallel_logits

            logits = vocab_parallel_logits(hidden, self.output_weight(), self.tp_group)
            if gather:
                logits = gather_vocab_shards(logits, self.tp_group)
        return logits.float() if upcast else logits

    def _check_inputs(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        packed: PackedSeqParams | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ModelInputError(f"input_ids={_describe(input_ids)} must be a [B, T] tensor")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ModelInputError(f"input_ids.dtype={input_ids.dtype} must be an integer dtype")
        batch, seq_len = input_ids.shape
        if seq_len == 0:
            raise ModelInputError("input_ids has no tokens (T == 0)")
        if packed is not None:
            if kv_cache is not None:
                raise ModelInputError(
                    "packed_seq_params and kv_cache were both given; with a KV cache the cache "
                    "decides which tokens each request sees"
                )
            if batch != 1:
                raise PackedSeqError(
                    f"input_ids.shape={tuple(input_ids.shape)}: packed input needs B == 1"
                )
            if packed.total_tokens != seq_len:
                raise PackedSeqError(
                    f"cu_seqlens[-1]={packed.total_tokens} must equal the number of tokens T={seq_len}"
                )
        if kv_cache is not None:
            if batch != 1:
                raise ModelInputError(
                    f"input_ids.shape={tuple(input_ids.shape)}: with kv_cache B must be 1 "
                    "(flatten the new tokens of all requests into one row)"
                )
            if position_ids is None:
                raise ModelInputError("position_ids=None: kv_cache needs explicit positions")
        if self.config.sequence_parallel and self.tp_group is not None:
            tp = self.state.tp_size if self.state is not None else 1
            if seq_len % tp:
                raise ModelInputError(
                    f"input_ids.shape={tuple(input_ids.shape)}: with sequence_parallel=True the "
                    f"sequence length must be divisible by the tensor-parallel size {tp}"
                )
        if position_ids is None:
            if packed is not None:
                return packed.position_ids(input_ids.device)
            return torch.arange(seq_len, device=input_ids.device).expand(batch, seq_len)
        if (
            not isinstance(position_ids, torch.Tensor)
            or tuple(position_ids.shape) != (batch, seq_len)
            or position_ids.dtype.is_floating_point
        ):
            raise ModelInputError(
                f"position_ids={_describe(position_ids)} must be an integer tensor shaped like "
                "input_ids "
                f"{tuple(input_ids.shape)}"
            )
        return position_ids

    @classmethod
    def from_hf(
        cls,
        path: str | os.PathLike[str],
        *,
        state: ParallelState | None = None,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        **config_overrides: Any,
    ) -> GPTModel:
        """Load a Hugging Face Llama, Qwen2 or Qwen3 checkpoint directory.

        Args:
            path: Directory with ``config.json`` and ``model.safetensors`` (or sharded
                safetensors with ``model.safetensors.index.json``).
            state: Parallel state; under tensor parallelism each rank keeps its shards.
            dtype: Parameter dtype (default: the checkpoint's ``torch_dtype``/``dtype``).
            device: Device of the parameters.
            **config_overrides: GPTConfig fields to set (e.g. ``attention_backend``).

        Returns:
            The loaded model.

        Raises:
            CheckpointFormatError: If the architecture is unsupported, a tensor is missing or
                unexpected, or a shape does not match (the message names the tensor).
        """
        from mcore_models.gpt.hf import load_hf

        return load_hf(cls, path, state=state, dtype=dtype, device=device, **config_overrides)

    def to_hf(self, directory: str | os.PathLike[str]) -> None:
        """Write ``config.json`` and ``model.safetensors`` that transformers loads.

        Under tensor parallelism the shards are gathered and rank 0 of the tensor-parallel
        group writes the files (every rank must call this). A sharded safetensors checkpoint
        already in ``directory`` (its index and ``model-*-of-*.safetensors`` shards) is
        replaced, so that loaders read the new weights.

        Args:
            directory: Output directory (created if missing).
        """
        from mcore_models.gpt.hf import save_hf

        save_hf(self, directory)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    return repr(value)
