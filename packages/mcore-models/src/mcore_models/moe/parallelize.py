"""Shard a MoE layer over expert, expert tensor and tensor parallelism (in place).

:func:`parallelize_moe` is what ``mcore_models.parallelize`` calls for every MoE layer:

- routed experts: split over the expert-parallel (EP) group along the expert dimension
  (axis ``"ep"``, experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)``), and every expert's
  FFN over the expert tensor-parallel (ETP) group (axis ``"etp"``): gate/up by output
  features, down by input features, the down projection's partial sums combined over the
  ETP group by the dispatch (:mod:`mcore_models.moe.comm`);
- router and its expert bias: replicated;
- shared expert: split over the dense tensor-parallel group like a dense SwiGLU MLP
  (column-parallel gate/up, row-parallel down).

Every split is even and contiguous and recorded with ``set_partition_dim``, so a parameter's
global shape is its local shape times the group size along each partitioned dimension and
its global offset is the rank times the local size. A layer on the meta device gets meta
parameters of the local shapes (no data); a materialised layer keeps copies of this rank's
slices of its whole weights.

Under sequence parallelism the router and the shared-expert gate see only this rank's chunk
of the sequence: their weights are marked ``param.sequence_parallel = True`` (gradients summed
over the TP group by ``allreduce_sequence_parallel_grads``), and the auxiliary losses are
normalised over the TP group's tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mcore_models.errors import ModelConfigError
from mcore_models.gpt.mlp import SwiGLUMLP
from mcore_models.moe.comm import ExpertComm
from mcore_models.moe.layer import MoELayer
from mcore_parallel import ColumnParallelLinear, RowParallelLinear
from mcore_parallel.sharding import set_partition_dim

if TYPE_CHECKING:
    from mcore_parallel.state import ParallelState

__all__ = ["parallelize_moe"]

_SEQUENCE_DIM = 1


def _check_divisible(name: str, value: int, group: str, size: int) -> None:
    if value % size:
        raise ModelConfigError(f"{name}={value} must be divisible by the {group} size {size}")


def _shard(whole: nn.Parameter, cuts: list[tuple[int, int, int, str]]) -> nn.Parameter:
    """This rank's block of ``whole``: ``(dim, size, rank, axis)`` for every split dimension."""
    shape = list(whole.shape)
    for dim, size, _, _ in cuts:
        shape[dim] //= size
    if whole.is_meta:
        local = torch.empty(shape, dtype=whole.dtype, device="meta")
    else:
        block = whole.detach()
        for dim, _, rank, _ in cuts:
            block = block.narrow(dim, rank * shape[dim], shape[dim])
        local = block.clone()
    param = nn.Parameter(local, requires_grad=whole.requires_grad)
    for dim, size, _, axis in cuts:
        if size > 1:
            set_partition_dim(param, dim, axis=axis)
    return param


def _copy_of(weight: torch.Tensor):
    def init(master: torch.Tensor) -> torch.Tensor:
        if weight.is_meta:
            return master
        return master.copy_(weight.detach().to(master.dtype))

    return init


def _parallel_linear(
    kind: type[ColumnParallelLinear] | type[RowParallelLinear],
    linear: nn.Linear,
    state: ParallelState,
    sequence_parallel: bool,
) -> nn.Module:
    common = dict(
        bias=False,
        state=state,
        sequence_parallel=sequence_parallel,
        sequence_dim=_SEQUENCE_DIM,
        init_method=_copy_of(linear.weight),
        dtype=linear.weight.dtype,
        device=linear.weight.device,
    )
    # On the meta device the full-size master weight is never allocated either.
    with torch.device("meta" if linear.weight.is_meta else "cpu"):
        if kind is ColumnParallelLinear:
            return ColumnParallelLinear(
                linear.in_features, linear.out_features, gather_output=False, **common
            )
        return RowParallelLinear(
            linear.in_features, linear.out_features, input_is_parallel=True, **common
        )


def _mark_partial_gradient(param: torch.Tensor) -> None:
    # mcore_parallel's allreduce_sequence_parallel_grads sums gradients marked like this.
    param.sequence_parallel = True  # type: ignore[attr-defined]


def _etp_mode(state: ParallelState, sequence_parallel: bool) -> str:
    """ "allreduce" when the ETP ranks hold identical tokens, else "gather".

    Ranks are laid out with the TP ranks contiguous and the ETP ranks contiguous, so an ETP
    size dividing the TP size puts every ETP group inside one TP group; without sequence
    parallelism the TP ranks hold the same tokens.
    """
    if not sequence_parallel and state.tp_size % state.etp_size == 0:
        return "allreduce"
    return "gather"


def parallelize_moe(layer: MoELayer, state: ParallelState, *, sequence_parallel: bool) -> None:
    """Shard a whole MoE layer over the expert, expert tensor and tensor parallel groups.

    Args:
        layer: A whole (unsharded) MoE layer, on the meta device or materialised.
        state: Parallel state (``ep_size``, ``etp_size``, ``tp_size`` and their groups).
        sequence_parallel: Whether the layer will receive this rank's sequence chunk
            ``[B, T / tp, H]`` (and return the same chunk) instead of the full, TP-replicated
            hidden states.

    Raises:
        ModelConfigError: If the layer is already parallelized, or the expert count, the
            expert FFN width or the shared expert width is not divisible by the EP, ETP or TP
            size.
    """
    if layer.comm is not None:
        raise ModelConfigError(f"MoE layer {layer.layer_idx} is already parallelized")
    moe = layer.moe_config
    ep, etp, tp = state.ep_size, state.etp_size, state.tp_size
    experts = layer.experts
    _check_divisible("MoEConfig.num_experts", moe.num_experts, "expert-parallel", ep)
    _check_divisible(
        "expert FFN width (MoEConfig.expert_ffn_hidden_size)",
        experts.ffn_hidden_size,
        "expert tensor-parallel",
        etp,
    )
    if layer.shared_expert is not None:
        _check_divisible(
            "MoEConfig.shared_expert_ffn_hidden_size",
            moe.shared_expert_ffn_hidden_size,
            "tensor-parallel",
            tp,
        )
    sequence_parallel = sequence_parallel and tp > 1
    ep_cut = (0, ep, state.ep_rank, "ep")
    experts.gate_up_proj = _shard(experts.gate_up_proj, [ep_cut, (2, etp, state.etp_rank, "etp")])
    experts.down_proj = _shard(experts.down_proj, [ep_cut, (2, etp, state.etp_rank, "etp")])
    experts.num_experts = moe.num_experts // ep
    shared = layer.shared_expert
    if shared is not None and tp > 1:
        assert isinstance(shared, SwiGLUMLP)
        for name, kind in (
            ("gate_proj", ColumnParallelLinear),
            ("up_proj", ColumnParallelLinear),
            ("down_proj", RowParallelLinear),
        ):
            setattr(
                shared,
                name,
                _parallel_linear(kind, getattr(shared, name), state, sequence_parallel),
            )
    if sequence_parallel:
        _mark_partial_gradient(layer.router.weight)
        if layer.shared_expert_gate is not None:
            _mark_partial_gradient(layer.shared_expert_gate.weight)
        layer.router.token_group = state.tp_group
    layer.sequence_parallel = sequence_parallel
    layer.comm = ExpertComm(
        ep_group=state.ep_group if ep > 1 else None,
        etp_group=state.etp_group if etp > 1 else None,
        etp_mode=_etp_mode(state, sequence_parallel),
    )
