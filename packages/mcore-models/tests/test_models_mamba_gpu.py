"""GPU only: a hybrid model's forward and backward on the Triton SSD kernels equal the torch path."""

import pytest
import torch

from mcore_models import PackedSeqParams
from mcore_models.mamba import HybridModel, hybrid_preset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_training_path_equals_torch_path(dtype, monkeypatch):
    config = hybrid_preset(
        "tiny-hybrid",
        hidden_size=128,
        mamba_head_dim=32,
        ssm_state_size=64,
        chunk_size=32,
        dtype=dtype,
    )
    model = HybridModel(config, device="cuda")
    lengths = [100, 3, 61]
    ids = torch.randint(0, config.vocab_size, (1, sum(lengths)), device="cuda")
    cu = torch.tensor([0, 100, 103, 164], dtype=torch.int32, device="cuda")
    packed = PackedSeqParams(cu_seqlens=cu, max_seqlen=100)
    results = []
    for backend in ("triton", "torch"):
        monkeypatch.setenv("MCORE_KERNELS_BACKEND", backend)
        model.zero_grad()
        logits = model(ids, packed_seq_params=packed)
        logits.float().square().mean().backward()
        results.append(
            (logits.float(), {n: p.grad.float().clone() for n, p in model.named_parameters()})
        )
    (triton_logits, triton_grads), (torch_logits, torch_grads) = results
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (triton_logits - torch_logits).abs().max() <= tol * torch_logits.abs().max()
    for name, grad in torch_grads.items():
        assert (triton_grads[name] - grad).abs().max() <= tol * grad.abs().max() + 1e-6, name
