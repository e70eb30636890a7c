"""sharded_state_dict: blocks of tp=2 x dp=2 and ep=2 layouts reassemble the single-rank model."""

import pytest
import torch
from torch import nn

from mcore_parallel.checkpointing import sharded_state_dict
from mcore_parallel.errors import ParallelConfigError, ParallelTypeError
from mcore_parallel.sharding import ShardedTensor, set_partition_dim
from mcore_parallel.state import initialize
from mcore_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from mcore_parallel.testing import run_distributed


def _model(state) -> nn.Module:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "embedding": VocabParallelEmbedding(8, 4, state=state, seed=1),
            "fc1": ColumnParallelLinear(4, 6, state=state, gather_output=False, seed=2),
            "fc2": RowParallelLinear(6, 4, state=state, input_is_parallel=True, seed=3),
            "norm": nn.LayerNorm(4),
        }
    )
    with torch.no_grad():
        model["norm"].weight.uniform_()
    return model


def _experts(state) -> nn.Module:
    module = nn.Module()
    # Expert e holds the row [e, e, e]; each ep rank holds one expert.
    module.experts = nn.Parameter(torch.full((1, 3), float(state.ep_rank)))
    set_partition_dim(module.experts, 0, axis="ep")
    return module


def _worker() -> dict:
    tp_state = initialize(tp=2)
    dense = sharded_state_dict(_model(tp_state), tp_state, prefix="model.")
    ep_state = initialize(ep=2)
    experts = sharded_state_dict(_experts(ep_state), ep_state)
    return {"dense": dense, "experts": experts}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 4)


def _assemble(blocks: list[ShardedTensor]) -> torch.Tensor:
    """Writes the replica-0 blocks into the global tensor, checking exact coverage."""
    shape = blocks[0].global_shape
    full = torch.zeros(shape)
    covered = torch.zeros(shape, dtype=torch.int64)
    for block in blocks:
        assert block.global_shape == shape
        index = tuple(slice(o, o + n) for o, n in zip(block.global_offset, block.local.shape))
        if block.replica_id == 0:
            full[index] = block.local
            covered[index] += 1
    assert torch.all(covered == 1), "replica-0 blocks must cover every element exactly once"
    for block in blocks:
        index = tuple(slice(o, o + n) for o, n in zip(block.global_offset, block.local.shape))
        assert torch.equal(full[index], block.local), "replicas must hold identical blocks"
    return full


def test_tp_blocks_reassemble_the_single_rank_state_dict(ranks):
    reference = sharded_state_dict(_model(None), None, prefix="model.")
    assert set(ranks[0]["dense"]) == set(reference)
    for key, expected in reference.items():
        assert expected.is_full and expected.replica_id == 0
        full = _assemble([r["dense"][key] for r in ranks])
        assert torch.equal(full, expected.local), key


def test_tp_partitioned_weights_carry_their_offsets(ranks):
    offsets = sorted(r["dense"]["model.fc2.weight"].global_offset for r in ranks)
    assert offsets == [(0, 0), (0, 0), (0, 3), (0, 3)]
    embedding = sorted(r["dense"]["model.embedding.weight"].global_offset for r in ranks)
    assert embedding == [(0, 0), (0, 0), (4, 0), (4, 0)]


def test_replicated_tensors_have_one_owner(ranks):
    for key in ("model.norm.weight", "model.fc2.bias"):
        replica_ids = sorted(r["dense"][key].replica_id for r in ranks)
        assert replica_ids == [0, 1, 2, 3], key


def test_expert_blocks_are_placed_by_ep_rank(ranks):
    full = _assemble([r["experts"]["experts"] for r in ranks])
    assert torch.equal(full, torch.tensor([[0.0] * 3, [1.0] * 3]))


def test_non_module_raises():
    with pytest.raises(ParallelTypeError, match="module"):
        sharded_state_dict({"weight": torch.zeros(1)}, None)


@pytest.mark.parametrize(
    ("dim", "axis", "match"), [(0, "dp", "axis='dp'"), (2, "tp", "dim=2"), (-3, "ep", "dim=-3")]
)
def test_set_partition_dim_rejects_bad_axis_or_dim(dim, axis, match):
    with pytest.raises(ParallelConfigError, match=match):
        set_partition_dim(torch.zeros(2, 2), dim, axis=axis)


def test_one_dimension_cannot_be_partitioned_over_two_axes():
    tensor = torch.zeros(2, 2)
    set_partition_dim(tensor, 0, axis="ep")
    with pytest.raises(ParallelConfigError, match="already partitioned"):
        set_partition_dim(tensor, 0, axis="tp")
