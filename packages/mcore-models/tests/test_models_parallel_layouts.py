"""parallelize at tp x pp layouts: logits, losses and gradients equal one process; same weights.

Each layout runs real pipeline schedules of mcore-parallel (1F1B, interleaved) over gloo ranks
on packed sequences, against the unsharded model in one process. Weights come from the
layout-independent initialisation (built on the meta device, only local shards materialised)
or from a Hugging Face checkpoint read by slices.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from mcore_models import (
    GPTConfig,
    GPTModel,
    ModelConfigError,
    PackedSeqParams,
    build_pipeline_stages,
    parallelize,
)
from mcore_models.gather import gather_full_tensors
from mcore_models.hf_io import SafetensorsReader
from mcore_models.init import global_slice
from mcore_parallel import initialize
from mcore_parallel.pipeline.schedules import forward_backward
from mcore_parallel.pipeline.tied import allreduce_tied_embedding_grads
from mcore_parallel.tensor_parallel.layers import allreduce_sequence_parallel_grads
from mcore_parallel.testing import run_distributed

transformers = pytest.importorskip("transformers")

SEQ = 12
CONFIG = GPTConfig.from_name("tiny", num_layers=4, seed=21)
TIED = GPTConfig.from_name(
    "tiny", num_layers=4, add_qkv_bias=True, tie_word_embeddings=True, seed=22
)
CU = torch.tensor([0, 5, 9, 12], dtype=torch.int32)


def _microbatches(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    return [
        {
            "ids": torch.randint(0, 256, (1, SEQ), generator=generator),
            "packed": PackedSeqParams(CU, 5),
        }
        for _ in range(count)
    ]


def _forward_step(model, input_tensor, microbatch):
    source = microbatch["ids"] if input_tensor is None else input_tensor
    return model(source, packed_seq_params=microbatch["packed"])


def _loss(logits: torch.Tensor, microbatch: dict) -> torch.Tensor:
    ids = microbatch["ids"]
    return F.cross_entropy(logits[0, :-1], ids[0, 1:])


def _reference(config: GPTConfig, microbatches: list[dict]) -> dict:
    model = GPTModel(config)
    losses, logits = [], []
    for microbatch in microbatches:
        output = _forward_step(model, None, microbatch)
        loss = _loss(output, microbatch)
        (loss / len(microbatches)).backward()
        losses.append(loss.detach())
        logits.append(output.detach())
    grads = {name: param.grad for name, param in model.named_parameters()}
    return {"losses": torch.stack(losses), "logits": logits, "grads": grads, "model": model}


def _gradient_error(chunks: list[GPTModel], grads: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for chunk in chunks:
        for param in chunk.parameters():
            where = global_slice(param)
            assert where is not None and param.grad is not None
            expected = grads[where.name][where.box(tuple(param.shape))]
            worst = max(worst, (param.grad - expected).abs().max().item())
    return worst


def _run_layout(state, config: GPTConfig, chunks: list[GPTModel], sequence_parallel: bool):
    """Train-step and forward-only errors of this rank's chunks against one process."""
    microbatches = _microbatches(4)
    reference = _reference(config, microbatches)
    model = chunks if len(chunks) > 1 else chunks[0]
    hidden = (1, SEQ // (state.tp_size if sequence_parallel else 1), config.hidden_size)
    result = forward_backward(
        model,
        microbatches,
        state=state,
        loss_func=_loss,
        forward_step=_forward_step,
        tensor_shape=hidden if len(chunks) > 1 else None,
    )
    for chunk in chunks:
        allreduce_tied_embedding_grads(chunk.shared_embedding_parameters(), state)
        allreduce_sequence_parallel_grads(chunk, state)
    errors = {"grads": _gradient_error(chunks, reference["grads"])}
    if result.losses:
        errors["loss"] = (torch.stack(result.losses) - reference["losses"]).abs().max().item()

    # Forward-only (loss_func=None): the last stage returns the label log-probs.
    def logprob_step(model, input_tensor, microbatch):
        source = microbatch["ids"] if input_tensor is None else input_tensor
        labels = torch.roll(microbatch["ids"], -1, dims=1)
        return model(source, packed_seq_params=microbatch["packed"], labels=labels)

    forward = forward_backward(
        model,
        microbatches,
        state=state,
        forward_step=logprob_step,
        forward_only=True,
        tensor_shape=hidden if len(chunks) > 1 else None,
    )
    if forward.outputs:
        worst = 0.0
        for output, logits, microbatch in zip(forward.outputs, reference["logits"], microbatches):
            labels = torch.roll(microbatch["ids"], -1, dims=1)
            expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
            worst = max(worst, (output - expected).abs().max().item())
        errors["logprobs"] = worst
    return errors


def _weights_error(state, chunks: list[GPTModel], config: GPTConfig) -> float:
    _, full = gather_full_tensors(chunks, state, every_rank=True)
    reference = GPTModel(config).state_dict()
    return max((full[name] - reference[name]).abs().max().item() for name in full)


def _two_rank_layouts() -> dict:
    results: dict = {}
    state = initialize(pp=2)
    for name, config in (("untied", CONFIG), ("tied", TIED)):
        chunks = build_pipeline_stages(config, state)
        results[f"pp2/{name}/weights"] = _weights_error(state, chunks, config)
        results[f"pp2/{name}"] = _run_layout(state, config, chunks, False)
    chunks = build_pipeline_stages(CONFIG, state, virtual_stages=2)
    results["pp2x2/weights"] = _weights_error(state, chunks, CONFIG)
    results["pp2x2"] = _run_layout(state, CONFIG, chunks, False)
    uneven = build_pipeline_stages(CONFIG, state, layout=(1, 3))
    results["uneven_layers"] = [layer.layer_idx for layer in uneven[0].layers]
    results["uneven"] = _run_layout(state, CONFIG, uneven, False)
    messages = []
    for kwargs in (
        dict(config=CONFIG.replace(num_layers=3)),
        dict(config=CONFIG, layout=(2, 1)),
        dict(config=CONFIG, virtual_stages=0),
    ):
        try:
            build_pipeline_stages(kwargs.pop("config"), state, **kwargs)
        except ModelConfigError as error:
            messages.append(str(error))
    results["messages"] = messages
    state.destroy()
    tp_state = initialize(tp=2)
    for config in (
        CONFIG.replace(num_attention_heads=3, num_query_groups=3, head_dim=16),
        CONFIG.replace(num_query_groups=1),
        CONFIG.replace(vocab_size=255),
    ):
        try:
            parallelize(GPTModel(config, device="meta"), tp_state)
        except ModelConfigError as error:
            messages.append(str(error))
    return results


def test_pipeline_layouts_equal_one_process_and_bad_layouts_raise():
    results = run_distributed(_two_rank_layouts, 2)
    for rank, result in enumerate(results):
        messages = result.pop("messages")
        assert "num_layers=3" in messages[0] and "pp * virtual_stages = 2" in messages[0]
        assert "layers_per_stage=(2, 1)" in messages[1] and "num_layers=4" in messages[1]
        assert "virtual_stages=0" in messages[2]
        assert "num_attention_heads=3" in messages[3]
        assert "num_query_groups=1" in messages[4]
        assert "vocab_size=255" in messages[5]
        assert result.pop("uneven_layers") == ([0] if rank == 0 else [1, 2, 3])
        for key, value in result.items():
            if key.endswith("weights"):
                assert value == 0.0, (rank, key)
                continue
            for metric, error in value.items():
                assert error < 2e-5, (rank, key, metric, error)
            if rank == 1:
                assert {"loss", "logprobs"} <= set(value), (key, value)


def _spy_reads(monkeypatch_target: type) -> list[tuple[str, int, int]]:
    reads: list[tuple[str, int, int]] = []
    original = monkeypatch_target.read

    def read(self, name, index=None):
        tensor = original(self, name, index)
        full = 1
        for size in self.shape(name):
            full *= size
        reads.append((name, tensor.numel(), full))
        return tensor

    monkeypatch_target.read = read  # type: ignore[method-assign]
    return reads


def _four_rank_layout(checkpoint: str, export: str) -> dict:
    state = initialize(tp=2, pp=2)
    results: dict = {"tp_rank": state.tp_rank, "pp_rank": state.pp_rank}
    for sequence_parallel in (False, True):
        chunks = build_pipeline_stages(CONFIG, state, sequence_parallel=sequence_parallel)
        results[f"weights/sp={sequence_parallel}"] = _weights_error(state, chunks, CONFIG)
        results[f"tp2pp2/sp={sequence_parallel}"] = _run_layout(
            state, CONFIG, chunks, sequence_parallel
        )
    reads = _spy_reads(SafetensorsReader)
    stage = GPTModel.from_hf(checkpoint, state=state)
    results["reads"] = reads
    _, loaded = gather_full_tensors([stage], state, every_rank=True)
    results["loaded"] = loaded
    stage.to_hf(export, state=state)
    return results


def test_tp2_pp2_trains_like_one_process_and_loads_hf_by_slices(tmp_path):
    torch.manual_seed(0)
    hf_config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        tie_word_embeddings=False,
    )
    hf_model = transformers.Qwen2ForCausalLM(hf_config).float().eval()
    hf_model.save_pretrained(tmp_path / "hf")
    results = run_distributed(_four_rank_layout, 4, str(tmp_path / "hf"), str(tmp_path / "export"))
    whole = GPTModel.from_hf(tmp_path / "hf").state_dict()
    for result in results:
        tp_rank, pp_rank = result.pop("tp_rank"), result.pop("pp_rank")
        layers = {0, 1} if pp_rank == 0 else {2, 3}
        for name, numel, full in result.pop("reads"):
            match = re.search(r"layers\.(\d+)\.", name)
            if match:
                assert int(match.group(1)) in layers, (pp_rank, name)
            if "norm" not in name:
                assert numel < full, (tp_rank, pp_rank, name, numel, full)
        loaded = result.pop("loaded")
        for name, tensor in loaded.items():
            torch.testing.assert_close(tensor, whole[name], atol=0, rtol=0)
        for key, value in result.items():
            if key.startswith("weights"):
                assert value == 0.0, key
                continue
            for metric, error in value.items():
                assert error < 2e-5, (tp_rank, pp_rank, key, metric, error)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, hf_model(ids).logits, atol=1e-5, rtol=0)
    assert (tmp_path / "export" / "model.safetensors.index.json").is_file()


