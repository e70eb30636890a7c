"""HybridModel: Mamba-2 / attention / MLP / MoE layers from a pattern string, in plain torch."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from mcore_kernels import RMSNorm
from mcore_models.errors import ModelConfigError, ModelInputError
from mcore_models.gpt.attention_backends import build_attention_mask
from mcore_models.gpt.kv_cache import KVCache
from mcore_models.mamba.config import HybridConfig
from mcore_models.mamba.layers import HybridLayer
from mcore_models.mamba.mixer import Mamba2Mixer
from mcore_models.mamba.state import MambaStepState
from mcore_models.packed_seq import PackedSeqParams

if TYPE_CHECKING:
    from mcore_parallel.state import ParallelState

__all__ = ["HybridModel"]


class HybridModel(nn.Module):
    """Hybrid Mamba-2 language model (Mamba-2, Nemotron-H), in plain torch.

    Token embedding, one :class:`HybridLayer` per character of ``config.layer_pattern``, a
    final RMSNorm and the output layer. Like :class:`mcore_models.GPTModel` it holds no process
    group (tensor and pipeline parallelism are applied by :func:`parallelize_hybrid` and
    :func:`mcore_models.build_pipeline_stages`) and keeps no inference state: an engine passes
    the attention KV cache and the Mamba state slots (:class:`MambaStepState`) to each call.

    A pipeline stage holds a range of the layers, the embedding only when ``pre_process`` and
    the final norm and output layer only when ``post_process``.

    Args:
        config: Model config.
        device: Device of the parameters (default: the current default device).
        layers: Global indices of the layers this module holds (default: all).
        pre_process: Whether it holds the embedding.
        post_process: Whether it holds the final norm and output layer.

    Raises:
        ModelConfigError: If ``layers`` is not a range inside ``[0, num_layers)``.
    """

    def __init__(
        self,
        config: HybridConfig,
        *,
        device: torch.device | str | None = None,
        layers: range | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        super().__init__()
        layer_range = range(config.num_layers) if layers is None else layers
        if not isinstance(layer_range, range) or (
            len(layer_range) and (layer_range.start < 0 or layer_range.stop > config.num_layers)
        ):
            raise ModelConfigError(
                f"layers={layers!r} must be a range inside [0, num_layers={config.num_layers})"
            )
        self.config = config
        self.pre_process = pre_process
        """Whether this module holds the embedding (takes token ids)."""
        self.post_process = post_process
        """Whether this module holds the final norm and the output layer."""
        self.tp_group: Any = None
        """Tensor-parallel group set by :func:`parallelize_hybrid` (introspection only)."""
        self.sequence_parallel_size = 1
        """Always 1: hybrid models are not sequence-parallel."""
        target = torch.device(device) if device is not None else torch.empty(0).device
        devices = []
        if target.type == "cuda":
            devices = [target.index if target.index is not None else torch.cuda.current_device()]
        # The initialisation draws from config.seed without disturbing the caller's generators.
        with torch.random.fork_rng(devices=devices), target:
            torch.manual_seed(config.seed)
            self.embedding: nn.Embedding | None = (
                nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
                if pre_process
                else None
            )
            self.layers = nn.ModuleList(HybridLayer(config, i) for i in layer_range)
            self.final_norm: RMSNorm | None = (
                RMSNorm(config.hidden_size, config.norm_eps, dtype=config.dtype)
                if post_process
                else None
            )
            self.output_layer: nn.Linear | None = None
            if post_process and not (config.tie_word_embeddings and pre_process):
                self.output_layer = nn.Linear(
                    config.hidden_size, config.vocab_size, bias=False, dtype=config.dtype
                )
            if target.type != "meta":
                self._initialize()
        self.logits_input: nn.Module = nn.Identity()
        """Applied to hidden states before the output projection (TP: copy to the region)."""
        self.logits_gather: nn.Module = nn.Identity()
        """Applied to the logits (TP: all-gather of the vocabulary shards)."""

    @torch.no_grad()
    def _initialize(self) -> None:
        std = self.config.init_std
        # Output projections of residual blocks start smaller (GPT-2's depth scaling).
        scaled = std / math.sqrt(2 * self.config.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
            elif isinstance(module, nn.Linear):
                last = name.rsplit(".", 1)[-1]
                module.weight.normal_(
                    0.0, scaled if last in ("out_proj", "o_proj", "down_proj") else std
                )
                if module.bias is not None:
                    module.bias.zero_()

    @property
    def mamba_layers(self) -> list[Mamba2Mixer]:
        """The Mamba mixers this module holds, in layer order."""
        return [layer.mixer for layer in self.layers if isinstance(layer.mixer, Mamba2Mixer)]

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight (the embedding's when tied).

        Returns:
            ``[vocab, hidden]`` weight (this rank's vocabulary shard under TP).

        Raises:
            ModelInputError: On a pipeline stage without the output layer.
        """
        if self.output_layer is not None:
            return self.output_layer.weight
        if self.post_process and self.embedding is not None:
            return self.embedding.weight
        raise ModelInputError("this pipeline stage has no output layer (post_process=False)")

    def compute_logits(
        self, hidden: torch.Tensor, *, gather: bool = True, upcast: bool = True
    ) -> torch.Tensor:
        """Project final-normed hidden states to logits.

        Args:
            hidden: ``[..., hidden]`` output of ``forward(..., return_hidden=True)``.
            gather: Under tensor parallelism, all-gather the vocabulary shards (default).
            upcast: Return float32 (default).

        Returns:
            ``[..., vocab_size]`` logits.
        """
        logits = F.linear(self.logits_input(hidden), self.output_weight())
        if gather:
            logits = self.logits_gather(logits)
        return logits.float() if upcast else logits

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        packed_seq_params: PackedSeqParams | None = None,
        kv_cache: KVCache | None = None,
        mamba_state: MambaStepState | None = None,
        return_hidden: bool = False,
        gather_logits: bool = True,
    ) -> torch.Tensor:
        """Run the model (or this pipeline stage).

        Args:
            input_ids: ``[B, T]`` token ids, or ``[B, T, hidden]`` hidden states on a stage
                without the embedding.
            position_ids: ``[B, T]`` positions (only checked: the model has no positional
                embedding; the KV cache orders tokens by the engine's positions).
            packed_seq_params: Sequences packed in the single row (B = 1); neither attention
                nor the Mamba layers cross their boundaries.
            kv_cache: Caller-owned KV cache of the attention layers (B = 1).
            mamba_state: Caller-owned Mamba state slots of this step (B = 1); required with
                ``kv_cache`` when the model has Mamba layers.
            return_hidden: Return the final-normed hidden states instead of logits.
            gather_logits: Under TP, gather the logits to the full vocabulary (default).

        Returns:
            float32 logits ``[B, T, vocab]``, the final hidden states, or on a stage without
            the output layer the residual stream ``[B, T, hidden]``.

        Raises:
            ModelInputError: If the inputs are malformed or do not go together.
        """
        batch, seq_len = input_ids.shape[0], input_ids.shape[1]
        has_mamba = bool(self.mamba_layers)
        if (kv_cache is not None or mamba_state is not None or packed_seq_params) and batch != 1:
            raise ModelInputError(
                f"input_ids.shape={tuple(input_ids.shape)}: with a KV cache, Mamba state or "
                "packed sequences B must be 1 (flatten the sequences into one row)"
            )
        if kv_cache is not None and has_mamba and mamba_state is None:
            raise ModelInputError(
                "mamba_state=None: a model with Mamba layers needs the Mamba state slots "
                "alongside kv_cache"
            )
        if position_ids is not None and tuple(position_ids.shape) != (batch, seq_len):
            raise ModelInputError(
                f"position_ids.shape={tuple(position_ids.shape)} must be {(batch, seq_len)}"
            )
        if self.embedding is not None:
            hidden = self.embedding(input_ids)
        else:
            hidden = input_ids
        if self.config.residual_in_fp32:
            hidden = hidden.float()
        mask = None
        if kv_cache is None and any(layer.kind == "attention" for layer in self.layers):
            mask = build_attention_mask(
                self.config.attention_backend, seq_len, hidden.device, packed_seq_params
            )
        half = self.config.kv_channels // 2
        cos = torch.ones((batch, seq_len, half), device=hidden.device)
        sin = torch.zeros((batch, seq_len, half), device=hidden.device)
        cu = packed_seq_params.cu_seqlens if packed_seq_params is not None else None
        for layer in self.layers:
            hidden = layer(
                hidden,
                cos=cos,
                sin=sin,
                mask=mask,
                kv_cache=kv_cache,
                cu_seqlens=cu,
                mamba_state=mamba_state,
            )
        if self.final_norm is None:
            return hidden
        hidden = self.final_norm(hidden.to(self.final_norm.weight.dtype))
        if return_hidden:
            return hidden
        return self.compute_logits(hidden, gather=gather_logits)

    @classmethod
    def from_hf(
        cls,
        path: str | os.PathLike[str],
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        state: ParallelState | None = None,
        **config_overrides: Any,
    ) -> HybridModel:
        """Load a Hugging Face ``mamba2`` or ``nemotron_h`` checkpoint directory.

        Args:
            path: Directory with ``config.json`` and safetensors weights.
            dtype: Parameter dtype (default: the checkpoint's).
            device: Device of the parameters.
            state: Parallel state to shard the model for (tensor parallelism), or None.
            **config_overrides: :class:`HybridConfig` fields to set (e.g. ``chunk_size``).

        Returns:
            The loaded (and, with ``state``, parallelized) model.

        Raises:
            CheckpointFormatError: If the architecture or a tensor is not supported.
        """
        from mcore_models.mamba.hf import load_hybrid_hf

        return load_hybrid_hf(path, dtype=dtype, device=device, state=state, **config_overrides)

    def to_hf(self, directory: str | os.PathLike[str]) -> None:
        """Write ``config.json`` and ``model.safetensors`` that transformers loads.

        Args:
            directory: Output directory (created if missing).

        Raises:
            ModelConfigError: If the model is sharded or a pipeline stage.
        """
        from mcore_models.mamba.hf import save_hybrid_hf

        save_hybrid_hf(self, directory)
