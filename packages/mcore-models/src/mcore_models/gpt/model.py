"""GPTModel: a Llama/Qwen-style decoder in plain torch (parallelism lives in parallelize.py)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mcore_kernels import RMSNorm, token_logprobs
from mcore_kernels.batch_invariant import is_batch_invariant
from mcore_models.errors import ModelConfigError, ModelInputError, PackedSeqError
from mcore_models.gpt.attention_backends import AttentionMask, build_attention_mask
from mcore_models.gpt.batch_invariant import with_batch_invariance
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.kv_cache import KVCache
from mcore_models.gpt.layer import DecoderLayer, add_rms_norm
from mcore_models.gpt.rope import RotaryEmbedding
from mcore_models.gpt.yarn import MLARotaryEmbedding
from mcore_models.materialize import materialize_module, place_parameters
from mcore_models.packed_seq import PackedSeqParams
from mcore_parallel.sharding import get_partition_dims

if TYPE_CHECKING:
    from mcore_models.parallelize import PipelineLayout
    from mcore_parallel.state import ParallelState

__all__ = ["GPTModel"]


class GPTModel(nn.Module):
    """Decoder-only transformer of the Llama / Qwen2 / Qwen3 family, in plain torch.

    Token embedding, ``num_layers`` pre-norm decoder layers (RMSNorm, RoPE, grouped-query
    attention, SwiGLU MLP), a final RMSNorm and the output layer (optionally tied to the
    embedding). The model holds no process group and its forward has no parallel branches:
    :func:`mcore_models.parallelize` shards it in place (tensor, sequence, expert and context
    parallelism) and splits it into pipeline stages.

    A pipeline stage is a ``GPTModel`` that holds a range of the layers (``layers``), with the
    embedding only when ``pre_process`` and the final norm and output layer only when
    ``post_process``; a stage that is not the first takes hidden states instead of token ids,
    and one that is not the last returns hidden states. Layers keep their global index
    (``layer.layer_idx``), and every parameter records its name in the whole model
    (:func:`mcore_models.init.global_slice`), so initial values, checkpoints and Hugging Face
    files do not depend on the layout.

    Built with ``device="meta"`` the model allocates nothing (shard it, then
    :func:`mcore_models.materialize`); otherwise it is initialised from ``config.seed`` with
    the layout-independent scheme of :mod:`mcore_models.init`.

    Args:
        config: Model config.
        device: Device of the parameters (default: the current default device); ``"meta"``
            builds without storage.
        layers: Global indices of the decoder layers this module holds (default: all).
        pre_process: Whether it holds the embedding (the first pipeline stage).
        post_process: Whether it holds the final norm and output layer (the last stage).

    Raises:
        ModelConfigError: If ``layers`` is not a range inside ``[0, num_layers)``.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        device: torch.device | str | None = None,
        layers: range | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        layer_range = range(config.num_layers) if layers is None else layers
        if not isinstance(layer_range, range) or (
            len(layer_range) and (layer_range.start < 0 or layer_range.stop > config.num_layers)
        ):
            raise ModelConfigError(
                f"layers={layers!r} must be a range inside [0, num_layers={config.num_layers})"
            )
        self.pre_process = pre_process
        """Whether this module holds the embedding (takes token ids)."""
        self.post_process = post_process
        """Whether this module holds the final norm and the output layer (returns logits)."""
        self.tp_group: Any = None
        """Tensor-parallel group set by ``parallelize`` (for the fused inference collective
        and introspection); the forward pass never branches on it."""
        self.sequence_parallel_size = 1
        """Sequence-parallel split of the activations (set by ``parallelize``): a stage that
        receives hidden states sees ``T / sequence_parallel_size`` of the ``T`` positions."""
        self.context_parallel_size = 1
        """Context-parallel size (set by ``parallelize``): the model gets this rank's
        ``T / cp`` tokens (``mcore_parallel.context_parallel.split_sequence``) with their
        positions, and ``packed_seq_params`` of the full row."""
        target = torch.device(device) if device is not None else torch.empty(0).device
        with torch.device("meta"):
            # NOTE: `_weight` skips nn.Embedding's normal_ init, which on the meta device runs
            # a Python decomposition that imports torch._dynamo (~20 s without bytecode caches).
            self.embedding: nn.Module | None = (
                nn.Embedding(
                    config.vocab_size,
                    config.hidden_size,
                    _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=config.dtype),
                )
                if pre_process
                else None
            )
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in layer_range)
            self.final_norm: RMSNorm | None = (
                RMSNorm(config.hidden_size, config.norm_eps, dtype=config.dtype)
                if post_process
                else None
            )
            self.output_layer: nn.Module | None = None
            if post_process and not (config.tie_word_embeddings and pre_process):
                # NOTE: a last stage without the embedding holds a copy of the tied weight; it
                # has the embedding's canonical name, so it starts (and loads) identical.
                self.output_layer = nn.Linear(
                    config.hidden_size, config.vocab_size, bias=False, dtype=config.dtype
                )
        # Communication points of the output head; identity until parallelize replaces them.
        self.logits_input: nn.Module = nn.Identity()
        """Applied to hidden states before the output projection (TP: copy to the region)."""
        self.logits_gather: nn.Module = nn.Identity()
        """Applied to the logits when the full vocabulary is asked for (TP: all-gather)."""
        self.sequence_gather: nn.Module = nn.Identity()
        """Applied after the final norm (SP: all-gather the sequence)."""
        self.rotary: nn.Module = RotaryEmbedding(
            config.kv_channels, config.rope_theta, config.rope_scaling, device="meta"
        )
        if config.mla is not None:
            self.rotary = MLARotaryEmbedding(config.mla, config.rope_theta, device="meta")
        place_parameters(self, None, self.canonical_name)
        if target.type != "meta":
            materialize_module(
                self,
                target,
                seed=config.seed,
                init_std=config.init_std,
                initialize=config.perform_initialization,
            )

    def canonical_name(self, name: str) -> str:
        """Name of a parameter of this module in the whole, unsharded model.

        Args:
            name: Local parameter name (``"layers.0.mlp.up_proj.weight"`` on a later stage).

        Returns:
            The global name (``"layers.12.mlp.up_proj.weight"``); the output layer of a stage
            holding a tied copy maps to ``"embedding.weight"``.
        """
        if name.startswith("layers."):
            _, local, rest = name.split(".", 2)
            layer = self.layers[int(local)]
            return f"layers.{layer.layer_idx}.{rest}"  # type: ignore[union-attr]
        if name.startswith("output_layer.") and self.config.tie_word_embeddings:
            return "embedding." + name.split(".", 1)[1]
        return name

    def shared_embedding_parameters(self) -> list[nn.Parameter]:
        """This stage's copies of the tied embedding when it is split over pipeline stages.

        Sum their gradients over ``state.embedding_group`` after backward
        (``mcore_parallel.pipeline.tied.allreduce_tied_embedding_grads``).

        Returns:
            ``[embedding.weight]`` on a first stage without the output layer,
            ``[output_layer.weight]`` on a last stage without the embedding, else ``[]``.
        """
        if not self.config.tie_word_embeddings or (self.pre_process and self.post_process):
            return []
        if self.pre_process and self.embedding is not None:
            return [self.embedding.weight]  # type: ignore[list-item]
        if self.output_layer is not None:
            return [self.output_layer.weight]  # type: ignore[list-item]
        return []

    @with_batch_invariance
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        packed_seq_params: PackedSeqParams | None = None,
        kv_cache: KVCache | None = None,
        return_hidden: bool = False,
        gather_logits: bool = True,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the model (or this pipeline stage).

        Args:
            input_ids: ``[B, T]`` token ids; on a stage without the embedding, the hidden
                states ``[B, T / sp, H]`` from the previous stage.
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
            labels: ``[B, T]`` target token ids: the last stage returns their float32
                log-probabilities ``[B, T]`` instead of logits (vocabulary-parallel under TP,
                the logits are never gathered).

        Returns:
            float32 logits ``[B, T, vocab_size]`` (or the vocabulary shard), hidden states, or
            label log-probs on the last stage; on other stages the residual stream
            ``[B, T / sp, hidden]`` for the next stage.

        Raises:
            ModelInputError: If ``input_ids`` or ``position_ids`` are malformed or the
                arguments do not go together.
            PackedSeqError: If the packed sequences do not cover the row exactly.
            AttentionBackendError: If the attention backend cannot serve the request.
        """
        position_ids = self._check_inputs(input_ids, position_ids, packed_seq_params, kv_cache)
        seq_len = position_ids.shape[1]
        mask = None
        if self.context_parallel_size > 1:
            if packed_seq_params is not None and packed_seq_params.prefix_of is not None:
                raise PackedSeqError(
                    "packed_seq_params.prefix_of (shared prefixes) is not supported with "
                    f"context parallelism (cp={self.context_parallel_size}); expected None"
                )
            cu = packed_seq_params.cu_seqlens if packed_seq_params is not None else None
            mask = AttentionMask(seq_len=seq_len, cu_seqlens=cu)
        elif kv_cache is None:
            mask = build_attention_mask(
                self.config.attention_backend, seq_len, position_ids.device, packed_seq_params
            )
        hidden = self.embedding(input_ids) if self.embedding is not None else input_ids
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
        if self.final_norm is None:
            # The next stage starts a fresh residual stream from the sum.
            return hidden if residual is None else hidden + residual
        hidden, _ = add_rms_norm(self.final_norm, hidden, residual, partial_group=fused_group)
        hidden = self.sequence_gather(hidden)
        if return_hidden:
            return hidden
        if labels is not None:
            return self.label_logprobs(hidden, labels)
        return self.compute_logits(hidden, gather=gather_logits)

    def _fused_reduction_group(self) -> Any:
        """The TP group when the fused reduce-scatter/add/norm/all-gather path applies."""
        if (
            self.tp_group is None
            or not self.config.inference_fuse_tp_communication
            or self.sequence_parallel_size > 1
            or torch.is_grad_enabled()
            # The fused kernel normalises in its own order, unlike the training forward.
            or is_batch_invariant()
            or not (self.pre_process and self.post_process)
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

        Raises:
            ModelInputError: On a pipeline stage without the output layer.
        """
        if self.output_layer is not None:
            return self.output_layer.weight  # type: ignore[return-value]
        if self.post_process and self.embedding is not None:
            return self.embedding.weight  # type: ignore[return-value]
        raise ModelInputError("this pipeline stage has no output layer (post_process=False)")

    @with_batch_invariance
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
        logits = F.linear(self.logits_input(hidden), self.output_weight())
        if gather:
            logits = self.logits_gather(logits)
        return logits.float() if upcast else logits

    def label_logprobs(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of ``labels`` under the logits of ``hidden`` (vocab-parallel).

        Args:
            hidden: ``[B, T, hidden]`` final-normed hidden states.
            labels: ``[B, T]`` target token ids.

        Returns:
            float32 ``[B, T]``.

        Raises:
            ModelInputError: If ``labels`` is not shaped like the hidden states' rows.
        """
        if tuple(labels.shape) != tuple(hidden.shape[:-1]):
            raise ModelInputError(
                f"labels.shape={tuple(labels.shape)} must equal {tuple(hidden.shape[:-1])}"
            )
        logits = self.compute_logits(hidden, gather=False, upcast=False)
        group = getattr(self.logits_gather, "group", None)
        flat = logits.reshape(-1, logits.shape[-1])
        logprobs = token_logprobs(flat, labels.reshape(-1), group=group)
        assert isinstance(logprobs, torch.Tensor)
        return logprobs.view(labels.shape)

    def _check_inputs(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        packed: PackedSeqParams | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        if not self.pre_process:
            if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 3:
                raise ModelInputError(
                    f"input_ids={_describe(input_ids)}: a pipeline stage without the embedding "
                    "takes the previous stage's hidden states [B, T, hidden]"
                )
            batch, seq_len = input_ids.shape[0], input_ids.shape[1] * self.sequence_parallel_size
        else:
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
            full = seq_len * self.context_parallel_size
            if packed.total_tokens != full:
                raise PackedSeqError(
                    f"cu_seqlens[-1]={packed.total_tokens} must equal the number of tokens "
                    f"T={full}"
                    + (" of the full row (context parallelism)" if full != seq_len else "")
                )
        if kv_cache is not None:
            if batch != 1:
                raise ModelInputError(
                    f"input_ids.shape={tuple(input_ids.shape)}: with kv_cache B must be 1 "
                    "(flatten the new tokens of all requests into one row)"
                )
            if position_ids is None:
                raise ModelInputError("position_ids=None: kv_cache needs explicit positions")
        sp = self.sequence_parallel_size
        if sp > 1 and seq_len % sp:
            raise ModelInputError(
                f"input_ids.shape={tuple(input_ids.shape)}: with sequence parallelism the "
                f"sequence length must be divisible by the tensor-parallel size {sp}"
            )
        if self.context_parallel_size > 1:
            if kv_cache is not None:
                raise ModelInputError("kv_cache is not supported under context parallelism")
            if position_ids is None:
                raise ModelInputError(
                    "position_ids=None: under context parallelism pass this rank's positions "
                    "(mcore_parallel.context_parallel.position_ids)"
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
                f"position_ids={_describe(position_ids)} must be an integer tensor shaped "
                f"{(batch, seq_len)}"
            )
        return position_ids

    @classmethod
    def from_hf(
        cls,
        path: str | os.PathLike[str],
        state: ParallelState | None = None,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        sequence_parallel: bool | None = None,
        pipeline: PipelineLayout | None = None,
        context_parallel_method: str = "ring",
        **config_overrides: Any,
    ) -> Any:
        """Load a Hugging Face Llama, Qwen2/3 (or MoE) checkpoint directory.

        The model is built on the meta device and parallelized for ``state`` first; each
        rank then reads only its slices of the checkpoint's tensors.

        Args:
            path: Directory with ``config.json`` and ``model.safetensors`` (or sharded
                safetensors with ``model.safetensors.index.json``).
            state: Parallel state (tp, pp, ep, etp); None loads the whole model.
            dtype: Parameter dtype (default: the checkpoint's ``torch_dtype``/``dtype``).
            device: Device of the parameters (default ``state.device``).
            sequence_parallel: See :func:`mcore_models.parallelize`.
            pipeline: Virtual stages / layer split under pipeline parallelism.
            context_parallel_method: See :func:`mcore_models.parallelize` (``cp > 1``).
            **config_overrides: GPTConfig fields to set (e.g. ``attention_backend``).

        Returns:
            The loaded model, this rank's pipeline stage, or its list of chunks when
            ``pipeline.virtual_stages > 1``.

        Raises:
            CheckpointFormatError: If the architecture is unsupported, a tensor is missing or
                unexpected, or a shape does not match (the message names the tensor).
            ModelConfigError: If the layout does not fit the model.
        """
        from mcore_models.gpt.hf import load_hf

        return load_hf(
            cls,
            path,
            state=state,
            dtype=dtype,
            device=device,
            sequence_parallel=sequence_parallel,
            pipeline=pipeline,
            context_parallel_method=context_parallel_method,
            **config_overrides,
        )

    def to_hf(
        self, directory: str | os.PathLike[str], *, state: ParallelState | None = None
    ) -> None:
        """Write ``config.json`` and safetensors weights that transformers loads.

        From any layout: pass the ``state`` the model was parallelized with and call it on
        every rank; shards are gathered one tensor at a time, each pipeline stage writes its
        own shard files and rank 0 writes the index. An earlier export in ``directory`` is
        replaced, so that loaders read the new weights. For a list of virtual-stage chunks,
        use :func:`mcore_models.gpt.hf.save_hf`.

        Args:
            directory: Output directory (created if missing).
            state: Parallel state of a parallelized model; None for a whole model.

        Raises:
            ModelConfigError: If the model is parallelized and ``state`` is None.
        """
        from mcore_models.gpt.hf import save_hf

        sharded = any(get_partition_dims(param) for param in self.parameters())
        if state is None and (sharded or not (self.pre_process and self.post_process)):
            raise ModelConfigError(
                "state=None: this model is parallelized; pass the ParallelState it was "
                "parallelized with (every rank must call to_hf)"
            )
        save_hf(self, directory, state=state)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    return repr(value)
