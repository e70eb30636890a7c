"""``InferenceEngine.update_weights``: in-place copies from full tensors and from blocks in another
layout, and typed errors that leave every weight as it was."""

from __future__ import annotations

import pytest
import torch

from mcore_inference import (
    InferenceConfig,
    InferenceEngine,
    SamplingParams,
    WeightUpdateError,
    model_weight_shards,
)
from mcore_models import GPTConfig, GPTModel
from mcore_parallel.sharding import ShardedTensor

PROMPTS = [[3, 9, 4, 7, 1], [12, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, return_logprobs=True)


def _engine(model: GPTModel) -> InferenceEngine:
    config = InferenceConfig(max_batch_size=4, max_sequence_length=32, block_size=4)
    return InferenceEngine(model, config)


def _generate(engine: InferenceEngine) -> list:
    return [(r.tokens, r.logprobs) for r in engine.generate(PROMPTS, GREEDY)]


def _config(seed: int) -> GPTConfig:
    return GPTConfig.from_name("tiny", vocab_size=64, seed=seed)


def _row_blocks(tensor: torch.Tensor, parts: int) -> list[ShardedTensor]:
    """Blocks of a tensor split along its first dimension (another layout's view)."""
    blocks, offset = [], 0
    for chunk in tensor.chunk(parts, dim=0):
        blocks.append(
            ShardedTensor(chunk.clone(), tuple(tensor.shape), (offset,) + (0,) * (tensor.dim() - 1))
        )
        offset += chunk.shape[0]
    return blocks


def test_update_from_blocks_keeps_storages_and_matches_an_engine_built_from_the_weights():
    target = GPTModel(_config(99)).eval()
    with _engine(target) as engine:
        expected = _generate(engine)
    model = GPTModel(_config(11)).eval()
    storages = [p.data_ptr() for p in model.parameters()]
    weights = {
        name: _row_blocks(shard.local, 3) if shard.local.dim() > 1 else shard.local
        for name, shard in model_weight_shards(target).items()
    }
    with _engine(model) as engine:
        before = _generate(engine)
        assert engine.update_weights(weights) == len(storages)
        assert _generate(engine) == expected != before
    assert [p.data_ptr() for p in model.parameters()] == storages


def _bad_weights(case: str, good: dict[str, torch.Tensor]) -> dict:
    weights = dict(good)
    name = "layers.1.mlp.up_proj.weight"
    if case == "missing":
        del weights[name]
    elif case == "unknown":
        weights["layers.7.mlp.up_proj.weight"] = weights[name]
    elif case == "shape":
        weights[name] = weights[name][:-1]
    elif case == "dtype":
        weights[name] = weights[name].double()
    elif case == "partial":
        weights[name] = _row_blocks(weights[name], 2)[:1]
    elif case == "overlap":
        blocks = _row_blocks(weights[name], 2)
        shifted = ShardedTensor(blocks[1].local, blocks[1].global_shape, (1, 0))
        weights[name] = [blocks[0], shifted]
    elif case == "type":
        weights[name] = weights[name].tolist()
    return weights


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "lack 1 parameters"),
        ("unknown", "layers.7.mlp.up_proj.weight"),
        ("shape", "global shape"),
        ("dtype", "torch.float64"),
        ("partial", "covers"),
        ("overlap", "overlapping"),
        ("type", "expected a torch.Tensor"),
    ],
)
def test_bad_weights_raise_a_typed_error_and_change_nothing(case, message):
    model = GPTModel(_config(11)).eval()
    good = {name: p.detach().clone() + 1.0 for name, p in GPTModel(_config(99)).named_parameters()}
    # The first parameters in the plan are valid: a failure later must not leave them copied.
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with _engine(model) as engine, pytest.raises(WeightUpdateError, match=message):
        engine.update_weights(_bad_weights(case, good))
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), (case, name)
