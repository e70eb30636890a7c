"""GRPO in batch-invariant mode: rollout and training log-probs are bitwise equal."""

import pytest
import torch

from mcore_rl.config import GRPOConfig
from mcore_rl.errors import RLConfigError
from mcore_rl.run import run_grpo


def _config(tmp_path, *, invariant, device="cpu", **sections):
    config = {
        "model": {"hidden_size": 32, "num_layers": 2, "batch_invariant": invariant},
        "rollout": {"num_prompts": 4, "group_size": 3, "max_new_tokens": 4},
        "run": {
            "progress": False,
            "device": device,
            "target_reward": None,
            "num_steps": 2,
            "plot": False,
            "run_dir": str(tmp_path),
        },
        "loss": {"kl_beta": 0.0},
    }
    for name, values in sections.items():
        config[name].update(values)
    return GRPOConfig.from_dict(config)


MOE = {"moe": {"num_experts": 4, "top_k": 2, "aux_loss_coeff": 0.01}}


@pytest.mark.parametrize("model", [{}, MOE], ids=["dense", "moe"])
def test_token_prob_error_is_exactly_zero_in_batch_invariant_mode(tmp_path, model):
    records = run_grpo(_config(tmp_path / "on", invariant=True, model=model)).records
    assert [float(r["token_prob_error"]) for r in records] == [0.0, 0.0]


def test_batch_invariant_rejects_a_non_bool():
    with pytest.raises(RLConfigError, match="batch_invariant"):
        _config("unused", invariant="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("moe", [{}, MOE], ids=["dense", "moe"])
def test_gpu_bf16_token_prob_error_is_zero_with_cuda_graphs(tmp_path, moe):
    config = _config(
        tmp_path,
        invariant=True,
        device="cuda",
        model={"hidden_size": 256, "num_layers": 4, "dtype": "bfloat16", **moe},
        rollout={"use_cuda_graphs": True, "num_prompts": 16, "group_size": 8},
    )
    records = run_grpo(config).records
    assert [float(r["token_prob_error"]) for r in records] == [0.0, 0.0]
