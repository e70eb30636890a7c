"""Training RoPE and SwiGLU kernels (interpreted on CPU) against torch, values and gradients."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel modules' import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.reference import rotary_embedding_reference, swiglu_pair_reference
from mcore_kernels.rotary import rotary_embedding
from mcore_kernels.swiglu import swiglu_pair

pytestmark = pytest.mark.interpreter


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _eager_rotate_half(x, cos, sin):
    # The Hugging Face layout written out independently: rotate_half and broadcasting.
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * torch.cat((c, c), dim=-1) + rotated * torch.cat((s, s), dim=-1)


def _tables(batch, tokens, dim, seed):
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 2048, (batch, tokens), generator=g).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    angles = positions[..., None] * inv_freq
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("heads,dim", [(3, 8), (5, 16)])
def test_rotary_matches_rotate_half_with_gradients(triton_backend, heads, dim):
    g = torch.Generator().manual_seed(heads)
    x = torch.randn(2, 7, heads, dim, generator=g, requires_grad=True)
    cos, sin = _tables(2, 7, dim, heads)
    grad = torch.randn(2, 7, heads, dim, generator=g)
    out = rotary_embedding(x, cos, sin)
    (got,) = torch.autograd.grad(out, x, grad)
    expected_out = _eager_rotate_half(x, cos, sin)
    (expected,) = torch.autograd.grad(expected_out, x, grad)
    torch.testing.assert_close(out, expected_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_rotary_reads_strided_token_slices_of_a_fused_projection(triton_backend):
    g = torch.Generator().manual_seed(4)
    fused = torch.randn(2, 5, 3 * 16 + 2 * 8, generator=g)
    q = fused[..., :48].unflatten(-1, (3, 16))  # tokens 64 elements apart, heads packed
    cos, sin = _tables(2, 5, 16, 5)
    torch.testing.assert_close(
        rotary_embedding(q, cos, sin), _eager_rotate_half(q, cos, sin), atol=1e-6, rtol=1e-5
    )


def test_rotary_bf16_rounds_once_like_the_reference(triton_backend):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 9, 4, 8, generator=g).bfloat16()
    cos, sin = _tables(1, 9, 8, 2)
    # The interpreter truncates float32 -> bf16 casts: allow one bf16 unit in the last place.
    torch.testing.assert_close(
        rotary_embedding(x, cos, sin).float(),
        rotary_embedding_reference(x, cos, sin).float(),
        atol=0.0,
        rtol=2**-7,
    )


def test_swiglu_pair_matches_torch_with_gradients(triton_backend):
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(5, 37, generator=g, requires_grad=True)
    up = torch.randn(5, 37, generator=g, requires_grad=True)
    grad = torch.randn(5, 37, generator=g)
    out = swiglu_pair(gate, up)
    got = torch.autograd.grad(out, (gate, up), grad)
    expected_out = torch.nn.functional.silu(gate) * up
    expected = torch.autograd.grad(expected_out, (gate, up), grad)
    torch.testing.assert_close(out, expected_out, atol=1e-6, rtol=1e-5)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(
        swiglu_pair(gate.detach().bfloat16(), up.detach().bfloat16()).float(),
        swiglu_pair_reference(gate.detach().bfloat16(), up.detach().bfloat16()).float(),
        atol=0.0,
        rtol=2**-7,
    )


def test_bad_arguments_raise_typed_errors():
    x = torch.randn(1, 4, 2, 8)
    cos, sin = _tables(1, 4, 8, 0)
    with pytest.raises(KernelShapeError, match="D even"):
        rotary_embedding(torch.randn(1, 4, 2, 7), cos, sin)
    with pytest.raises(KernelShapeError, match=r"cos\.shape"):
        rotary_embedding(x, cos[:, :3], sin)
    with pytest.raises(KernelDtypeError, match=r"x\.dtype"):
        rotary_embedding(x.long(), cos, sin)
    with pytest.raises(KernelShapeError, match="must be equal"):
        swiglu_pair(torch.randn(2, 3), torch.randn(3, 2))
    with pytest.raises(KernelDtypeError, match="one floating-point dtype"):
        swiglu_pair(torch.randn(2, 3), torch.randn(2, 3).double())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_kernels_match_float32_references_within_one_ulp():
    torch.manual_seed(0)
    x = torch.randn(1, 4096, 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (t.cuda() for t in _tables(1, 4096, 64, 3))
    grad = torch.randn_like(x)
    out = rotary_embedding(x, cos, sin)
    (dx,) = torch.autograd.grad(out, x, grad)
    ref = rotary_embedding_reference(x.detach(), cos, sin)
    ref_dx = rotary_embedding_reference(grad, cos, -sin)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=2**-7)
    torch.testing.assert_close(dx.float(), ref_dx.float(), atol=1e-2, rtol=2**-7)
    gate = torch.randn(4096, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(4096, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4096, 1000, device="cuda", dtype=torch.bfloat16)
    act = swiglu_pair(gate, up)
    d_gate, d_up = torch.autograd.grad(act, (gate, up), g)
    gf, uf = gate.detach().float().requires_grad_(True), up.detach().float().requires_grad_(True)
    ref_act = torch.nn.functional.silu(gf) * uf
    ref_dg, ref_du = torch.autograd.grad(ref_act, (gf, uf), g.float())
    torch.testing.assert_close(act.float(), ref_act, atol=1e-2, rtol=2**-7)
    torch.testing.assert_close(d_gate.float(), ref_dg, atol=1e-2, rtol=2**-7)
    torch.testing.assert_close(d_up.float(), ref_du, atol=1e-2, rtol=2**-7)
