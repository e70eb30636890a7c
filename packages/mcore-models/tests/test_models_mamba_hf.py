"""Hybrid Mamba models against Hugging Face transformers (its torch path is the oracle).

Random tiny ``mamba2`` and ``nemotron_h`` checkpoints are written by transformers, loaded by
mcore, and the logits and parameter gradients compared; export writes files transformers loads
to the same logits; packed sequences equal separate ones.
"""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mcore_models import PackedSeqParams  # noqa: E402
from mcore_models.errors import CheckpointFormatError  # noqa: E402
from mcore_models.mamba import HybridModel  # noqa: E402
from mcore_models.mamba.hf import hf_config_to_hybrid  # noqa: E402
from mcore_models.testing import TINY_MAMBA2, TINY_NEMOTRON_H  # noqa: E402


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith(("A_log", "dt_bias")):
                param.copy_(noise * 0.5 + (0.5 if name.endswith("A_log") else -2.0))
            elif name.endswith(("norm.weight", "norm_f.weight", ".D")):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(noise * 0.3)


def _checkpoint(kind: str, tmp_path_factory) -> tuple[torch.nn.Module, str]:
    if kind == "mamba2":
        hf = transformers.Mamba2ForCausalLM(
            transformers.Mamba2Config(num_hidden_layers=3, **TINY_MAMBA2)
        )
    else:
        hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**TINY_NEMOTRON_H))
    _randomize(hf, seed=1 if kind == "mamba2" else 2)
    hf.eval()
    path = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(path)
    return hf, str(path)


@pytest.fixture(scope="module", params=["mamba2", "nemotron_h"])
def pair(request, tmp_path_factory):
    hf, path = _checkpoint(request.param, tmp_path_factory)
    return request.param, hf, HybridModel.from_hf(path), path


def test_logits_and_gradients_match_transformers(pair):
    kind, hf, model, _ = pair
    ids = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(0))
    probe = torch.randn(2, 37, 64, generator=torch.Generator().manual_seed(1))
    hf.zero_grad()
    model.zero_grad()
    hf_logits = hf(ids).logits
    logits = model(ids)
    torch.testing.assert_close(logits, hf_logits, atol=2e-4, rtol=1e-4)
    (hf_logits * probe).sum().backward()
    (logits * probe).sum().backward()
    prefix = "backbone" if kind == "mamba2" else "model"
    hf_params = dict(hf.named_parameters())
    checked = 0
    for name, param in model.named_parameters():
        hf_name = f"{prefix}.{name}".replace("conv_weight", "conv1d.weight").replace(
            "conv_bias", "conv1d.bias"
        )
        hf_name = {
            f"{prefix}.embedding.weight": f"{prefix}.embeddings.weight",
            f"{prefix}.final_norm.weight": f"{prefix}.norm_f.weight",
            f"{prefix}.output_layer.weight": "lm_head.weight",
        }.get(hf_name, hf_name)
        expected = hf_params[hf_name].grad.reshape(param.shape)
        scale = expected.abs().max().item() + 1e-6
        torch.testing.assert_close(
            param.grad / scale, expected / scale, atol=2e-4, rtol=0, msg=f"grad of {name}"
        )
        checked += 1
    assert checked == len(hf_params)


def test_packed_sequences_equal_separate_sequences(pair):
    _, _, model, _ = pair
    lengths = [5, 19, 1, 12]
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        packed = model(
            ids, packed_seq_params=PackedSeqParams(cu_seqlens=cu, max_seqlen=max(lengths))
        )
        for i in range(len(lengths)):
            alone = model(ids[:, cu[i] : cu[i + 1]])
            torch.testing.assert_close(packed[:, cu[i] : cu[i + 1]], alone, atol=1e-5, rtol=1e-5)


def test_export_loads_in_transformers_with_the_same_logits(pair, tmp_path):
    kind, hf, model, _ = pair
    model.to_hf(tmp_path)
    cls = transformers.Mamba2ForCausalLM if kind == "mamba2" else transformers.NemotronHForCausalLM
    reloaded = cls.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 64, (1, 21), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_nemotron_h_moe_pattern_is_refused():
    config = transformers.NemotronHConfig(**{**TINY_NEMOTRON_H, "hybrid_override_pattern": "ME"})
    with pytest.raises(CheckpointFormatError, match="MoE layers"):
        hf_config_to_hybrid(config.to_dict())


def test_nemotron_h_time_step_floor_becomes_the_clamp():
    config = hf_config_to_hybrid(transformers.NemotronHConfig(**TINY_NEMOTRON_H).to_dict())
    assert config.time_step_limit == (1e-6, math.inf)
    assert config.layer_pattern == "M*M-M"
