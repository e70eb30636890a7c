"""The engine's process groups: one model replica (tp x pp ranks) and its data-parallel peers.

Every rank of a replica (the model-parallel group, ``tp x pp`` ranks) runs the same schedule:
the ranks agree once on each batch of new requests (validation and identity, one
``all_gather_object``), the scheduler then runs the same deterministic code on every rank, and
the sampled tokens of each step are decided on one rank (tensor rank 0 of the last pipeline
stage) and broadcast, so stop decisions are identical everywhere. Data-parallel replicas serve
disjoint shares of the requests; :meth:`EngineGroups.gather_over_data_parallel` brings the
results back to every rank.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mcore_inference.errors import InvalidRequestError, UnsupportedModelError

if TYPE_CHECKING:
    from mcore_parallel.state import ParallelState

__all__ = ["EngineGroups", "RequestVerdict", "request_fingerprint"]


def request_fingerprint(prompt: Any, params: Any) -> int:
    """A 32-bit digest of a request, equal on ranks that were given the same request.

    Args:
        prompt: The prompt as given.
        params: The sampling parameters as given.

    Returns:
        CRC-32 of the request's ``repr``.
    """
    return zlib.crc32(repr((prompt, params)).encode())


@dataclass(frozen=True, slots=True)
class RequestVerdict:
    """One rank's view of a new request: its digest and its validation error, if any."""

    fingerprint: int
    """:func:`request_fingerprint` of the request on this rank."""
    error: str | None
    """Validation message on this rank, None when valid."""


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


