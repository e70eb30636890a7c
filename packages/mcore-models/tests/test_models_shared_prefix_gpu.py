"""GPU: packed rows with shared prefixes attend through one varlen flash call (bottom-right causal)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_models import PackedSeqParams
from mcore_models.gpt.attention_backends import attend, build_attention_mask

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _reference(q, k, v, bounds, prefixes, scale):
    # Independent reference: every sequence gets its own copy of its prefix, one causal SDPA
    # call over [prefix, sequence] in float32, keeping the sequence's rows.
    groups = q.shape[2] // k.shape[2]
    outs = []
    for (start, end), prefix in zip(bounds, prefixes):
        index = list(range(*prefix)) if prefix else []
        index += list(range(start, end))
        qs = q[:, index].float().transpose(1, 2)
        ks = k[:, index].float().transpose(1, 2).repeat_interleave(groups, 1)
        vs = v[:, index].float().transpose(1, 2).repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        outs.append(out[:, :, len(index) - (end - start) :])
    return torch.cat(outs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 64), (4, 4, 128)])
def test_varlen_shared_prefix_equals_one_copy_per_sequence(heads, kv_heads, dim):
    torch.manual_seed(0)
    lengths = [255, 257, 257, 130, 40, 17, 3]
    parents = [-1, 0, 0, 0, -1, 4, 4]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(
        cu_seqlens=cu, max_seqlen=max(lengths), prefix_of=torch.tensor(parents)
    )
    mask = build_attention_mask("sdpa", total, torch.device("cuda"), packed)
    assert mask.varlen_kv_index is not None
    q, k, v = (
        torch.randn(1, total, h, dim, device="cuda", dtype=torch.bfloat16)
        for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(1, total, heads, dim, device="cuda", dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attend("sdpa", *leaves, mask, 0.125)
    out.backward(grad)
    bounds = [(int(cu[i]), int(cu[i + 1])) for i in range(len(lengths))]
    prefixes = [bounds[p] if p >= 0 else None for p in parents]
    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = _reference(*ref_leaves, bounds, prefixes, 0.125)
    expected.backward(grad.float())
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.float(), want.grad.float(), atol=5e-2, rtol=5e-2)
