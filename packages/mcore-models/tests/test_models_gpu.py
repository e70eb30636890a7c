"""GPU checks: bf16 parity with transformers for the flash (SDPA) and flex backends."""

from __future__ import annotations

import pytest
import torch
from _bf16_parity import bf16_errors

from mcore_models import GPTModel, PackedSeqParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

transformers = pytest.importorskip("transformers")

SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    max_position_embeddings=1024,
)


def _hf(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**SHAPE)
        return transformers.LlamaForCausalLM(config)
    if kind == "qwen2":
        config = transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True)
        return transformers.Qwen2ForCausalLM(config)
    config = transformers.Qwen3Config(**SHAPE, head_dim=64)
    return transformers.Qwen3ForCausalLM(config)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    model = _hf(request.param).float().eval()
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return model, directory


IDS = torch.randint(0, 512, (2, 384), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(checkpoint, backend):
    hf_model, directory = checkpoint
    our_error, hf_error = bf16_errors(hf_model, directory, IDS.cuda(), backend)
    assert our_error <= 1.5 * hf_error + 1e-2, (our_error, hf_error)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_packed_bf16_equals_unpacked_on_gpu(checkpoint, backend):
    _, directory = checkpoint
    model = GPTModel.from_hf(directory, dtype="bfloat16", device="cuda", attention_backend=backend)
    lengths = [100, 37, 247]
    ids = IDS[0, : sum(lengths)].cuda()[None]
    cu = torch.tensor([0, 100, 137, 384], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        packed = model(ids, packed_seq_params=PackedSeqParams(cu, max(lengths)))
        for i in range(3):
            alone = model(ids[:, cu[i] : cu[i + 1]])
            torch.testing.assert_close(packed[:, cu[i] : cu[i + 1]], alone, atol=3e-2, rtol=3e-2)


def test_flex_gradients_match_eager_in_fp32(checkpoint):
    _, directory = checkpoint
    grads = {}
    for backend in ("eager", "flex", "sdpa"):
        model = GPTModel.from_hf(directory, device="cuda", attention_backend=backend)
        model(IDS.cuda()).logsumexp(-1).mean().backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters()}
    for backend in ("flex", "sdpa"):
        for name, grad in grads["eager"].items():
            torch.testing.assert_close(grads[backend][name], grad, atol=2e-4, rtol=2e-3)
