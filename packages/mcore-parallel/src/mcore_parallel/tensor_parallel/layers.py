"""Tensor-parallel linear and embedding layers (Megatron-LM style column/row split).

Every layer takes ``state: ParallelState | None``. With None (or a tensor-parallel size of 1)
it is a plain single-process layer. Weights are initialised by creating the full ("master")
weight on the CPU in float32 from the seed and keeping this rank's chunk, so a model built with
TP=1 and the same model built with TP=N hold the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mcore_parallel.errors import ParallelConfigError, ParallelTypeError
from mcore_parallel.sharding import set_partition_dim
from mcore_parallel.state import ParallelState, _check_int_at_least, _check_positive
from mcore_parallel.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "default_init_method",
    "allreduce_sequence_parallel_grads",
]

InitMethod = Callable[[torch.Tensor], Any]

# Standard deviation of the default normal initialisation; 0.02 is Megatron-Core's default
# ``TransformerConfig.init_method_std`` (github.com/NVIDIA/Megatron-LM,
# megatron/core/transformer/transformer_config.py).
_DEFAULT_INIT_STD = 0.02


def default_init_method(tensor: torch.Tensor) -> torch.Tensor:
    """Initialises ``tensor`` in place from N(0, 0.02²), the default of every layer here.

    Args:
        tensor: The full (master) weight.

    Returns:
        ``tensor``.
    """
    return nn.init.normal_(tensor, mean=0.0, std=_DEFAULT_INIT_STD)


def _tp(state: ParallelState | None) -> tuple[int, int, Any]:
    if state is None:
        return 1, 0, None
    if not isinstance(state, ParallelState):
        raise ParallelTypeError(
            f"state must be a ParallelState or None, got {type(state).__name__}"
        )
    return state.size("tp"), state.rank_in("tp"), state.group("tp")


def _check_divisible(name: str, value: int, tp_size: int) -> int:
    if value % tp_size != 0:
        raise ParallelConfigError(
            f"{name}={value} must be divisible by the tensor-parallel size tp={tp_size}"
        )
    return value // tp_size


def _sharded_parameter(
    shape: tuple[int, ...],
    partition_dim: int,
    tp_size: int,
    tp_rank: int,
    init_method: InitMethod,
    seed: int | None,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> nn.Parameter:
    if device is not None and torch.device(device).type == "meta":
        # Built on the meta device (large models): no master weight, only this rank's shape;
        # the caller materialises and initialises the shard later.
        local = list(shape)
        local[partition_dim] //= tp_size
        param = nn.Parameter(
            torch.empty(local, dtype=dtype or torch.get_default_dtype(), device="meta")
        )
        if tp_size > 1:
            set_partition_dim(param, partition_dim, axis="tp")
        return param
    master = torch.empty(shape, dtype=torch.float32)
    if seed is None:
        init_method(master)
    else:
        # NOTE: the seed only drives this weight; the caller's global RNG stream is untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            init_method(master)
    shard = master.chunk(tp_size, dim=partition_dim)[tp_rank]
    param = nn.Parameter(shard.to(dtype=dtype or torch.get_default_dtype(), device=device).clone())
    if tp_size > 1:
        set_partition_dim(param, partition_dim, axis="tp")
    return param


class _TensorParallelModule(nn.Module):
    """Base of the layers here: the tp group, sequence-parallel settings and sharded weights."""

    tp_size: int
    sequence_parallel: bool
    sequence_dim: int

    def _init_tensor_parallel(
        self,
        state: ParallelState | None,
        split: tuple[str, int],
        sequence_parallel: bool,
        sequence_dim: int,
    ) -> int:
        """Sets the tp attributes and returns the per-rank size of the split dimension.

        Args:
            state: Parallel state whose tp group splits the layer; None for a plain layer.
            split: Name and full size of the dimension split over the tp ranks.
            sequence_parallel: Whether the layer works on a sequence-parallel region.
            sequence_dim: Index of the sequence dimension.

        Returns:
            The size of the split dimension on this rank.

        Raises:
            ParallelTypeError: If ``state`` is not a ParallelState or None.
            ParallelConfigError: If the split size is not divisible by the tp size or
                ``sequence_dim`` is negative.
        """
        self.tp_size, self._tp_rank, self._group = _tp(state)
        per_rank = _check_divisible(split[0], split[1], self.tp_size)
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = _check_int_at_least("sequence_dim", sequence_dim, 0)
        return per_rank

    def _sharded_weight(
        self,
        shape: tuple[int, ...],
        partition_dim: int,
        init: tuple[InitMethod | None, int | None],
        factory: tuple[torch.dtype | None, torch.device | str | None],
    ) -> nn.Parameter:
        """Builds this rank's chunk of a weight split along ``partition_dim``.

        Args:
            shape: Full (master) shape of the weight.
            partition_dim: Dimension split over the tp ranks.
            init: The initialiser (None for :func:`default_init_method`) and its seed.
            factory: The parameter's dtype and device.

        Returns:
            This rank's shard as a parameter.
        """
        init_method, seed = init
        return _sharded_parameter(
            shape,
            partition_dim,
            self.tp_size,
            self._tp_rank,
            init_method or default_init_method,
            seed,
            *factory,
        )


class ColumnParallelLinear(_TensorParallelModule):
    """``y = x A^T + b`` with ``A`` split along its output features over tensor-parallel ranks.

    Args:
        in_features: Size of each input sample (full, not divided).
        out_features: Size of each output sample (full); divisible by the tp size.
        bias: Whether to learn an additive bias (initialised to zero), also split.
        state: Parallel state whose tp group splits the layer; None for a plain layer.
        gather_output: Whether to all-gather the output so every rank gets all
            ``out_features``; False leaves ``out_features / tp`` per rank (feed it to a
            :class:`RowParallelLinear` with ``input_is_parallel=True``).
        sequence_parallel: Whether the input is split along the sequence dimension over the
            tp ranks (sequence parallelism); it is all-gathered before the matmul and its
            gradient reduce-scattered.
        sequence_dim: Index of the sequence dimension of the input (0 for ``[s, b, h]``).
        init_method: In-place initialiser applied to the full ``[out, in]`` weight; default
            :func:`default_init_method`.
        seed: Seed of the weight's initialisation; None draws from the global CPU RNG (the
            same on every rank when all ranks seeded it alike).
        dtype: Parameter dtype; default ``torch.get_default_dtype()``.
        device: Parameter device; default CPU.

    Raises:
        ParallelConfigError: If a size is not a positive integer or ``out_features`` is not
            divisible by the tp size.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        state: ParallelState | None = None,
        gather_output: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = _check_positive("in_features", in_features)
        self.out_features = _check_positive("out_features", out_features)
        self.out_features_per_rank = self._init_tensor_parallel(
            state, ("out_features", out_features), sequence_parallel, sequence_dim
        )
        self.gather_output = gather_output
        factory = (dtype, device)
        self.weight = self._sharded_weight(
            (out_features, in_features), 0, (init_method, seed), factory
        )
        if bias:
            self.bias: nn.Parameter | None = self._sharded_weight(
                (out_features,), 0, (nn.init.zeros_, None), factory
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the layer.

        Args:
            x: Input ``[..., in_features]``, split along ``sequence_dim`` when
                ``sequence_parallel``.

        Returns:
            ``[..., out_features]`` if ``gather_output`` else ``[..., out_features / tp]``,
            over the full sequence.
        """
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self._group, sequence_dim=self.sequence_dim)
        else:
            x = copy_to_tensor_parallel_region(x, self._group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self._group)
        return y

    def extra_repr(self) -> str:
        """Returns the layer's sizes for ``repr``.

        Returns:
            A one-line summary.
        """
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.tp_size}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}, bias={self.bias is not None}"
        )


class RowParallelLinear(_TensorParallelModule):
    """``y = x A^T + b`` with ``A`` split along its input features over tensor-parallel ranks.

    Each rank multiplies its chunk of the input features and the partial results are summed
    (all-reduce, or reduce-scatter along the sequence with sequence parallelism); the bias is
    added once, after the sum.

    Args:
        in_features: Size of each input sample (full); divisible by the tp size.
        out_features: Size of each output sample.
        bias: Whether to learn an additive bias (initialised to zero, replicated).
        state: Parallel state whose tp group splits the layer; None for a plain layer.
        input_is_parallel: Whether the input already holds this rank's ``in_features / tp``
            chunk (output of a :class:`ColumnParallelLinear` with ``gather_output=False``);
            False scatters a full input.
        sequence_parallel: Whether to reduce-scatter the output along the sequence dimension
            instead of all-reducing it; needs ``input_is_parallel``. The bias gradient is then
            a per-rank partial sum: call :func:`allreduce_sequence_parallel_grads` after
            backward.
        sequence_dim: Index of the sequence dimension of the output (0 for ``[s, b, h]``).
        init_method: In-place initialiser applied to the full ``[out, in]`` weight; default
            :func:`default_init_method`.
        seed: Seed of the weight's initialisation; None draws from the global CPU RNG.
        dtype: Parameter dtype; default ``torch.get_default_dtype()``.
        device: Parameter device; default CPU.

    Raises:
        ParallelConfigError: If a size is not a positive integer, ``in_features`` is not
            divisible by the tp size, or ``sequence_parallel`` is set without
            ``input_is_parallel``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        state: ParallelState | None = None,
        input_is_parallel: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = _check_positive("in_features", in_features)
        self.out_features = _check_positive("out_features", out_features)
        if sequence_parallel and not input_is_parallel:
            raise ParallelConfigError(
                "sequence_parallel=True needs input_is_parallel=True (got input_is_parallel="
                f"{input_is_parallel})"
            )
        self.in_features_per_rank = self._init_tensor_parallel(
            state, ("in_features", in_features), sequence_parallel, sequence_dim
        )
        self.input_is_parallel = input_is_parallel
        self.weight = self._sharded_weight(
            (out_features, in_features), 1, (init_method, seed), (dtype, device)
        )
        if bias:
            self.bias: nn.Parameter | None = _sharded_parameter(
                (out_features,), 0, 1, 0, nn.init.zeros_, None, dtype, device
            )
            # Each rank only sees its sequence chunk, so the bias gradient is partial.
            self.bias.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the layer.

        Args:
            x: Input ``[..., in_features / tp]`` if ``input_is_parallel`` else
                ``[..., in_features]``.

        Returns:
            ``[..., out_features]``, split along ``sequence_dim`` when ``sequence_parallel``.
        """
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self._group)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(
                partial, self._group, sequence_dim=self.sequence_dim
            )
        else:
            y = reduce_from_tensor_parallel_region(partial, self._group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        """Returns the layer's sizes for ``repr``.

        Returns:
            A one-line summary.
        """
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.tp_size}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}, bias={self.bias is not None}"
        )


class VocabParallelEmbedding(_TensorParallelModule):
    """Embedding table split along the vocabulary over tensor-parallel ranks.

    Rank ``r`` holds rows ``[r * V / tp, (r + 1) * V / tp)``; each rank looks up the tokens it
    owns (zeros elsewhere) and the partial results are summed over the tp group.

    Args:
        num_embeddings: Vocabulary size (full); divisible by the tp size.
        embedding_dim: Size of each embedding vector.
        state: Parallel state whose tp group splits the table; None for a plain embedding.
        sequence_parallel: Whether to reduce-scatter the output along the sequence dimension
            (the input of a sequence-parallel region) instead of all-reducing it.
        sequence_dim: Index of the sequence dimension of the output (0 for ``[s, b, h]``).
        init_method: In-place initialiser applied to the full ``[V, h]`` table; default
            :func:`default_init_method`.
        seed: Seed of the table's initialisation; None draws from the global CPU RNG.
        dtype: Parameter dtype; default ``torch.get_default_dtype()``.
        device: Parameter device; default CPU.

    Raises:
        ParallelConfigError: If a size is not a positive integer or ``num_embeddings`` is not
            divisible by the tp size (pad the vocabulary).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        state: ParallelState | None = None,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = _check_positive("num_embeddings", num_embeddings)
        self.embedding_dim = _check_positive("embedding_dim", embedding_dim)
        per_rank = self._init_tensor_parallel(
            state, ("num_embeddings", num_embeddings), sequence_parallel, sequence_dim
        )
        self.vocab_start = self._tp_rank * per_rank
        """First vocabulary index held by this rank."""
        self.vocab_end = self.vocab_start + per_rank
        """One past the last vocabulary index held by this rank."""
        self.weight = self._sharded_weight(
            (num_embeddings, embedding_dim), 0, (init_method, seed), (dtype, device)
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Looks up the embeddings of ``input_ids``.

        Args:
            input_ids: Integer token ids of any shape, values in ``[0, num_embeddings)``.

        Returns:
            ``[*input_ids.shape, embedding_dim]``, split along ``sequence_dim`` when
            ``sequence_parallel``.
        """
        if self.tp_size == 1:
            out = F.embedding(input_ids, self.weight)
        else:
            outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
            local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(
                out, self._group, sequence_dim=self.sequence_dim
            )
        return reduce_from_tensor_parallel_region(out, self._group)

    def extra_repr(self) -> str:
        """Returns the table's sizes for ``repr``.

        Returns:
            A one-line summary.
        """
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"tp={self.tp_size}, vocab=[{self.vocab_start}, {self.vocab_end})"
        )


def allreduce_sequence_parallel_grads(module: nn.Module, state: ParallelState | None) -> None:
    """Sums over the tp group the gradients of parameters marked ``sequence_parallel``.

    Under sequence parallelism, replicated parameters applied to a sequence chunk (norm
    weights, the bias of a sequence-parallel :class:`RowParallelLinear`) get a partial
    gradient on each rank. Mark such parameters with ``param.sequence_parallel = True`` and
    call this after backward (the data-parallel gradient reduction does not cover it).

    Args:
        module: Module whose parameters to visit.
        state: Parallel state; None or tp size 1 makes this a no-op.
    """
    if state is None or state.size("tp") == 1:
        return
    grads = [
        p.grad
        for p in module.parameters()
        if getattr(p, "sequence_parallel", False) and p.grad is not None
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=state.group("tp"))
    for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(chunk.view_as(grad))