def test_stages_built_from_layer_ranges_chain_to_the_whole_model():
    model = GPTModel(CONFIG)
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(ids)
    assert all(p.is_meta for p in GPTModel(CONFIG, device="meta").parameters())
    first = GPTModel(CONFIG, layers=range(0, 2), post_process=False)
    last = GPTModel(CONFIG, layers=range(2, 4), pre_process=False)
    with torch.no_grad():
        chained = last(first(ids))
    torch.testing.assert_close(chained, expected, atol=1e-5, rtol=0)


MOE_CONFIG = GPTConfig.from_name(
    "tiny",
    hidden_size=32,
    seed=23,
    moe=dict(
        num_experts=4,
        top_k=2,
        expert_ffn_hidden_size=16,
        shared_expert_ffn_hidden_size=16,
        shared_expert_gate=True,
    ),
)


def _expert_layout(checkpoint: str) -> dict:
    state = initialize(tp=2, ep=2, etp=2)
    chunks = build_pipeline_stages(MOE_CONFIG, state)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = chunks[0](ids)
    reads = _spy_reads(SafetensorsReader)
    loaded = GPTModel.from_hf(checkpoint, state=state)
    _, full = gather_full_tensors([loaded], state, every_rank=True)
    return {
        "weights": _weights_error(state, chunks, MOE_CONFIG),
        "logits": logits,
        "reads": reads,
        "loaded": full,
    }


def test_moe_model_at_tp2_ep2_etp2_has_the_same_weights_logits_and_sliced_hf_load(tmp_path):
    whole = GPTModel(MOE_CONFIG)
    whole.to_hf(tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = whole(ids)
    reference = whole.state_dict()
    for result in run_distributed(_expert_layout, 4, str(tmp_path / "hf")):
        assert result["weights"] == 0.0
        torch.testing.assert_close(result["logits"], expected, atol=2e-5, rtol=0)
        for name, tensor in result["loaded"].items():
            torch.testing.assert_close(tensor, reference[name], atol=0, rtol=0)
        for name, numel, full in result["reads"]:
            if ".experts." in name:  # an expert's FFN is split over etp: never read whole
                assert numel < full, (name, numel, full)
