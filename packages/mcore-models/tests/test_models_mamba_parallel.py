"""Hybrid Mamba models under tensor and pipeline parallelism (gloo ranks) equal one process.

tp=2: logits and the gradient of every parameter slice equal the unsharded model's, on packed
sequences. pp=2 through ``build_pipeline_stages``: the two stages chained equal the whole model.
Both layouts run in one spawn of two gloo ranks.
"""

from __future__ import annotations

import torch

from mcore_models import PackedSeqParams, build_pipeline_stages, parallelize
from mcore_models.mamba import HybridModel, hybrid_preset
from mcore_models.mamba.parallelize import mamba_shard_rows
from mcore_parallel import initialize
from mcore_parallel.testing import run_distributed

CONFIG = hybrid_preset("tiny-hybrid", layer_pattern="M*M-", seed=11)
LENGTHS = [7, 20, 3]


def _inputs():
    ids = torch.randint(
        0, CONFIG.vocab_size, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(0)
    )
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    probe = torch.randn(
        1, sum(LENGTHS), CONFIG.vocab_size, generator=torch.Generator().manual_seed(1)
    )
    return ids, PackedSeqParams(cu_seqlens=cu, max_seqlen=max(LENGTHS)), probe


def _local_rows(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """The slice of a whole parameter that rank ``rank`` holds."""
    rows = mamba_shard_rows(
        CONFIG.mamba_num_heads,
        CONFIG.mamba_head_dim,
        CONFIG.mamba_num_groups,
        CONFIG.ssm_state_size,
        tp,
        rank,
    )
    leaf = name.rsplit(".", 2)
    if ".mixer." in name and name.split(".")[1] in ("0", "2"):  # Mamba layers
        key = {
            "in_proj": "in_proj",
            "conv_weight": "conv",
            "conv_bias": "conv",
            "dt_bias": "heads",
            "A_log": "heads",
            "D": "heads",
            "norm": "inner",
            "out_proj": "inner",
        }
        part = leaf[-2] if leaf[-1] == "weight" and leaf[-2] in key else leaf[-1]
        index = rows[key[part]]
        return full.index_select(1 if part == "out_proj" else 0, index)
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "up_proj.weight")):
        return full.chunk(tp, 0)[rank]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(tp, 1)[rank]
    return full


def _tensor_parallel() -> bool:
    state = initialize(tp=2)
    rank = state.tp_rank
    ids, packed, probe = _inputs()
    whole = HybridModel(CONFIG)
    logits = whole(ids, packed_seq_params=packed)
    (logits * probe).sum().backward()
    full_grads = {n: p.grad for n, p in whole.named_parameters()}
    model = parallelize(HybridModel(CONFIG), state)
    sharded = model(ids, packed_seq_params=packed)
    torch.testing.assert_close(sharded, logits, atol=1e-5, rtol=1e-5)
    (sharded * probe).sum().backward()
    for name, param in model.named_parameters():
        expected = _local_rows(name, full_grads[name], rank, 2)
        scale = max(1.0, float(expected.abs().max()))
        torch.testing.assert_close(param.grad, expected, atol=2e-6 * scale, rtol=1e-4, msg=name)
    return True


def _pipeline() -> list[float]:
    state = initialize(pp=2)
    rank = state.pp_rank
    ids, packed, _ = _inputs()
    (stage,) = build_pipeline_stages(CONFIG, state, device="cpu")
    assert stage.pre_process == (rank == 0) and stage.post_process == (rank == 1)
    with torch.no_grad():
        if rank == 0:
            hidden = stage(ids, packed_seq_params=packed)
            torch.distributed.send(hidden.contiguous(), 1)
            return []
        hidden = torch.empty(1, sum(LENGTHS), CONFIG.hidden_size)
        torch.distributed.recv(hidden, 0)
        return stage(hidden, packed_seq_params=packed).flatten().tolist()


def _both_layouts() -> tuple[bool, list[float]]:
    # One spawn of two ranks for both layouts: initialize() builds new groups each call.
    return _tensor_parallel(), _pipeline()


def test_tensor_parallel_and_pipeline_stages_equal_one_process():
    ids, packed, _ = _inputs()
    with torch.no_grad():
        expected = HybridModel(CONFIG)(ids, packed_seq_params=packed)
    results = run_distributed(_both_layouts, 2)
    assert [tp_ok for tp_ok, _ in results] == [True, True]
    chained = torch.tensor(results[1][1]).view_as(expected)
    torch.testing.assert_close(chained, expected, atol=1e-5, rtol=1e-5)
