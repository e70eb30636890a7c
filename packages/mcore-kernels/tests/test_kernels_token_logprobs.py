"""Token log-probs and entropy: Triton (interpreted on CPU) against the torch reference and plain
``log_softmax(...).gather``; vocabulary-parallel shards on a real 2-rank gloo group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _kernels_spawn import run_ranks

import mcore_kernels
from mcore_kernels import token_logprobs
from mcore_kernels.errors import (
    KernelDeviceError,
    KernelDtypeError,
    KernelShapeError,
    KernelValueError,
)
from mcore_kernels.reference import token_logprobs_reference
from mcore_kernels.testing import HostReadProbe

# Every CPU test here may run the Triton kernels through the interpreter (see conftest.py).
pytestmark = pytest.mark.interpreter

ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}
# (leading shape, vocab, dtype, temperature): the vocabularies of GPT-2 and Qwen2.5 with few
# rows, an odd vocabulary smaller than one chunk, leading dims, temperature below one.
CASES = [
    ((3,), 50257, torch.float32, 1.0),
    ((2,), 151936, torch.bfloat16, 1.0),
    ((2, 3), 1000, torch.bfloat16, 0.7),
    ((5,), 37, torch.float16, 2.0),
]


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _logits_and_targets(lead, vocab, dtype, seed=0, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*lead, vocab, generator=gen) * scale).to(dtype)
    targets = torch.randint(0, vocab, lead, generator=gen)
    return logits, targets


def _log_softmax_gather(logits, targets, temperature=1.0):
    log_probs = torch.log_softmax(logits.double() / temperature, dim=-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _entropy(logits, temperature=1.0):
    log_probs = torch.log_softmax(logits.double() / temperature, dim=-1)
    return -(log_probs.exp() * torch.nan_to_num(log_probs, neginf=0.0)).sum(-1)


@pytest.mark.parametrize(("lead", "vocab", "dtype", "temperature"), CASES, ids=str)
def test_triton_matches_reference_values_and_gradients(
    triton_backend, lead, vocab, dtype, temperature
):
    logits, targets = _logits_and_targets(lead, vocab, dtype)
    flat_logits = logits.view(-1, vocab)
    flat_logits[0, : vocab // 3] = -float("inf")  # a masked vocabulary span
    targets.view(-1)[-1] = -100  # an ignored row
    gen = torch.Generator().manual_seed(1)
    grad_logprobs = torch.randn(lead, generator=gen)
    grad_entropy = torch.randn(lead, generator=gen)

    def run(fn):
        leaf = logits.clone().requires_grad_()
        logprobs, entropy = fn(leaf, targets, temperature=temperature, return_entropy=True)
        torch.autograd.backward([logprobs, entropy], [grad_logprobs, grad_entropy])
        return logprobs, entropy, leaf.grad

    logprobs, entropy, grad = run(token_logprobs)
    logprobs_ref, entropy_ref, grad_ref = run(token_logprobs_reference)
    assert logprobs.dtype == torch.float32 and logprobs.shape == lead
    torch.testing.assert_close(logprobs, logprobs_ref, atol=ATOL[dtype], rtol=1e-5)
    torch.testing.assert_close(entropy, entropy_ref, atol=ATOL[dtype], rtol=1e-5)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.float(), grad_ref.float(), atol=1e-5, rtol=1e-2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logprobs_and_entropy_match_log_softmax_gather(monkeypatch, backend):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", backend)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits, targets = _logits_and_targets((4, 2), 300, torch.float32, seed=2)
    logprobs, entropy = token_logprobs(logits, targets, temperature=0.5, return_entropy=True)
    torch.testing.assert_close(
        logprobs.double(), _log_softmax_gather(logits, targets, 0.5), atol=2e-5, rtol=1e-5
    )
    torch.testing.assert_close(entropy.double(), _entropy(logits, 0.5), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_large_logits_do_not_overflow(monkeypatch, backend):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", backend)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits, targets = _logits_and_targets((3,), 5000, torch.float32, seed=3, scale=3e4)
    logprobs, entropy = token_logprobs(logits, targets, temperature=0.3, return_entropy=True)
    assert torch.isfinite(logprobs).all() and torch.isfinite(entropy).all()
    torch.testing.assert_close(
        logprobs.double(), _log_softmax_gather(logits, targets, 0.3), atol=1e-2, rtol=1e-6
    )
    torch.testing.assert_close(entropy.double(), _entropy(logits, 0.3), atol=1e-3, rtol=1e-4)


def test_reference_gradients_pass_gradcheck_in_float64():
    logits, targets = _logits_and_targets((3,), 11, torch.float64, seed=4, scale=1.0)
    targets[2] = -100
    logits.requires_grad_()

    def both(x):
        return token_logprobs_reference(x, targets, temperature=0.8, return_entropy=True)

    assert torch.autograd.gradcheck(both, (logits,))


def test_ignored_rows_give_zero_and_no_gradient(triton_backend):
    logits, targets = _logits_and_targets((4,), 70, torch.float32, seed=5)
    targets[1] = -1
    logits.requires_grad_()
    logprobs, entropy = token_logprobs(logits, targets, return_entropy=True, ignore_index=-1)
    assert logprobs[1] == 0 and entropy[1] == 0
    (logprobs.sum() + entropy.sum()).backward()
    assert torch.equal(logits.grad[1], torch.zeros(70))
    assert logits.grad[0].abs().sum() > 0


def test_triton_rows_are_bitwise_batch_invariant(triton_backend):
    logits, targets = _logits_and_targets((6,), 9000, torch.bfloat16, seed=6)
    full = token_logprobs(logits, targets, return_entropy=True)
    few = token_logprobs(logits[:2], targets[:2], return_entropy=True)
    assert torch.equal(full[0][:2], few[0]) and torch.equal(full[1][:2], few[1])


def test_strided_inputs_match_contiguous_copies(triton_backend):
    logits, targets = _logits_and_targets((6,), 90, torch.float32, seed=15)
    strided_logits = logits[::2]  # a row stride of two rows
    strided_targets = torch.stack([targets, targets], dim=1)[::2, 0]  # element stride of four
    assert not strided_targets.is_contiguous()
    expected = token_logprobs(strided_logits.contiguous(), strided_targets.contiguous())
    torch.testing.assert_close(
        token_logprobs(strided_logits, strided_targets), expected, atol=0, rtol=0
    )


def test_only_logprobs_are_returned_without_entropy(triton_backend):
    logits, targets = _logits_and_targets((2, 2), 50, torch.float32, seed=7)
    logprobs = token_logprobs(logits, targets)
    assert isinstance(logprobs, torch.Tensor) and logprobs.shape == (2, 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"targets": torch.zeros(3, dtype=torch.long)}, KernelShapeError, "targets.shape=(3,)"),
        ({"targets": torch.zeros(2, 4)}, KernelDtypeError, "targets.dtype=torch.float32"),
        (
            {"logits": torch.zeros(2, 4, 10, dtype=torch.int64)},
            KernelDtypeError,
            "logits.dtype=torch.int64",
        ),
        ({"targets": torch.full((2, 4), 10)}, KernelValueError, "targets holds 10"),
        ({"targets": torch.full((2, 4), -5)}, KernelValueError, "targets holds -5"),
        ({"temperature": 0.0}, KernelValueError, "temperature=0.0"),
        ({"temperature": float("inf")}, KernelValueError, "temperature=inf"),
        ({"ignore_index": 1.5}, KernelValueError, "ignore_index=1.5"),
        (
            {"targets": torch.zeros(2, 4, dtype=torch.long, device="meta")},
            KernelDeviceError,
            "targets on meta",
        ),
    ],
)
def test_bad_arguments_raise_typed_errors_naming_them(kwargs, error, fragment):
    args = {
        "logits": torch.zeros(2, 4, 10),
        "targets": torch.zeros(2, 4, dtype=torch.long),
        "temperature": 1.0,
        "ignore_index": -100,
    }
    args.update(kwargs)
    with pytest.raises(error) as info:
        token_logprobs(
            args["logits"],
            args["targets"],
            temperature=args["temperature"],
            ignore_index=args["ignore_index"],
            check_targets=True,
        )
    assert fragment in str(info.value)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_of_range_target_gives_nan_by_default_and_raises_when_checked(monkeypatch, backend):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", backend)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits, targets = _logits_and_targets((4,), 40, torch.float32, seed=13)
    bad = targets.clone()
    bad[2], bad[3] = 40, -7
    with pytest.raises(KernelValueError, match="targets holds 40"):
        token_logprobs(logits, bad, check_targets=True)
    logprobs, entropy = token_logprobs(logits, bad, return_entropy=True)
    assert torch.isnan(logprobs[2:]).all()
    torch.testing.assert_close(
        logprobs[:2], token_logprobs(logits[:2], targets[:2]), atol=0, rtol=0
    )
    # The entropy does not depend on the target: it stays finite and right.
    torch.testing.assert_close(entropy, _entropy(logits).float(), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_default_call_reads_nothing_back_to_the_host(monkeypatch, backend):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", backend)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits, targets = _logits_and_targets((2, 3), 300, torch.float32, seed=21)
    targets[0, 1] = -100
    leaf = logits.clone().requires_grad_()
    with HostReadProbe() as probe:
        logprobs, entropy = token_logprobs(leaf, targets, temperature=0.9, return_entropy=True)
        (logprobs.sum() + entropy.sum()).backward()
    assert probe.seen == []
    with HostReadProbe() as probe:
        token_logprobs(logits, targets, check_targets=True)
    # The probe does see the opt-in check's read.
    assert probe.seen


def test_public_names_are_exported():
    assert mcore_kernels.token_logprobs is token_logprobs
    assert mcore_kernels.reference.token_logprobs_reference is token_logprobs_reference


# --- vocabulary-parallel shards on a real gloo group ------------------------------------------

_TP_VOCAB = 2 * 1500
_TP_TIMEOUT_S = 120.0


def _vocab_parallel_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    logits, targets = _logits_and_targets((5,), _TP_VOCAB, torch.float32, seed=9)
    logits[0, :2000] = -float("inf")  # rank 0's shard is entirely masked in this row
    targets[1] = 10  # target on rank 0
    targets[2] = _TP_VOCAB - 1  # target on the last rank
    targets[3] = -100
    return logits, targets


def _vocab_parallel_rank(rank: int, world: int) -> dict[str, tuple[torch.Tensor, ...]]:
    logits, targets = _vocab_parallel_inputs()
    shard = _TP_VOCAB // world
    observed = {}
    for backend in ("torch", "triton"):
        os.environ["MCORE_KERNELS_BACKEND"] = backend
        local = logits[:, rank * shard : (rank + 1) * shard].clone().requires_grad_()
        logprobs, entropy = token_logprobs(
            local, targets, temperature=0.9, group=dist.group.WORLD, return_entropy=True
        )
        (logprobs.sum() + 0.5 * entropy.sum()).backward()
        observed[backend] = (logprobs.detach(), entropy.detach(), local.grad)
    return observed


def test_vocab_parallel_shards_match_full_vocabulary_on_gloo():
    world = 2
    gathered = run_ranks(
        _vocab_parallel_rank,
        world,
        start_method="forkserver",
        timeout_s=_TP_TIMEOUT_S,
        env={"TRITON_INTERPRET": "1"},
    )
    logits, targets = _vocab_parallel_inputs()
    full = logits.clone().requires_grad_()
    logprobs, entropy = token_logprobs_reference(
        full, targets, temperature=0.9, return_entropy=True
    )
    (logprobs.sum() + 0.5 * entropy.sum()).backward()
    shard = _TP_VOCAB // world
    for rank in range(world):
        for backend in ("torch", "triton"):
            got_logprobs, got_entropy, got_grad = gathered[rank][backend]
            torch.testing.assert_close(got_logprobs, logprobs.detach(), atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(got_entropy, entropy.detach(), atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(
                got_grad, full.grad[:, rank * shard : (rank + 1) * shard], atol=1e-6, rtol=1e-4
            )
    # Fixed-order combination: every rank holds bitwise the same result.
    for backend in ("torch", "triton"):
        assert torch.equal(gathered[0][backend][0], gathered[1][backend][0])
        assert torch.equal(gathered[0][backend][1], gathered[1][backend][1])


# --- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_triton_matches_reference_at_qwen_vocabulary():
    logits, targets = (
        t.cuda() for t in _logits_and_targets((64,), 151936, torch.bfloat16, seed=10)
    )
    logits.requires_grad_()
    logprobs, entropy = token_logprobs(logits, targets, return_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    grad = logits.grad
    logits.grad = None
    logprobs_ref, entropy_ref = token_logprobs_reference(logits, targets, return_entropy=True)
    (logprobs_ref.sum() + entropy_ref.sum()).backward()
    torch.testing.assert_close(logprobs, logprobs_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(entropy, entropy_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(grad.float(), logits.grad.float(), atol=1e-5, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_allocates_no_float32_copy_of_the_logits():
    logits, targets = (
        t.cuda() for t in _logits_and_targets((1024,), 151936, torch.bfloat16, seed=11)
    )
    token_logprobs(logits, targets, return_entropy=True)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    token_logprobs(logits, targets, return_entropy=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 0.01 * logits.numel() * logits.element_size()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_backward_allocates_one_logits_sized_buffer():
    logits, targets = (
        t.cuda() for t in _logits_and_targets((1024,), 151936, torch.bfloat16, seed=12)
    )
    logits.requires_grad_()
    token_logprobs(logits, targets).sum().backward()
    logits.grad = None
    logprobs = token_logprobs(logits, targets).sum()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    logprobs.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 1.01 * logits.numel() * logits.element_size()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_skips_the_host_sync_and_replays():
    logits, targets = (t.cuda() for t in _logits_and_targets((16,), 5000, torch.bfloat16, seed=14))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        token_logprobs(logits, targets)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = token_logprobs(logits, targets)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(
        captured, token_logprobs_reference(logits, targets), atol=1e-4, rtol=1e-5
    )
