"""Paged KV cache: the engine's implementation of the model's ``KVCache`` protocol."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_inference.errors import InferenceConfigError, KVCacheStepError
from mcore_kernels.batch_invariant import attention_batch_invariant, is_batch_invariant
from mcore_kernels.decode_step_metadata import decode_step_metadata
from mcore_kernels.paged_attention import paged_attention
from mcore_kernels.rotary_kv_write import rotary_kv_write

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """Keys and values of every layer in fixed-size blocks shared by all requests.

    Under tensor parallelism it holds this rank's key/value heads, under pipeline parallelism
    only the layers of this rank's stage.

    Before each forward the engine calls :meth:`set_step` with the step's metadata: where each
    new token's key/value goes (``slot_mapping``), the block table row of each token's request
    and each token's context length (its position + 1). :meth:`attend` then writes the new keys
    and values and runs :func:`mcore_kernels.paged_attention.paged_attention`, so every token
    sees exactly its own request's history. Both operations have fixed shapes for a fixed number
    of tokens and never read device values on the host, so a decode step can be captured in a
    CUDA graph with the metadata tensors as static inputs.

    Args:
        num_layers: Decoder layers of the model.
        num_blocks: Blocks per layer (block 0 is the scratch block of padded rows).
        block_size: Tokens per block.
        num_kv_heads: Key/value heads.
        head_dim: Channels per head.
        dtype: Storage dtype.
        device: Storage device.
        split_size: Split size of the split-KV attention kernel.
        first_layer: Global index of the first layer held (a pipeline stage holds the
            ``num_layers`` layers from it); ``attend`` takes global layer indices.
        layer_indices: Global indices of the ``num_layers`` layers that attend, when they are
            not a contiguous range (hybrid models: only their attention layers get storage).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        split_size: int,
        first_layer: int = 0,
        layer_indices: Sequence[int] | None = None,
    ) -> None:
        self._local_layer: dict[int, int] | None = None
        if layer_indices is not None:
            if len(layer_indices) != num_layers:
                raise InferenceConfigError(
                    f"layer_indices={list(layer_indices)} must name num_layers={num_layers} layers"
                )
            self._local_layer = {layer: i for i, layer in enumerate(layer_indices)}
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.split_size = split_size
        self.first_layer = first_layer
        self._slot_mapping: torch.Tensor | None = None
        self._block_tables: torch.Tensor | None = None
        self._context_lens: torch.Tensor | None = None
        self.one_token_per_sequence = False
        """Whether the installed step feeds every sequence at most one token (a decode step:
        no token attends to a position another token of the step writes). Set by
        :meth:`set_step`; kernels that write and read the cache in one launch need it."""

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value storage."""
        return self.keys.nbytes + self.values.nbytes

    def set_step(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        one_token_per_sequence: bool = False,
    ) -> None:
        """Install the metadata of the next forward.

        Args:
            slot_mapping: int64 ``[T]`` flat slot (``block * block_size + offset``) of each new
                token.
            block_tables: int32 ``[T, max_blocks]`` block table row of each token's request.
            context_lens: int32 ``[T]`` positions each token attends to (its position + 1).
            one_token_per_sequence: Every sequence feeds at most one token of the step (see
                :attr:`one_token_per_sequence`).
        """
        self._slot_mapping = slot_mapping
        self._block_tables = block_tables
        self._context_lens = context_lens
        self.one_token_per_sequence = one_token_per_sequence

    def prepare_step(
        self,
        block_tables: torch.Tensor,
        positions: torch.Tensor,
        table_rows: torch.Tensor,
        *,
        max_context: int | None = None,
        one_token_per_sequence: bool = False,
    ) -> None:
        """Derive and install the step metadata from positions and block table rows.

        Device ops with shapes fixed by ``T`` (no host reads; one launch on CUDA,
        :func:`mcore_kernels.decode_step_metadata.decode_step_metadata`), so it can run inside
        a CUDA graph.

        Args:
            block_tables: int32 ``[rows, max_blocks]`` block table of every request slot.
            positions: int64 ``[T]`` position of each new token.
            table_rows: int64 ``[T]`` row of ``block_tables`` of each token's request.
            max_context: Largest position + 1 of the step when known on the host (eager
                steps): the tables are cut to the blocks it needs, so the attention launches
                only the splits that can hold data. Results do not change (empty splits add
                exact zeros).
            one_token_per_sequence: Every sequence feeds at most one token of the step.
        """
        if max_context is not None:
            block_tables = block_tables[:, : -(-max_context // self.block_size)]
        # One launch on CUDA (the torch ops elsewhere), the same integers.
        slots, tables, lengths = decode_step_metadata(
            block_tables, positions, table_rows, self.block_size
        )
        self.set_step(slots, tables, lengths, one_token_per_sequence=one_token_per_sequence)

    def clear_step(self) -> None:
        """Drop the references to the step metadata."""
        self._slot_mapping = self._block_tables = self._context_lens = None
        self.one_token_per_sequence = False

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float
    ) -> torch.Tensor:
        """Store the new keys/values of a layer and attend each new token over its history.

        Args:
            layer_idx: Global index of the decoder layer (0-based).
            q: ``[T, Hq, D]`` new queries after RoPE (this rank's heads).
            k: ``[T, Hkv, D]`` new keys after RoPE.
            v: ``[T, Hkv, D]`` new values.
            scale: Multiplier of the query-key products.

        Returns:
            ``[T, Hq, D]`` attention output in the dtype of ``q``.

        Raises:
            KVCacheStepError: If no step metadata was installed with :meth:`set_step` or
                :meth:`prepare_step`.
        """
        self._check_step("attend", layer_idx)
        assert self._slot_mapping is not None
        local = self._local_index(layer_idx)
        keys, values = self.keys[local], self.values[local]
        flat_shape = (-1, *keys.shape[2:])
        keys.view(flat_shape).index_copy_(0, self._slot_mapping, k.to(keys.dtype))
        values.view(flat_shape).index_copy_(0, self._slot_mapping, v.to(values.dtype))
        return self._attend_stored(q, keys, values, scale)

    def attend_rotary(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """Like :meth:`attend` for queries and keys before RoPE, rotated in the same kernel.

        One launch rotates the queries and keys and writes the keys and values into their
        slots (:func:`mcore_kernels.rotary_kv_write.rotary_kv_write`), then the paged
        attention runs: the engine's fused decoder calls this instead of rotating first.

        Args:
            layer_idx: Global index of the decoder layer (0-based).
            q: ``[T, Hq, D]`` new queries before RoPE (strided views are fine).
            k: ``[T, Hkv, D]`` new keys before RoPE.
            v: ``[T, Hkv, D]`` new values.
            cos: float32 ``[T, D // 2]`` RoPE cosines of the tokens' positions.
            sin: float32 ``[T, D // 2]`` RoPE sines.
            scale: Multiplier of the query-key products.

        Returns:
            ``[T, Hq, D]`` attention output in the dtype of ``q``.

        Raises:
            KVCacheStepError: If no step metadata was installed.
        """
        self._check_step("attend_rotary", layer_idx)
        assert self._slot_mapping is not None
        local = self._local_index(layer_idx)
        keys, values = self.keys[local], self.values[local]
        rotated = rotary_kv_write(q, k, v, cos, sin, keys, values, self._slot_mapping)
        return self._attend_stored(rotated, keys, values, scale)

    def layer_write_target(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where a kernel that stores the step's keys and values itself writes them.

        For a projection with the cache write folded in (``decode_gemv(..., rope=...)``);
        :meth:`attend_stored_keys` then attends.

        Args:
            layer_idx: Global index of the decoder layer (0-based).

        Returns:
            ``(keys, values, slot_mapping)``: the layer's ``[num_blocks, block_size, Hkv, D]``
            key and value caches and the step's ``[T]`` slots.

        Raises:
            KVCacheStepError: If no step metadata was installed.
        """
        self._check_step("layer_write_target", layer_idx)
        assert self._slot_mapping is not None
        local = self._local_index(layer_idx)
        return self.keys[local], self.values[local], self._slot_mapping

    def attend_stored_keys(
        self,
        layer_idx: int,
        q: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """Like :meth:`attend_rotary` once the step's keys and values are in the cache.

        Args:
            layer_idx: Global index of the decoder layer (0-based).
            q: ``[T, Hq, D]`` new queries, rotated.
            scale: Multiplier of the query-key products.

        Returns:
            ``[T, Hq, D]`` attention output in the dtype of ``q``.

        Raises:
            KVCacheStepError: If no step metadata was installed.
        """
        self._check_step("attend_stored_keys", layer_idx)
        local = self._local_index(layer_idx)
        return self._attend_stored(q, self.keys[local], self.values[local], scale)

    def step_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The installed step's block tables and context lengths, for kernels that attend
        themselves (the fused decoder's attention in the o projection).

        Returns:
            ``(block_tables, context_lens)``: int32 ``[T, width]`` table rows (cut to the
            step's longest context in eager steps, the graph's width in captured ones) and
            int32 ``[T]`` attended positions.

        Raises:
            KVCacheStepError: If no step metadata was installed.
        """
        self._check_step("step_tables", -1)
        assert self._block_tables is not None and self._context_lens is not None
        return self._block_tables, self._context_lens

    def _local_index(self, layer_idx: int) -> int:
        # Storage index of a global layer (hybrid models store only their attention layers).
        if self._local_layer is not None:
            return self._local_layer[layer_idx]
        return layer_idx - self.first_layer

    def _check_step(self, method: str, layer_idx: int) -> None:
        if self._slot_mapping is None or self._block_tables is None or self._context_lens is None:
            raise KVCacheStepError(
                f"PagedKVCache.{method}(layer_idx={layer_idx}) called without step metadata; "
                "expected set_step() or prepare_step() before the forward"
            )

    def _attend_stored(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        assert self._block_tables is not None and self._context_lens is not None
        if is_batch_invariant():
            # The kernel of the packed training forward: same per-token reduction order.
            return attention_batch_invariant(
                q, keys, values, self._context_lens, scale=scale, block_tables=self._block_tables
            )
        return paged_attention(
            q,
            keys,
            values,
            self._block_tables,
            self._context_lens,
            scale=scale,
            split_size=self.split_size,
        )
