"""Every kernel on a CUDA GPU against its torch reference, eagerly and under Inductor.

The shapes are those of the benchmark table where it matters for the launch configuration: one
row (a single backward program writes the weight gradient directly), a few hundred rows and
several thousand (partial weight gradients summed by the second kernel), the three hidden sizes
of the table, and a vocabulary whose rows start at unaligned addresses (50257).
"""

from __future__ import annotations

import pytest
import torch

from mcore_kernels import rms_norm, token_logprobs
from mcore_kernels.paged_attention import paged_attention
from mcore_kernels.reference import (
    masked_update_reference,
    merge_reference,
    paged_attention_reference,
    rms_norm_reference,
    slice_after_reference,
    token_logprobs_reference,
)
from mcore_kernels.tensor_ops import masked_update, merge, slice_after

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _rms_inputs(rows, hidden, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    residual = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=generator)).bfloat16()
    return x, residual, weight


@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
@pytest.mark.parametrize("rows", [1, 300, 5000])
def test_rms_norm_matches_reference_values_and_gradients(rows, hidden):
    x, residual, weight = _rms_inputs(rows, hidden, seed=rows + hidden)
    dy, dh = (torch.randn_like(x) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (x, residual, weight)]
    y, h = rms_norm(leaves[0], leaves[2], 1e-6, residual=leaves[1])
    torch.autograd.backward((y, h), (dy, dh))
    ref_leaves = [t.double().requires_grad_() for t in (x, residual, weight)]
    y_ref, h_ref = rms_norm_reference(ref_leaves[0], ref_leaves[2], 1e-6, residual=ref_leaves[1])
    torch.autograd.backward((y_ref, h_ref), (dy.double(), dh.double()))
    assert torch.equal(h, (x + residual))
    torch.testing.assert_close(y.double(), y_ref, atol=1.6e-2, rtol=1.6e-2)
    for got, ref in zip(leaves, ref_leaves, strict=True):
        scale = ref.grad.abs().max().item()
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=2e-2 * scale, rtol=2e-2)


def test_rms_norm_without_gradient_and_in_a_cuda_graph():
    x, residual, weight = _rms_inputs(256, 4096, seed=3)
    with torch.no_grad():
        y, _ = rms_norm(x, weight, 1e-6, residual=residual)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, _ = rms_norm(x, weight, 1e-6, residual=residual)
        x.copy_(torch.randn_like(x))
        graph.replay()
    torch.testing.assert_close(captured, rms_norm_reference(x, weight, 1e-6, residual=residual)[0])
    assert not torch.equal(captured, y)


@pytest.mark.parametrize("vocab", [50257, 151936])
def test_token_logprobs_issues_no_host_sync_and_matches_reference(vocab):
    generator = torch.Generator(device="cuda").manual_seed(vocab)
    logits = (torch.randn(33, vocab, device="cuda", generator=generator) * 3).bfloat16()
    targets = torch.randint(0, vocab, (33,), device="cuda", generator=generator)
    targets[5] = -100
    leaf = logits.clone().requires_grad_()
    warm_logprobs, warm_entropy = token_logprobs(leaf, targets, return_entropy=True)
    (warm_logprobs.sum() + warm_entropy.sum()).backward()  # compile the kernels first
    leaf.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logprobs, entropy = token_logprobs(leaf, targets, return_entropy=True)
        (logprobs.sum() + entropy.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref_leaf = logits.clone().requires_grad_()
    logprobs_ref, entropy_ref = token_logprobs_reference(ref_leaf, targets, return_entropy=True)
    (logprobs_ref.sum() + entropy_ref.sum()).backward()
    torch.testing.assert_close(logprobs, logprobs_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(entropy, entropy_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(leaf.grad.float(), ref_leaf.grad.float(), atol=1e-5, rtol=1e-2)


def test_token_logprobs_marks_out_of_range_targets_with_nan_on_the_device():
    logits = torch.randn(4, 50257, device="cuda").bfloat16()
    targets = torch.tensor([1, 50257, -3, -100], device="cuda")
    logprobs = token_logprobs(logits, targets)
    assert torch.isnan(logprobs[1:3]).all() and logprobs[3] == 0 and torch.isfinite(logprobs[0])


def test_strided_logits_slice_matches_reference():
    # A slice starts one element into each row: neither the rows nor the base are aligned.
    base = torch.randn(8, 1001, device="cuda").bfloat16().requires_grad_()
    targets = torch.randint(0, 1000, (8,), device="cuda")
    leaf = base.detach()[:, 1:].clone().requires_grad_()
    got = token_logprobs(base[:, 1:], targets)
    got.sum().backward()
    expected = token_logprobs_reference(leaf, targets)
    expected.sum().backward()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(base.grad[:, 1:].float(), leaf.grad.float(), atol=1e-5, rtol=1e-2)
    assert torch.equal(base.grad[:, 0], torch.zeros_like(base.grad[:, 0]))


def _paged_inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    lens = [1, 17, 300, 64]
    max_blocks, block_size = 20, 16
    blocks = len(lens) * max_blocks
    tables = torch.randperm(blocks, generator=generator).reshape(len(lens), max_blocks)
    k_cache = torch.randn(blocks, block_size, 2, 64, generator=generator).bfloat16()
    v_cache = torch.randn(blocks, block_size, 2, 64, generator=generator).bfloat16()
    q = torch.randn(len(lens), 8, 64, generator=generator).bfloat16()
    context_lens = torch.tensor(lens, dtype=torch.int32)
    return [t.cuda() for t in (q, k_cache, v_cache, tables.int(), context_lens)]


def test_paged_attention_matches_reference():
    inputs = _paged_inputs()
    got = paged_attention(*inputs, scale=0.125)
    expected = paged_attention_reference(*inputs, scale=0.125)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_tensor_ops_match_references():
    inp = torch.randn(10, 3, 5, device="cuda")
    pos = torch.tensor([4], device="cuda")
    out, out_ref = torch.zeros(8, 3, 5, device="cuda"), torch.zeros(8, 3, 5, device="cuda")
    assert torch.equal(slice_after(inp, pos, out), slice_after_reference(inp, pos, out_ref))
    a, b = torch.randn(6, 7, device="cuda"), torch.randn(4, 7, device="cuda")
    assert torch.equal(merge(a.clone(), b, pos), merge_reference(a.clone(), b, pos))
    states, new = torch.randn(5, 9, device="cuda"), torch.randn(3, 9, device="cuda")
    idx = torch.tensor([4, -1, 0], device="cuda")
    assert torch.equal(
        masked_update(states.clone(), idx, new), masked_update_reference(states.clone(), idx, new)
    )


def _inference_block(x, weight, inp, pos, out, q, k_cache, v_cache, tables, lens):
    y = rms_norm(x, weight, 1e-5)
    slice_after(inp, pos, out)
    return y * 2, out + 1, paged_attention(q, k_cache, v_cache, tables, lens, scale=0.125)


def test_inductor_compiles_inference_kernels_with_eager_values():
    torch._dynamo.reset()
    x, _, weight = _rms_inputs(64, 2048, seed=9)
    inp = torch.randn(10, 16, device="cuda")
    pos = torch.tensor([3], device="cuda")
    args = [x, weight, inp, pos, *_paged_inputs(seed=1)]
    expected = _inference_block(x, weight, inp, pos, torch.zeros(8, 16, device="cuda"), *args[4:])
    compiled = torch.compile(_inference_block, backend="inductor", fullgraph=True)
    got = compiled(x, weight, inp, pos, torch.zeros(8, 16, device="cuda"), *args[4:])
    for value, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(value, reference)
