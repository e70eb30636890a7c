"""GPU only: the Mamba-2 Triton kernels at realistic shapes, float32 and bf16, fwd and bwd."""

import pytest
import torch

from mcore_kernels.ssd import (
    ssd_scan_reference,
    ssd_scan_triton,
    ssd_state_update_reference,
    ssd_state_update_triton,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _problem(dtype, tokens=700, heads=8, head_dim=64, groups=2, state=128, seqs=(300, 1, 399)):
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    x = randn(tokens, heads, head_dim).to(dtype)
    dt = torch.rand(tokens, heads, generator=g, device="cuda") * 0.1 + 0.01
    A = -torch.rand(heads, generator=g, device="cuda") - 0.5
    B = (randn(tokens, groups, state) * 0.3).to(dtype)
    C = (randn(tokens, groups, state) * 0.3).to(dtype)
    D = randn(heads)
    cu = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return x, dt, A, B, C, D, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_forward_and_backward_match_reference(dtype):
    x, dt, A, B, C, D, cu = _problem(dtype)
    grads = []
    outputs = []
    for scan in (ssd_scan_reference, ssd_scan_triton):
        inputs = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D)]
        y, final = scan(*inputs, chunk_size=64, cu_seqlens=cu)
        probe = torch.randn(
            y.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda"
        )
        loss = (y.float() * probe).sum() + final.sum()
        grads.append(torch.autograd.grad(loss, inputs))
        outputs.append((y.float(), final))
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    for ref, got in zip(outputs[0], outputs[1], strict=True):
        scale = ref.abs().max()
        assert ((got - ref).abs().max() / scale) < tol
    for name, ref, got in zip(["x", "dt", "A", "B", "C", "D"], *grads, strict=True):
        scale = ref.float().abs().max()
        assert ((got.float() - ref.float()).abs().max() / scale) < tol, name


def test_state_update_matches_reference_on_gpu():
    heads, head_dim, groups, state = 8, 64, 2, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    slots = torch.randn(9, heads, head_dim, state, generator=g, device="cuda")
    x = torch.randn(5, heads, head_dim, generator=g, device="cuda").bfloat16()
    dt = torch.rand(5, heads, generator=g, device="cuda") * 0.1
    A = -torch.rand(heads, generator=g, device="cuda")
    B = torch.randn(5, groups, state, generator=g, device="cuda").bfloat16()
    C = torch.randn(5, groups, state, generator=g, device="cuda").bfloat16()
    indices = torch.tensor([3, 0, -1, 8, 5], device="cuda")
    ref_state, got_state = slots.clone(), slots.clone()
    ref = ssd_state_update_reference(ref_state, x, dt, A, B, C, None, state_indices=indices)
    got = ssd_state_update_triton(got_state, x, dt, A, B, C, None, state_indices=indices)
    torch.testing.assert_close(got_state, ref_state, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
