"""Context parallelism of a GPT: cp=2 logits/gradients and cp=2 x dp=2 training equal one process.

Every rank feeds the model its load-balanced tokens of the (packed) row
(``mcore_parallel.context_parallel.split_sequence``) with their positions and the full row's
``packed_seq_params``; attention runs over the cp group (ring or all-gather-KV).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mcore_models import GPTConfig, GPTModel, PackedSeqParams, parallelize
from mcore_parallel import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    initialize,
)
from mcore_parallel.context_parallel import gather_sequence, position_ids, split_sequence
from mcore_parallel.distributed.config import OptimizerConfig
from mcore_parallel.testing import run_distributed

CONFIG = GPTConfig.from_name("tiny", num_layers=2, seed=31)
CU = torch.tensor([0, 8, 20, 24], dtype=torch.int32)  # every length a multiple of 2 * cp
T = 24


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [1, T] and next-token labels (-100 at the end of every packed sequence)."""
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(seed))
    labels = torch.roll(ids, -1, dims=1)
    labels[0, CU[1:] - 1] = -100
    return ids, labels


def _local(tensor: torch.Tensor, state) -> torch.Tensor:
    return split_sequence(tensor, state.cp_size, state.rank_in("cp"), cu_seqlens=CU)


def _forward(model: GPTModel, ids: torch.Tensor, state) -> torch.Tensor:
    positions = position_ids(T, state.cp_size, state.rank_in("cp"), cu_seqlens=CU)[None]
    return model(_local(ids, state), positions, packed_seq_params=PackedSeqParams(CU, 12))


def _cp_only() -> dict:
    state = initialize(cp=2)
    ids, labels = _batch(0)
    reference = GPTModel(CONFIG)
    expected = reference(ids, packed_seq_params=PackedSeqParams(CU, 12))
    F.cross_entropy(expected[0], labels[0], reduction="sum").backward()
    errors = {}
    for method in ("ring", "all_gather"):
        model = parallelize(GPTModel(CONFIG), state, context_parallel_method=method)
        assert isinstance(model, GPTModel)
        local = _forward(model, ids, state)
        full = gather_sequence(local, state.group("cp"), cu_seqlens=CU)
        errors[f"{method}/logits"] = (full - expected).abs().max().item()
        F.cross_entropy(local[0], _local(labels, state)[0], reduction="sum").backward()
        worst = 0.0
        for param, ref in zip(model.parameters(), reference.parameters()):
            grad = param.grad.clone()
            dist.all_reduce(grad, group=state.group("cp"))
            worst = max(worst, (grad - ref.grad).abs().max().item())
        errors[f"{method}/grads"] = worst
    return errors


def test_context_parallel_gpt_equals_one_process_for_ring_and_all_gather():
    for errors in run_distributed(_cp_only, 2):
        for key, error in errors.items():
            assert error < 2e-5, (key, error)


# Adam normalises every element, so a gradient near zero moves its weight by up to ~lr: a
# small lr keeps the summation-order differences of the dp x cp reduction below the tolerance.
OPTIM = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _loss(logits: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
    return F.cross_entropy(logits[0], labels[0], reduction="sum") * scale


def _cp2_dp2_training() -> dict:
    state = initialize(cp=2)
    model = parallelize(GPTModel(CONFIG), state)
    ddp = DistributedDataParallel(model, DDPConfig(use_distributed_optimizer=True), state)
    optimizer = DistributedOptimizer(ddp, OptimizerConfig(**OPTIM))
    for step in range(3):
        tokens = sum(int((_batch(2 * step + d)[1] != -100).sum()) for d in range(2))
        # Data-parallel rank d trains on batch 2 * step + d; the loss of the global batch is
        # the token mean over both, and DDP averages gradients over the dp x cp ranks.
        ids, labels = _batch(2 * step + state.rank_in("dp"))
        optimizer.zero_grad()
        local = _forward(ddp, ids, state)
        loss = _loss(local, _local(labels, state), state.size("dp_cp") / tokens)
        loss.backward()
        optimizer.step()
    ddp.finish_param_sync()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_cp2_dp2_training_equals_single_process_adamw():
    results = run_distributed(_cp2_dp2_training, 4)
    reference = GPTModel(CONFIG)
    optimizer = torch.optim.AdamW(reference.parameters(), **OPTIM)
    for step in range(3):
        optimizer.zero_grad()
        batches = [_batch(2 * step + d) for d in range(2)]
        tokens = sum(int((labels != -100).sum()) for _, labels in batches)
        loss = sum(
            _loss(reference(ids, packed_seq_params=PackedSeqParams(CU, 12)), labels, 1 / tokens)
            for ids, labels in batches
        )
        loss.backward()
        optimizer.step()
    expected = dict(reference.named_parameters())
    for result in results:
        for name, tensor in result.items():
            torch.testing.assert_close(tensor, expected[name].detach(), atol=1e-5, rtol=0)
