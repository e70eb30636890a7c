"""The policy at the training layout: this rank's model chunks, built sharded, as one module.

A rank holds one model chunk per virtual pipeline stage (one for ``vp = 1``), each sharded over
the tensor-parallel (and expert) ranks by :func:`mcore_models.parallelize`. :class:`PolicyChunks`
puts them in one module for the data-parallel wrapper and the optimizer, naming every parameter
by its name in the whole model, so optimizer state, checkpoints and reference weights are keyed
the same on every layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mcore_models import GPTConfig, GPTModel, PipelineLayout, build_pipeline_stages
from mcore_parallel import ParallelState
from mcore_parallel.checkpointing import sharded_state_dict
from mcore_parallel.sharding import ShardedTensor

__all__ = [
    "PolicyChunks",
    "allreduce_shared_embedding_grads",
    "build_policy_chunks",
    "load_policy_chunks",
]


def _as_list(built: GPTModel | list[GPTModel]) -> list[GPTModel]:
    return built if isinstance(built, list) else [built]


def _mark_shared_copies(chunks: list[GPTModel]) -> None:
    # The last stage's copy of a tied embedding is a replica: saved and counted in the gradient
    # norm on the first stage only (see mcore_parallel's distributed optimizer).
    for chunk in chunks:
        if not chunk.pre_process:
            for param in chunk.shared_embedding_parameters():
                param.pipeline_shared_copy = True  # type: ignore[attr-defined]


def build_policy_chunks(
    config: GPTConfig,
    state: ParallelState,
    *,
    virtual_stages: int = 1,
    sequence_parallel: bool = False,
    device: torch.device | str | None = None,
    context_parallel_method: str = "ring",
) -> list[GPTModel]:
    """Builds this rank's chunks of a model from scratch, sharded at ``state``'s layout.

    Every layout gets the slices of the same full weights (``config.seed``), so runs at
    different layouts start from the same policy.

    Args:
        config: Model shape.
        state: Training layout.
        virtual_stages: Chunks per pipeline rank.
        sequence_parallel: Split the sequence over the tensor-parallel ranks between layers.
        device: Device of the parameters (default ``state.device``).
        context_parallel_method: Attention over the context-parallel ranks (``"ring"`` or
            ``"all_gather"``) when ``state`` has ``cp > 1``.

    Returns:
        This rank's chunks, first stage first.
    """
    chunks = build_pipeline_stages(
        config,
        state,
        virtual_stages=virtual_stages,
        sequence_parallel=sequence_parallel,
        device=device,
        context_parallel_method=context_parallel_method,
    )
    _mark_shared_copies(chunks)
    return chunks


def load_policy_chunks(
    path: str,
    state: ParallelState,
    *,
    dtype: str | None,
    virtual_stages: int = 1,
    sequence_parallel: bool = False,
    device: torch.device | str | None = None,
    batch_invariant: bool = False,
    context_parallel_method: str = "ring",
) -> list[GPTModel]:
    """Loads this rank's chunks of a Hugging Face checkpoint, reading only its slices.

    Args:
        path: Checkpoint directory.
        state: Training layout.
        dtype: Parameter dtype name, or None for the checkpoint's.
        virtual_stages: Chunks per pipeline rank.
        sequence_parallel: Split the sequence over the tensor-parallel ranks between layers.
        device: Device of the parameters (default ``state.device``).
        batch_invariant: Batch-invariant numerics (``GPTConfig.batch_invariant``).
        context_parallel_method: Attention over the context-parallel ranks (``"ring"`` or
            ``"all_gather"``) when ``state`` has ``cp > 1``.

    Returns:
        This rank's chunks, first stage first.
    """
    built = GPTModel.from_hf(
        path,
        state=state,
        dtype=dtype,
        device=device if device is not None else state.device,
        sequence_parallel=sequence_parallel,
        pipeline=PipelineLayout(virtual_stages=virtual_stages),
        batch_invariant=batch_invariant,
        context_parallel_method=context_parallel_method,
    )
    chunks = _as_list(built)
    _mark_shared_copies(chunks)
    return chunks


def _is_tied_copy(chunk: GPTModel, name: str) -> bool:
    # A last stage's output layer holding a copy of the tied embedding.
    return (
        name.startswith("output_layer.")
        and not chunk.pre_process
        and chunk.config.tie_word_embeddings
    )


def _parameter_name(chunk: GPTModel, name: str) -> str:
    # A tied copy keeps its local name: the canonical one belongs to the first stage's copy.
    return name if _is_tied_copy(chunk, name) else chunk.canonical_name(name)


class PolicyChunks(nn.Module):
    """This rank's model chunks as one module whose parameters carry whole-model names.

    Args:
        chunks: The chunks, first stage first.
    """

    def __init__(self, chunks: list[GPTModel]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self._typed_chunks = list(chunks)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the only chunk (a model without pipeline stages).

        Args:
            *args: Positional arguments of ``GPTModel.forward``.
            **kwargs: Keyword arguments of ``GPTModel.forward``.

        Returns:
            The chunk's output.

        Raises:
            TypeError: With several chunks (a pipeline schedule calls them one by one).
        """
        if len(self.chunks) != 1:
            raise TypeError(f"PolicyChunks holds {len(self.chunks)} chunks; call them one by one")
        return self.chunks[0](*args, **kwargs)

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters named as in the whole model (``layers.12.mlp.up_proj.weight``).

        Args:
            prefix: Prepended to every name.
            recurse: Ignored (the chunks' parameters are always listed).
            remove_duplicate: Ignored (a chunk holds no parameter twice).

        Yields:
            ``(name, parameter)`` pairs, chunk by chunk.
        """
        del recurse, remove_duplicate
        for chunk in self._typed_chunks:
            for name, param in chunk.named_parameters():
                yield prefix + _parameter_name(chunk, name), param

    def sharded_model_state(self, state: ParallelState) -> dict[str, ShardedTensor]:
        """The parameters as blocks of the whole model's tensors, for mcore-ckpt.

        Args:
            state: The layout the chunks were built with.

        Returns:
            Whole-model name -> block (aliasing the live parameter; loading writes in place).
        """
        result: dict[str, ShardedTensor] = {}
        for chunk in self._typed_chunks:
            blocks = sharded_state_dict(chunk, state)
            for name, _ in chunk.named_parameters():
                block = blocks[name]
                if not isinstance(block, ShardedTensor):
                    continue
                if _is_tied_copy(chunk, name):
                    block = ShardedTensor(
                        block.local,
                        block.global_shape,
                        block.global_offset,
                        block.replica_id + dist.get_world_size(),
                    )
                result[_parameter_name(chunk, name)] = block
        return result


def allreduce_shared_embedding_grads(chunks: list[GPTModel], state: ParallelState) -> None:
    """Sums the gradients of a tied embedding's copies on the first and last stage.

    Call it after the backward passes and before the data-parallel reduction (the optimizer
    step): both copies then receive the same update and stay identical.

    Args:
        chunks: This rank's chunks (their parameters carry ``main_grad`` buffers).
        state: The training layout.
    """
    if state.size("pp") == 1 or state.embedding_group is None:
        return
    for chunk in chunks:
        for param in chunk.shared_embedding_parameters():
            grad = getattr(param, "main_grad", None)
            if grad is not None:
                dist.all_reduce(grad, group=state.embedding_group)
