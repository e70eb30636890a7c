"""Mamba-2 kernels: chunked scan (fwd/bwd), decode state update and causal conv1d.

The Triton kernels run through the interpreter on CPU and are compared with the torch
references, and both with the token-by-token recurrence (float64).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.ssd import (
    causal_conv1d,
    causal_conv1d_update,
    ssd_scan_recurrent,
    ssd_scan_reference,
    ssd_scan_triton,
    ssd_state_update_reference,
    ssd_state_update_triton,
)

pytestmark = pytest.mark.interpreter


def _problem(tokens=37, heads=4, head_dim=8, groups=2, state=8, seqs=(5, 25, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_dim, generator=g)
    dt = torch.rand(tokens, heads, generator=g) * 0.5 + 0.05
    A = -torch.rand(heads, generator=g) - 0.2
    B = torch.randn(tokens, groups, state, generator=g)
    C = torch.randn(tokens, groups, state, generator=g)
    D = torch.randn(heads, generator=g)
    cu = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()], dtype=torch.int32)
    init = torch.randn(len(seqs), heads, head_dim, state, generator=g)
    return x, dt, A, B, C, D, cu, init


@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("with_init", [False, True])
def test_scan_forward_matches_recurrence(chunk_size, with_init):
    x, dt, A, B, C, D, cu, init = _problem()
    init = init if with_init else None
    y_ref, f_ref = ssd_scan_recurrent(x, dt, A, B, C, D, cu_seqlens=cu, initial_states=init)
    for scan in (ssd_scan_reference, ssd_scan_triton):
        y, final = scan(
            x, dt, A, B, C, D, chunk_size=chunk_size, cu_seqlens=cu, initial_states=init
        )
        torch.testing.assert_close(y.double(), y_ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(final.double(), f_ref, atol=2e-5, rtol=1e-5)


def test_scan_packed_sequences_equal_separate_sequences():
    x, dt, A, B, C, D, cu, _ = _problem()
    y_packed, f_packed = ssd_scan_triton(x, dt, A, B, C, D, chunk_size=16, cu_seqlens=cu)
    bounds = cu.tolist()
    for i in range(len(bounds) - 1):
        s = slice(bounds[i], bounds[i + 1])
        y, f = ssd_scan_triton(x[s], dt[s], A, B[s], C[s], D, chunk_size=16)
        torch.testing.assert_close(y_packed[s], y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(f_packed[i], f[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 40])
def test_scan_backward_matches_reference_autograd(head_dim):
    # head_dim 40 spans two programs of 32 rows each (the second one masked).
    x, dt, A, B, C, D, cu, init = _problem(
        heads=4 if head_dim == 8 else 2, groups=1, head_dim=head_dim
    )
    g = torch.Generator().manual_seed(1)
    grads = []
    for scan in (ssd_scan_reference, ssd_scan_triton):
        inputs = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D, init)]
        y, final = scan(*inputs[:6], chunk_size=16, cu_seqlens=cu, initial_states=inputs[6])
        g.manual_seed(1)
        loss = (y * torch.randn(y.shape, generator=g)).sum()
        loss = loss + (final * torch.randn(final.shape, generator=g)).sum()
        grads.append(torch.autograd.grad(loss, inputs))
    names = ("x", "dt", "A", "B", "C", "D", "initial_states")
    for name, ref, got in zip(names, *grads, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=f"grad of {name}")


def test_scan_backward_bf16_inputs_give_bf16_grads():
    x, dt, A, B, C, D, _, _ = _problem(tokens=20, seqs=(20,))
    inputs = [x.bfloat16().requires_grad_(), dt, A, B.bfloat16().requires_grad_(), C.bfloat16()]
    y, _ = ssd_scan_triton(*inputs, D, chunk_size=16)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16
    assert inputs[0].grad.dtype == torch.bfloat16 and inputs[3].grad.dtype == torch.bfloat16


def test_scan_rejects_bad_chunk_size_and_shapes():
    x, dt, A, B, C, D, _, _ = _problem()
    with pytest.raises(KernelValueError, match="chunk_size=24"):
        ssd_scan_triton(x, dt, A, B, C, D, chunk_size=24)
    with pytest.raises(KernelShapeError, match=r"dt\.shape"):
        ssd_scan_reference(x, dt[:, :2], A, B, C, D)
    with pytest.raises(KernelValueError, match="heads=4 is not a multiple of groups=3"):
        ssd_scan_reference(x, dt, A, B[:, :1].expand(-1, 3, -1), C[:, :1].expand(-1, 3, -1))


def test_state_update_matches_recurrence_and_skips_padding_rows():
    x, dt, A, B, C, D, _, init = _problem(tokens=3, seqs=(1, 1, 1))
    slots = init.clone()
    indices = torch.tensor([2, -1, 0])
    expected_state = slots.clone()
    for state_update in (ssd_state_update_reference, ssd_state_update_triton):
        state = slots.clone()
        y = state_update(state, x, dt, A, B, C, D, state_indices=indices)
        for row, slot in ((0, 2), (2, 0)):
            s = slice(row, row + 1)
            y_ref, f_ref = ssd_scan_recurrent(
                x[s], dt[s], A, B[s], C[s], D, initial_states=slots[slot : slot + 1]
            )
            torch.testing.assert_close(y[row].double(), y_ref[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(state[slot].double(), f_ref[0], atol=1e-5, rtol=1e-5)
            expected_state[slot] = f_ref[0].float()
        assert torch.equal(y[1], torch.zeros_like(y[1]))
        torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)


def test_state_update_rejects_bf16_state():
    x, dt, A, B, C, D, _, init = _problem(tokens=3, seqs=(1, 1, 1))
    with pytest.raises(KernelDtypeError, match="float32"):
        ssd_state_update_triton(init.bfloat16(), x, dt, A, B, C, D)


def _conv_oracle(x, weight, bias, history):
    padded = torch.cat([history.T, x])  # [K - 1 + T, C]
    taps = weight.shape[1]
    out = torch.stack([(padded[t : t + taps].T * weight).sum(-1) + bias for t in range(x.shape[0])])
    return torch.nn.functional.silu(out), padded[-(taps - 1) :].T


def test_causal_conv1d_packed_with_initial_states_matches_oracle():
    g = torch.Generator().manual_seed(0)
    channels, taps = 6, 4
    lengths = [1, 5, 2]
    x = torch.randn(sum(lengths), channels, generator=g)
    weight = torch.randn(channels, taps, generator=g)
    bias = torch.randn(channels, generator=g)
    init = torch.randn(len(lengths), channels, taps - 1, generator=g)
    cu = torch.tensor([0, 1, 6, 8])
    y, finals = causal_conv1d(x, weight, bias, cu_seqlens=cu, initial_states=init)
    for i in range(3):
        s = slice(cu[i], cu[i + 1])
        y_ref, f_ref = _conv_oracle(x[s], weight, bias, init[i])
        torch.testing.assert_close(y[s], y_ref)
        torch.testing.assert_close(finals[i], f_ref)


def test_causal_conv1d_update_continues_a_prefill():
    g = torch.Generator().manual_seed(0)
    channels, taps = 6, 4
    x = torch.randn(7, channels, generator=g)
    weight = torch.randn(channels, taps, generator=g)
    bias = torch.randn(channels, generator=g)
    y_full, _ = causal_conv1d(x, weight, bias)
    _, state = causal_conv1d(x[:5], weight, bias)
    slots = torch.zeros(3, channels, taps - 1)
    slots[1] = state[0]
    for t in (5, 6):
        y = causal_conv1d_update(x[t : t + 1], slots, weight, bias, state_indices=torch.tensor([1]))
        torch.testing.assert_close(y[0], y_full[t])


def test_scan_empty_sequences_keep_their_initial_state():
    # CUDA-graph buckets pad with empty sequences: they must pass their state through.
    x, dt, A, B, C, D, _, init = _problem(tokens=9, seqs=(4, 0, 5, 0))
    cu = torch.tensor([0, 4, 4, 9, 9], dtype=torch.int32)
    y_ref, f_ref = ssd_scan_recurrent(x, dt, A, B, C, D, cu_seqlens=cu, initial_states=init)
    y, final = ssd_scan_triton(x, dt, A, B, C, D, chunk_size=16, cu_seqlens=cu, initial_states=init)
    torch.testing.assert_close(y.double(), y_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final[1], init[1])
    torch.testing.assert_close(final[3], init[3])
    torch.testing.assert_close(final.double(), f_ref, atol=2e-5, rtol=1e-5)
