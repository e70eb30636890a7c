"""Tensor and sequence parallelism: TP=2 on gloo equals TP=1 (logits, gradients, HF weights).

One ``run_distributed`` call checks every behaviour, to spawn the process group once.
"""

from __future__ import annotations

import pytest
import torch

from mcore_models import (
    ContiguousKVCache,
    GPTConfig,
    GPTModel,
    ModelConfigError,
    ModelInputError,
    PackedSeqParams,
    parallelize,
)
from mcore_models.gather import gather_full_tensors
from mcore_parallel import initialize
from mcore_parallel.sharding import get_partition_dims
from mcore_parallel.tensor_parallel.layers import allreduce_sequence_parallel_grads
from mcore_parallel.testing import run_distributed

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))

CONFIGS = {
    "llama": GPTConfig.from_name("tiny", seed=11),
    "qwen2": GPTConfig.from_name("tiny", add_qkv_bias=True, tie_word_embeddings=True, seed=12),
    "qwen3": GPTConfig.from_name("tiny", qk_layernorm=True, seed=13),
}


def _sharded(config: GPTConfig, state) -> GPTModel:
    model = parallelize(GPTModel(config), state)
    assert isinstance(model, GPTModel)
    return model


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _gradient_errors(reference: GPTModel, sharded: GPTModel, rank: int) -> float:
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    worst = 0.0
    for name, param in sharded.named_parameters():
        expected = ref_grads[name]
        dims = get_partition_dims(param)
        if "tp" in dims:
            expected = expected.chunk(2, dim=dims["tp"])[rank]
        assert param.grad is not None, name
        worst = max(worst, _max_error(param.grad, expected))
    return worst


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten())


def _all_checks(checkpoint_dir: str, export_dir: str) -> dict[str, float]:
    state = initialize(tp=2)
    rank = state.tp_rank
    errors: dict[str, float] = {}
    for name, config in CONFIGS.items():
        for sequence_parallel in (False, True):
            cfg = config.replace(sequence_parallel=sequence_parallel)
            reference = GPTModel(cfg)
            sharded = _sharded(cfg, state)
            key = f"{name}/sp={sequence_parallel}"
            ref_logits, tp_logits = reference(IDS), sharded(IDS)
            errors[f"logits/{key}"] = _max_error(tp_logits, ref_logits)
            _loss(ref_logits).backward()
            _loss(tp_logits).backward()
            allreduce_sequence_parallel_grads(sharded, state)
            errors[f"grads/{key}"] = _gradient_errors(reference, sharded, rank)
        with torch.no_grad():
            sharded = _sharded(config, state).eval()
            reference = GPTModel(config).eval()
            expected = reference(IDS)
            shard = sharded(IDS, gather_logits=False)
            errors[f"vocab_shard/{name}"] = _max_error(shard, expected.chunk(2, dim=-1)[rank])
            fused = _sharded(config.replace(inference_fuse_tp_communication=True), state)
            errors[f"fused_comm/{name}"] = _max_error(fused(IDS), sharded(IDS))
            errors[f"fused_comm_vs_tp1/{name}"] = _max_error(fused(IDS), expected)
            lengths = [3, 5, 4]
            cu = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
            packed_ids = IDS.flatten()[:12][None]
            packed = sharded(packed_ids, packed_seq_params=PackedSeqParams(cu, max(lengths)))
            unpacked = torch.cat(
                [reference(packed_ids[:, cu[i] : cu[i + 1]]) for i in range(3)], dim=1
            )
            errors[f"packed/{name}"] = _max_error(packed, unpacked)
            cache = ContiguousKVCache(config, max_seq_len=8)
            steps = [sharded(IDS[:1, :5], torch.arange(5)[None], kv_cache=cache)]
            for t in range(5, 8):
                steps.append(sharded(IDS[:1, t : t + 1], torch.tensor([[t]]), kv_cache=cache))
            errors[f"kv_cache/{name}"] = _max_error(torch.cat(steps, dim=1), expected[:1])
            _, full = gather_full_tensors([sharded], state, every_rank=True)
            errors[f"full_state_dict/{name}"] = max(
                _max_error(full[k], v) for k, v in reference.state_dict().items()
            )
    hf = GPTModel.from_hf(checkpoint_dir, state=state)
    with torch.no_grad():
        hf_logits = hf(IDS)
    hf.to_hf(export_dir, state=state)
    custom_mlp = GPTModel(CONFIGS["llama"])
    custom_mlp.layers[1].mlp = torch.nn.Identity()
    messages = []
    for model in (hf, GPTModel(GPTConfig.from_name("tiny", num_query_groups=1)), custom_mlp):
        try:
            parallelize(model, state)
        except ModelConfigError as error:
            messages.append(str(error))
    # The rejected model is left whole: layer 0 (before the bad MLP) was not sharded.
    errors["rejected_model_untouched"] = float(
        type(custom_mlp.layers[0].self_attention.q_proj) is not torch.nn.Linear
        or custom_mlp.tp_group is not None
    )
    sequence_parallel = _sharded(CONFIGS["llama"].replace(sequence_parallel=True), state)
    try:
        sequence_parallel(IDS[:, :7])
    except ModelInputError as error:
        messages.append(str(error))
    return {"hf_logits": hf_logits, "messages": messages, **errors}


def test_tensor_parallel_matches_single_rank(tmp_path):
    torch.manual_seed(0)
    hf_config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        tie_word_embeddings=False,
    )
    hf_model = transformers.Qwen2ForCausalLM(hf_config).float().eval()
    hf_model.save_pretrained(tmp_path / "hf")
    results = run_distributed(_all_checks, 2, str(tmp_path / "hf"), str(tmp_path / "export"))
    with torch.no_grad():
        expected = hf_model(IDS).logits
    for rank, result in enumerate(results):
        torch.testing.assert_close(result.pop("hf_logits"), expected, atol=1e-4, rtol=0)
        already, indivisible, custom, sequence = result.pop("messages")
        assert "already parallelized" in already
        assert "num_query_groups=1 must be divisible" in indivisible
        assert "MLP of type Identity" in custom
        assert "sequence parallelism" in sequence and "(2, 7)" in sequence
        for key, error in result.items():
            tolerance = 1e-4 if key.startswith("grads") else 2e-5
            assert error < tolerance, (rank, key, error)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(IDS).logits, expected, atol=1e-5, rtol=0)
