"""Context-parallel attention (ring and all-gather-KV) against single-process attention.

Each rank splits the same full-length q/k/v with ``split_sequence``, runs the distributed
attention, and gathers output and gradients back with ``gather_sequence``; the reference is
``torch.nn.functional.scaled_dot_product_attention`` over the full sequence in float64 (per
packed sequence for ``cu_seqlens``), with keys/values repeated for grouped-query attention.
Tolerance: fp32 inputs, ``atol=2e-5`` (the online-softmax merge sums in another order).
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from mcore_parallel import initialize
from mcore_parallel.context_parallel import (
    context_parallel_attention,
    gather_sequence,
    local_cu_seqlens,
    position_ids,
    split_sequence,
)
from mcore_parallel.context_parallel.blocks import block_backward, block_forward
from mcore_parallel.errors import ParallelConfigError
from mcore_parallel.testing import run_distributed

ATOL = 2e-5
CASES = {
    # name: (batch, q heads, kv heads, lengths of the packed sequences or one length, causal)
    "causal": (2, 4, 4, [32], True),
    "causal_gqa": (1, 4, 2, [48], True),
    "packed_gqa": (1, 6, 2, [16, 32, 16], True),
    "packed_bidirectional": (1, 2, 1, [24, 8 * 2 * 2 * 2], False),
}


def make_inputs(name: str, cp: int):
    batch, heads, kv_heads, lengths, causal = CASES[name]
    lengths = [length * cp // 2 if length % (2 * cp) else length for length in lengths]
    lengths = [-(-n // (2 * cp)) * 2 * cp for n in lengths]
    total = sum(lengths)
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(batch, heads, total, 8, generator=generator)
    k = torch.randn(batch, kv_heads, total, 8, generator=generator)
    v = torch.randn(batch, kv_heads, total, 8, generator=generator)
    grad = torch.randn(batch, heads, total, 8, generator=generator)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if len(lengths) > 1 else None
    return q, k, v, grad, cu, causal


def reference(q, k, v, grad, cu, causal):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    repeat = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    bounds = [0, q.shape[2]] if cu is None else cu.tolist()
    outs = [
        F.scaled_dot_product_attention(q[:, :, a:b], kr[:, :, a:b], vr[:, :, a:b], is_causal=causal)
        for a, b in itertools.pairwise(bounds)
    ]
    out = torch.cat(outs, dim=2)
    # A scalar loss: backward(grad) would import sympy (seconds) on the first call.
    (out * grad.double()).sum().backward()
    return out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()


def distributed_case(state, name: str, method: str) -> dict:
    cp = state.size("cp")
    group, rank = state.group("cp"), state.rank_in("cp")
    q, k, v, grad, cu, causal = make_inputs(name, cp)
    local = [split_sequence(t, cp, rank, dim=2, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, group, causal=causal, cu_seqlens=cu, method=method)
    (out * split_sequence(grad, cp, rank, dim=2, cu_seqlens=cu)).sum().backward()
    gathered = [gather_sequence(t, group, dim=2, cu_seqlens=cu) for t in (out.detach(),)]
    gathered += [gather_sequence(t.grad, group, dim=2, cu_seqlens=cu) for t in local]
    expected = reference(q, k, v, grad, cu, causal)
    return {
        key: float((got - want).abs().max())
        for key, got, want in zip(("out", "grad_q", "grad_k", "grad_v"), gathered, expected)
    }


def all_cases() -> dict:
    state = initialize(cp=torch.distributed.get_world_size())
    return {
        f"{name}/{method}": distributed_case(state, name, method)
        for name in CASES
        for method in ("ring", "all_gather")
    }


_RESULTS: dict[int, list[dict]] = {}


def results_for(cp: int) -> list[dict]:
    # One spawn per cp size runs every case, so the ranks' start-up is paid twice, not 16 times.
    if cp not in _RESULTS:
        _RESULTS[cp] = run_distributed(all_cases, cp)
    return _RESULTS[cp]


@pytest.mark.parametrize("method", ["ring", "all_gather"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_attention_equals_single_process(name, cp, method):
    for errors in results_for(cp):
        assert max(errors[f"{name}/{method}"].values()) < ATOL, errors[f"{name}/{method}"]


def test_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    tokens = torch.arange(16).unsqueeze(0)
    assert split_sequence(tokens, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert split_sequence(tokens, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert split_sequence(tokens, 4, 1).tolist() == [[2, 3, 12, 13]]


def test_packed_sequences_split_one_by_one_with_positions_and_local_boundaries():
    cu = torch.tensor([0, 8, 24])
    tokens = torch.arange(24).unsqueeze(0)
    assert split_sequence(tokens, 2, 0, cu_seqlens=cu).tolist() == [
        [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]
    ]
    assert position_ids(24, 2, 0, cu_seqlens=cu).tolist() == [
        0,
        1,
        6,
        7,
        0,
        1,
        2,
        3,
        12,
        13,
        14,
        15,
    ]
    assert position_ids(24, 2, 1, cu_seqlens=cu).tolist() == [2, 3, 4, 5, 4, 5, 6, 7, 8, 9, 10, 11]
    assert local_cu_seqlens(cu, 2).tolist() == [0, 4, 12]
    # Empty segments (a fixed number of boundaries, padded) hold no tokens.
    padded = torch.tensor([0, 8, 8, 24, 24])
    assert torch.equal(
        split_sequence(tokens, 2, 1, cu_seqlens=padded), split_sequence(tokens, 2, 1, cu_seqlens=cu)
    )


def test_lengths_that_do_not_split_into_2cp_chunks_raise():
    with pytest.raises(ParallelConfigError, match=r"\[6\].*2 \* cp = 4"):
        split_sequence(torch.zeros(1, 14), 2, 0, cu_seqlens=torch.tensor([0, 8, 14]))
    with pytest.raises(ParallelConfigError, match="sequence length 10"):
        position_ids(10, 2, 1)
    with pytest.raises(ParallelConfigError, match="cp_rank=2"):
        split_sequence(torch.zeros(1, 8), 2, 2)


def nccl_cases() -> dict:
    # fp32 on the GPU: the plain torch block path against the float64 reference.
    state = initialize(cp=torch.distributed.get_world_size())
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {}
    for name in ("causal_gqa", "packed_gqa"):
        for method in ("ring", "all_gather"):
            cp, rank = state.size("cp"), state.rank_in("cp")
            q, k, v, grad, cu, causal = make_inputs(name, cp)
            local = [
                split_sequence(t, cp, rank, dim=2, cu_seqlens=cu).cuda().requires_grad_()
                for t in (q, k, v)
            ]
            out = context_parallel_attention(
                *local, state.group("cp"), causal=causal, cu_seqlens=cu, method=method
            )
            (out * split_sequence(grad, cp, rank, dim=2, cu_seqlens=cu).cuda()).sum().backward()
            group = state.group("cp")
            got = [gather_sequence(out.detach(), group, dim=2, cu_seqlens=cu).cpu()]
            got += [gather_sequence(t.grad, group, dim=2, cu_seqlens=cu).cpu() for t in local]
            expected = reference(q, k, v, grad, cu, causal)
            results[f"{name}/{method}"] = max(
                float((a - b).abs().max()) for a, b in zip(got, expected)
            )
    return results


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_context_parallel_attention_on_nccl_equals_single_process():
    for errors in run_distributed(nccl_cases, 2, backend="nccl"):
        assert max(errors.values()) < 1e-4, errors


def test_long_blocks_are_processed_in_row_slices_with_the_same_result():
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 12, 8, generator=generator)
    k, v = (torch.randn(2, 2, 10, 8, generator=generator) for _ in range(2))
    mask = torch.rand(12, 10, generator=generator) > 0.3
    mask[:, 0] = True
    whole = block_forward(q, k, v, mask, 0.35)
    sliced = block_forward(q, k, v, mask, 0.35, max_score_elements=2 * 4 * 10 * 5)
    for a, b in zip(whole, sliced):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    grad, out, lse = torch.randn(q.shape, generator=generator), whole[0], whole[1]
    delta = (grad * out).sum(-1)
    grads = block_backward(q, k, v, mask, 0.35, lse, grad, delta, out)
    sliced_grads = block_backward(
        q, k, v, mask, 0.35, lse, grad, delta, out, max_score_elements=2 * 4 * 10 * 5
    )
    # The whole block against autograd through plain softmax attention.
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    scores = (q64 @ k64.repeat_interleave(2, 1).transpose(-1, -2) * 0.35).masked_fill(
        ~mask, float("-inf")
    )
    expected = torch.softmax(scores, -1) @ v64.repeat_interleave(2, 1)
    (expected * grad.double()).sum().backward()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for got, sliced_got, ref in zip(grads, sliced_grads, (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sliced_got, got, atol=1e-6, rtol=1e-6)
