"""GPU: packed rows attend through one varlen flash call, equal to one SDPA call per sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_models import GPTConfig, GPTModel, PackedSeqParams
from mcore_models.gpt import attention_backends, fused_ops
from mcore_models.gpt.attention_backends import attend, build_attention_mask
from mcore_models.gpt.varlen_attention import varlen_attention_available

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _per_sequence(q, k, v, lengths, scale):
    # Independent reference: one causal SDPA call per sequence, grouped heads repeated.
    groups = q.shape[2] // k.shape[2]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[:, start : start + n].transpose(1, 2) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 4, 128)])
def test_varlen_equals_per_sequence_sdpa_forward_and_backward(heads, kv_heads, dim):
    torch.manual_seed(0)
    lengths = [37, 128, 5, 300, 1, 41]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(cu_seqlens=cu.cuda(), max_seqlen=max(lengths))
    mask = build_attention_mask("sdpa", total, torch.device("cuda"), packed)
    q = torch.randn(1, total, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, total, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, total, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(1, total, heads, dim, device="cuda", dtype=torch.bfloat16)
    assert varlen_attention_available(q) and mask.varlen_cu_seqlens is not None
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attend("sdpa", *leaves, mask, 0.1)
    out.backward(grad)
    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = _per_sequence(*ref_leaves, lengths, 0.1)
    expected.backward(grad)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, atol=3e-2, rtol=3e-2)


def test_packed_model_with_fused_kernels_matches_unfused_per_sequence_path(monkeypatch):
    config = GPTConfig.from_name(
        "tiny",
        vocab_size=256,
        hidden_size=256,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=512,
        dtype="bfloat16",
        seed=1,
    )
    model = GPTModel(config, device="cuda")
    lengths = [100, 3, 60, 93]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).cuda()
    ids = torch.randint(0, 256, (1, sum(lengths)), device="cuda")
    packed = PackedSeqParams(cu_seqlens=cu, max_seqlen=max(lengths))

    def loss_and_grads():
        model.zero_grad()
        logits = model(ids, packed_seq_params=packed)
        logits.float().logsumexp(-1).mean().backward()
        return logits.detach(), [p.grad.float().clone() for p in model.parameters()]

    fast, fast_grads = loss_and_grads()
    monkeypatch.setattr(fused_ops, "_fused", lambda x: False)
    monkeypatch.setattr(attention_backends, "varlen_attention_available", lambda q: False)
    slow, slow_grads = loss_and_grads()
    torch.testing.assert_close(fast, slow, atol=5e-2, rtol=5e-2)
    for got, want in zip(fast_grads, slow_grads):
        scale = want.abs().max().clamp_min(1e-6)
        assert float((got - want).abs().max() / scale) < 5e-2