class EngineGroups:
    """Groups, ranks and the small collectives the engine runs over them.

    Built from a ``ParallelState`` when given; otherwise from the model alone (its
    ``tp_group``, set by ``mcore_models.parallelize``), which serves tensor (and expert)
    parallelism but not pipeline or data parallelism.

    Args:
        model: The served model (or this rank's pipeline stage).
        state: The ``mcore_parallel.ParallelState`` the model was parallelized with, or None.
        device: Device of the tensors exchanged (CUDA under NCCL, CPU under gloo).

    Raises:
        UnsupportedModelError: If the layout cannot be served (context parallelism, a pipeline
            stage without ``state``, a model whose TP group differs from ``state``'s).
    """

    def __init__(self, model: Any, state: ParallelState | None, device: torch.device) -> None:
        self.device = device
        model_tp = getattr(model, "tp_group", None)
        whole = bool(getattr(model, "pre_process", True) and getattr(model, "post_process", True))
        if state is None:
            if not whole:
                raise UnsupportedModelError(
                    "model is a pipeline stage (pre_process/post_process False) and state=None; "
                    "pass the ParallelState it was parallelized with"
                )
            self.tp_group: dist.ProcessGroup | None = model_tp
            self.pp_size, self.pp_rank = 1, 0
            self.dp_group: dist.ProcessGroup | None = None
            self.replica_group: dist.ProcessGroup | None = model_tp
        else:
            if state.cp_size > 1:
                raise UnsupportedModelError(
                    f"state has cp={state.cp_size}; the engine serves cp=1 layouts"
                )
            self.tp_group = state.tp_group if state.tp_size > 1 else None
            if (model_tp is None) != (self.tp_group is None):
                raise UnsupportedModelError(
                    f"state has tp={state.tp_size} but the model "
                    f"{'is' if model_tp is not None else 'is not'} tensor-parallel; pass the "
                    "state the model was parallelized with"
                )
            self.pp_size, self.pp_rank = state.pp_size, state.pp_rank
            if whole != (self.pp_size == 1):
                raise UnsupportedModelError(
                    f"state has pp={self.pp_size} but the model is "
                    f"{'a whole model' if whole else 'a pipeline stage'}; pass the stage "
                    "parallelize returned for this state"
                )
            self.dp_group = state.dp_group if state.dp_size > 1 else None
            self.replica_group = state.mp_group if state.mp_size > 1 else None
            self._prev_rank, self._next_rank = state.pp_prev_rank, state.pp_next_rank
        self.tp_size = _size(self.tp_group)
        self.dp_size = _size(self.dp_group)
        self.dp_rank = dist.get_rank(self.dp_group) if self.dp_group is not None else 0
        self.replica_size = _size(self.replica_group)
        # Tensor rank 0 of the last stage decides the sampled tokens. Ranks are laid out with
        # the tensor ranks contiguous, so it is this rank's last-stage peer minus its tp rank.
        self.sampler_rank = -1
        if self.replica_group is not None:
            if state is None:
                self.sampler_rank = dist.get_global_rank(self.replica_group, 0)
            else:
                self.sampler_rank = state.pp_ranks[-1] - state.tp_rank

    # ------------------------------------------------------------------------------ pipeline

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the embedding (takes token ids)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the output layer (samples)."""
        return self.pp_rank == self.pp_size - 1

    def exchange_stages(
        self, send: torch.Tensor | None, recv_shape: tuple[int, ...] | None, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """Send this stage's output to the next stage and receive the next input, together.

        Both operations are posted in one ``batch_isend_irecv``, so neighbours never wait on
        each other's order. Every rank knows from the shared schedule whether its neighbours
        send, so the calls always pair up.

        Args:
            send: Hidden states for the next stage, or None.
            recv_shape: Shape of the hidden states expected from the previous stage, or None.
            dtype: Dtype of the received hidden states.

        Returns:
            The received tensor, or None.
        """
        operations = []
        received = None
        if send is not None:
            operations.append(dist.P2POp(dist.isend, send.contiguous(), self._next_rank))
        if recv_shape is not None:
            received = torch.empty(recv_shape, dtype=dtype, device=self.device)
            operations.append(dist.P2POp(dist.irecv, received, self._prev_rank))
        if operations:
            for request in dist.batch_isend_irecv(operations):
                request.wait()
        return received

    # ------------------------------------------------------------------------------ replicas

    def agree_on_config(self, description: str, usable_blocks: int) -> int:
        """Check that every rank of the replica has the same engine config; agree on the cache.

        Args:
            description: ``repr`` of the engine's config on this rank.
            usable_blocks: KV blocks this rank could hold (stages may differ).

        Returns:
            The smallest usable block count of the replica (every rank admits the same).

        Raises:
            InferenceConfigError: On every rank, if the configs differ.
        """
        from mcore_inference.errors import InferenceConfigError

        if self.replica_group is None:
            return usable_blocks
        views: list[Any] = [None] * self.replica_size
        dist.all_gather_object(views, (description, usable_blocks), group=self.replica_group)
        if len({view[0] for view in views}) > 1:
            raise InferenceConfigError(
                "the ranks of a model replica were given different InferenceConfigs "
                f"({views[0][0]} on its first rank); expected the same config on every rank"
            )
        return min(view[1] for view in views)

    def agree_on_requests(self, verdicts: Sequence[RequestVerdict]) -> list[str | None]:
        """Decide which new requests fail, identically on every rank of the replica.

        A request fails everywhere when it fails validation on any rank (with the message of
        the first such rank) or when the ranks were not given the same request.

        Args:
            verdicts: This rank's verdict of each new request, in order.

        Returns:
            For each request, the error every rank records, or None.

        Raises:
            InvalidRequestError: On every rank, if the ranks added different numbers of
                requests (their schedules would diverge).
        """
        if self.replica_group is None:
            return [verdict.error for verdict in verdicts]
        views: list[Any] = [None] * self.replica_size
        dist.all_gather_object(views, list(verdicts), group=self.replica_group)
        counts = [len(view) for view in views]
        if len(set(counts)) > 1:
            raise InvalidRequestError(
                f"the ranks of a model replica added {counts} requests; expected the same "
                "requests on every rank"
            )
        decisions: list[str | None] = []
        for index in range(counts[0]):
            column = [view[index] for view in views]
            errors = [verdict.error for verdict in column if verdict.error is not None]
            if errors:
                decisions.append(errors[0])
            elif len({verdict.fingerprint for verdict in column}) > 1:
                decisions.append(
                    f"request {index} of this call differs between the ranks of a model "
                    "replica; expected the same prompt and SamplingParams on every rank"
                )
            else:
                decisions.append(None)
        return decisions

    def broadcast_samples(self, samples: torch.Tensor | None, count: int) -> torch.Tensor:
        """Broadcast the sampled tokens and log-probabilities from the sampling rank.

        Args:
            samples: float64 ``[2, count]`` (token ids, log-probabilities or NaN) on the
                sampling rank, None elsewhere.
            count: Number of sampled requests (known on every rank from the schedule).

        Returns:
            The sampling rank's ``[2, count]`` tensor, on every rank.
        """
        if self.replica_group is None:
            assert samples is not None
            return samples
        if samples is None or dist.get_rank() != self.sampler_rank:
            samples = torch.empty((2, count), dtype=torch.float64, device=self.device)
        dist.broadcast(samples, src=self.sampler_rank, group=self.replica_group)
        return samples

    # ------------------------------------------------------------------------- data parallel

    def my_share(self, count: int) -> list[int]:
        """Indices of the requests this replica serves out of ``count`` (round robin).

        Args:
            count: Requests given to every replica.

        Returns:
            ``dp_rank, dp_rank + dp, ...``: the assignment depends only on the index.
        """
        return list(range(self.dp_rank, count, self.dp_size))

    def gather_over_data_parallel(self, mine: list[Any], count: int) -> list[Any]:
        """Put every replica's results back in input order, on every rank.

        Args:
            mine: This replica's results, in the order of :meth:`my_share`.
            count: Requests given to every replica.

        Returns:
            ``count`` results in input order.
        """
        if self.dp_group is None:
            return mine
        shares: list[Any] = [None] * self.dp_size
        dist.all_gather_object(shares, mine, group=self.dp_group)
        ordered: list[Any] = [None] * count
        for replica, share in enumerate(shares):
            for index, result in zip(range(replica, count, self.dp_size), share, strict=True):
                ordered[index] = result
        return ordered
