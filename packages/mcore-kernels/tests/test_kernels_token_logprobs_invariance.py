"""Batch invariance of token_logprobs: a row's log-prob is bitwise the same in any batch.

A rollout engine scores a token in a batch of sampled rows, a trainer scores it again at its
position in a packed sequence, with the entropy on; in batch-invariant RL both must agree to the
last bit. Rows whose byte length is not a multiple of 16 (vocabularies 26 and 4099 in bf16)
start at a different offset from a 16-byte boundary at every position, which is what a kernel
that sums a row in address order gets wrong. Each row is compared with the same row scored
alone: at every position of batches of several sizes, with and without the entropy, in a view
that starts off a 16-byte boundary, and (on the GPU) replayed in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from mcore_kernels import token_logprobs
from mcore_kernels.reference import token_logprobs_reference

pytestmark = pytest.mark.interpreter

# (vocab, dtype): one chunk (the GRPO tests' character vocabulary), several chunks with the
# row start cycling through every offset below the 16-byte boundary, odd float32 rows.
CASES = [(26, torch.bfloat16), (4099, torch.bfloat16), (1031, torch.float32)]
ROWS = 3


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(vocab, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(ROWS, vocab, generator=gen) * 4).to(dtype)
    # A masked span, a tie for the maximum, and a ramp over 200 nats (a logit far above an
    # earlier one of its lane): the special cases, both ways through the kernel.
    logits[0, 3:9] = -float("inf")
    logits[1, 5] = logits[1, 11] = logits[1].max() + 1
    logits[2] += torch.linspace(-100.0, 100.0, vocab)
    targets = torch.randint(0, vocab, (ROWS,), generator=gen)
    filler = (torch.randn(16, vocab, generator=gen) * 4).to(dtype)
    return logits.to(device), targets.to(device), filler.to(device)


def _check_invariance(vocab, dtype, device):
    logits, targets, filler = _inputs(vocab, dtype, device, seed=vocab)
    alone = [token_logprobs(logits[i : i + 1].clone(), targets[i : i + 1]) for i in range(ROWS)]
    alone_entropy = [
        token_logprobs(logits[i : i + 1].clone(), targets[i : i + 1], return_entropy=True)[1]
        for i in range(ROWS)
    ]
    reference = token_logprobs_reference(logits, targets)
    torch.testing.assert_close(torch.cat(alone), reference, atol=2e-5, rtol=1e-5)
    filler_targets = torch.zeros(16, dtype=targets.dtype, device=device)
    # Row i of the batch sits at position before + i: every start offset modulo 16 bytes, in
    # batches of 3 to 13 rows; the leading-dims and the off-boundary view once each.
    for before in range(8):
        after = 3 if before % 2 else 0
        batch = torch.cat([filler[:before], logits, filler[before : before + after]])
        ids = torch.cat([filler_targets[:before], targets, filler_targets[:after]])
        rows = slice(before, before + ROWS)
        plain = token_logprobs(batch, ids)
        with_entropy, entropy = token_logprobs(batch, ids, return_entropy=True)
        results = [plain[rows], with_entropy[rows]]
        if before == 5:
            results.append(token_logprobs(batch[None], ids[None])[0, rows])
            results.append(token_logprobs(batch[before:], ids[before:])[:ROWS])
        for i in range(ROWS):
            for got in results:
                assert torch.equal(got[i : i + 1], alone[i]), (before, i)
            # The entropy's weighted sum cancels terms of both signs: the most sensitive to
            # the order of a row's sums.
            assert torch.equal(entropy[rows][i : i + 1], alone_entropy[i]), (before, i)


@pytest.mark.parametrize(("vocab", "dtype"), CASES)
def test_a_row_gives_the_same_bits_at_any_position_batch_size_and_entropy_flag(
    triton_backend, vocab, dtype
):
    _check_invariance(vocab, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("vocab", "dtype"), [*CASES, (50257, torch.bfloat16)])
def test_cuda_a_row_gives_the_same_bits_at_any_position_batch_size_and_entropy_flag(vocab, dtype):
    _check_invariance(vocab, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [26, 50257])
def test_cuda_graph_replay_gives_the_eager_bits(vocab):
    logits, targets, filler = _inputs(vocab, torch.bfloat16, "cuda", seed=vocab + 1)
    batch = torch.cat([filler[:5], logits])
    ids = torch.cat([torch.zeros(5, dtype=targets.dtype, device="cuda"), targets])
    eager = token_logprobs(batch, ids)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        token_logprobs(batch, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = token_logprobs(batch, ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    alone = token_logprobs(logits[1:2].clone(), targets[1:2])
    assert torch.equal(captured[6:7], alone)
