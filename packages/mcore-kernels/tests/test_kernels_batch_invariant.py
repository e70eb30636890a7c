"""Batch-invariant GEMMs, attention and mode: bitwise-equal rows whatever the batch."""

import os
import threading

import pytest
import torch
import torch.nn.functional as F

from mcore_kernels import KernelShapeError, token_logprobs
from mcore_kernels.batch_invariant import (
    SPLIT_SIZE,
    attention_batch_invariant,
    batch_invariant_mode,
    bmm_batch_invariant,
    grouped_mm_batch_invariant,
    is_batch_invariant,
    linear_batch_invariant,
    packed_attention_batch_invariant,
)
from mcore_kernels.reference import rms_norm_reference

BATCHES = (1, 3, 64)
BACKENDS = ("torch", pytest.param("triton", marks=pytest.mark.interpreter))


@pytest.fixture(autouse=True)
def _single_thread(monkeypatch):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", request.param)
    return request.param


def _rows_invariant(fn, x):
    """fn(x[:m]) equals the first m rows of fn(x) for every batch size, also shuffled."""
    full = fn(x)
    for rows in BATCHES:
        assert torch.equal(fn(x[:rows]), full[:rows]), f"rows={rows}"
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(3))
    assert torch.equal(fn(x[order]), full[order]), "shuffled"
    return full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_equal_for_every_batch_size_and_order(backend, dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(67, 80, generator=generator).to(dtype)
    weight = torch.randn(72, 80, generator=generator).to(dtype)
    bias = torch.randn(72, generator=generator).to(dtype)
    full = _rows_invariant(lambda rows: linear_batch_invariant(rows, weight, bias), x)
    expected = F.linear(x.double(), weight.double(), bias.double())
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(full.double(), expected, atol=tolerance, rtol=1e-2)


def test_cpu_blas_is_not_batch_invariant_which_is_why_the_reference_chunks():
    # The premise of the torch reference: CPU BLAS takes another path for a few rows.
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=generator)
    weight = torch.randn(320, 256, generator=generator)
    full = x @ weight.T
    assert any(not torch.equal(x[:rows] @ weight.T, full[:rows]) for rows in (1, 2, 3))


def test_bmm_rows_equal_for_every_batch_size(backend):
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(3, 64, 40, generator=generator)
    b = torch.randn(3, 40, 24, generator=generator)
    full = bmm_batch_invariant(a, b)
    torch.testing.assert_close(full, torch.bmm(a, b), atol=1e-4, rtol=1e-4)
    for rows in BATCHES:
        assert torch.equal(bmm_batch_invariant(a[:, :rows], b), full[:, :rows])


def test_grouped_mm_equals_dense_rows_of_each_group(backend):
    generator = torch.Generator().manual_seed(2)
    a = torch.randn(70, 48, generator=generator)
    b = torch.randn(3, 48, 40, generator=generator)
    ends = torch.tensor([10, 10, 70], dtype=torch.int32)
    grouped = grouped_mm_batch_invariant(a, b, ends)
    expected = torch.cat([a[:10] @ b[0], a[10:] @ b[2]])
    torch.testing.assert_close(grouped, expected, atol=1e-4, rtol=1e-4)
    # A row's value is its dense product's, whichever group sizes surround it.
    assert torch.equal(grouped[10:], mm_rows(a[10:], b[2]))
    assert torch.equal(grouped[:10], mm_rows(a[:10], b[0]))


def mm_rows(a, b):
    return linear_batch_invariant(a, b.t())


def test_grouped_mm_backward_matches_dense_gradients(backend):
    generator = torch.Generator().manual_seed(4)
    a = torch.randn(12, 16, generator=generator, requires_grad=True)
    b = torch.randn(2, 16, 8, generator=generator, requires_grad=True)
    ends = torch.tensor([5, 12], dtype=torch.int32)
    grouped_mm_batch_invariant(a, b, ends).square().sum().backward()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.cat([a2[:5] @ b2[0], a2[5:] @ b2[1]]).square().sum().backward()
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_mode_routes_linear_matmul_and_restores_on_exit(backend):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(5, 32, generator=generator)
    weight = torch.randn(16, 32, generator=generator)
    assert not is_batch_invariant()
    with pytest.raises(RuntimeError), batch_invariant_mode():
        assert is_batch_invariant()
        assert torch.equal(F.linear(x, weight), linear_batch_invariant(x, weight))
        assert torch.equal(x @ weight.T, linear_batch_invariant(x, weight))
        assert torch.equal(torch.mm(x, weight.T), linear_batch_invariant(x, weight))
        raise RuntimeError("leaves the block")
    assert not is_batch_invariant()


def test_mode_routes_bmm_and_grouped_mm_and_is_thread_local(backend):
    generator = torch.Generator().manual_seed(10)
    a = torch.randn(2, 6, 16, generator=generator)
    b = torch.randn(2, 16, 8, generator=generator)
    rows = a.flatten(0, 1)
    ends = torch.tensor([4, 12], dtype=torch.int32)
    seen = []
    with batch_invariant_mode():
        assert torch.equal(torch.bmm(a, b), bmm_batch_invariant(a, b))
        assert torch.equal(a @ b, bmm_batch_invariant(a, b))
        if hasattr(torch, "_grouped_mm"):
            routed = torch._grouped_mm(rows, b, offs=ends)
            assert torch.equal(routed, grouped_mm_batch_invariant(rows, b, ends))
        worker = threading.Thread(target=lambda: seen.append(is_batch_invariant()))
        worker.start()
        worker.join()
    assert seen == [False]


def test_linear_rejects_mismatched_shapes():
    with pytest.raises(KernelShapeError, match=r"weight\.shape"):
        linear_batch_invariant(torch.randn(2, 8), torch.randn(4, 7))


def _paged_layout(lengths, block_size, heads, dim, generator):
    """Scatter the keys/values of each sequence into a shuffled paged cache."""
    blocks_per = [-(-n // block_size) for n in lengths]
    total = sum(blocks_per) + 1
    physical = torch.randperm(total - 1, generator=generator) + 1
    k_cache = torch.randn(total, block_size, heads, dim, generator=generator)
    v_cache = torch.randn(total, block_size, heads, dim, generator=generator)
    tables, start = [], 0
    for count in blocks_per:
        tables.append(physical[start : start + count].tolist())
        start += count
    width = max(blocks_per)
    tables = [row + [0] * (width - len(row)) for row in tables]
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32)


def test_attention_token_values_independent_of_the_launch(backend):
    generator = torch.Generator().manual_seed(6)
    lengths = [SPLIT_SIZE + 37, 5, 1, 9]
    heads, kv_heads, dim, block = 2, 1, 16, 16
    k_cache, v_cache, tables = _paged_layout(lengths, block, kv_heads, dim, generator)
    # Queries: the last tokens of the long sequence (two splits) and every token of the others.
    queries = [(0, n) for n in (SPLIT_SIZE - 1, SPLIT_SIZE + 36)]
    queries += [(s, i) for s, n in enumerate(lengths) if s for i in range(n)]
    seq = torch.tensor([s for s, _ in queries])
    context = torch.tensor([i + 1 for _, i in queries], dtype=torch.int32)
    q = torch.randn(seq.shape[0], heads, dim, generator=generator)

    def run(index):
        return attention_batch_invariant(
            q[index], k_cache, v_cache, context[index], scale=0.25, block_tables=tables[seq[index]]
        )

    everything = torch.arange(seq.shape[0])
    full = run(everything)
    for rows in BATCHES:
        assert torch.equal(run(everything[-rows:]), full[-rows:]), f"rows={rows}"
    order = torch.randperm(seq.shape[0], generator=generator)
    assert torch.equal(run(order), full[order])
    # A decode-like launch: the last token of each sequence alone, then with the others.
    last = torch.tensor([1, 2 + 5 - 1, 2 + 5, 2 + 5 + 1 + 9 - 1])
    assert torch.equal(run(last[:1]), full[last[:1]])
    assert torch.equal(run(last), full[last])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_equals_paged_attention_bitwise(backend, dtype):
    generator = torch.Generator().manual_seed(7)
    lengths = [11, 3, 35]
    heads, kv_heads, dim, block = 2, 1, 16, 8
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=generator).to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=generator).to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=generator).to(dtype)
    bounds, start = [], 0
    for n in lengths:
        bounds.append((start, start + n))
        start += n
    packed = packed_attention_batch_invariant(q, k, v, bounds, scale=0.3)
    reference = torch.cat(
        [
            F.scaled_dot_product_attention(
                *(t[s:e].transpose(0, 1)[None] for t in (q, k, v)),
                is_causal=True,
                scale=0.3,
                enable_gqa=True,
            )[0].transpose(0, 1)
            for s, e in bounds
        ]
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(packed, reference, atol=tolerance, rtol=tolerance)
    # The same keys/values in a paged cache, each sequence's blocks scattered.
    k_cache, v_cache, tables = _paged_layout(lengths, block, kv_heads, dim, generator)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    for s, (lo, hi) in enumerate(bounds):
        for pos in range(hi - lo):
            blk = int(tables[s, pos // block])
            k_cache[blk, pos % block] = k[lo + pos]
            v_cache[blk, pos % block] = v[lo + pos]
    seq = torch.tensor([s for s, n in enumerate(lengths) for _ in range(n)])
    context = torch.tensor([i + 1 for n in lengths for i in range(n)], dtype=torch.int32)
    paged = attention_batch_invariant(
        q, k_cache, v_cache, context, scale=0.3, block_tables=tables[seq]
    )
    assert torch.equal(paged, packed)


@pytest.mark.parametrize(
    "bounds", [((0, 5), (5, 12)), ((0, 4), (4, 8), (8, 12))], ids=["lengths", "equal_run"]
)
def test_packed_attention_backward_matches_sdpa(backend, bounds):
    generator = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(12, 2, 16, generator=generator, requires_grad=True) for _ in range(3))
    packed_attention_batch_invariant(q, k, v, list(bounds), scale=0.25).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.cat(
        [
            F.scaled_dot_product_attention(
                *(t[s:e].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, scale=0.25
            )[0].transpose(0, 1)
            for s, e in bounds
        ]
    ).sum().backward()
    for got, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(got, t.grad)


def test_packed_attention_rejects_bounds_that_do_not_cover_the_rows():
    q = torch.randn(6, 2, 16)
    with pytest.raises(KernelShapeError, match="bounds"):
        packed_attention_batch_invariant(q, q, q, [(0, 3), (4, 6)], scale=1.0)


def test_row_wise_norm_and_log_softmax_are_batch_invariant(backend):
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(64, 96, generator=generator)
    weight = torch.randn(96, generator=generator)
    _rows_invariant(lambda rows: rms_norm_reference(rows, weight, 1e-6), x)
    logits = torch.randn(64, 300, generator=generator)
    targets = torch.randint(0, 300, (64,), generator=generator)
    full = token_logprobs(logits, targets)
    for rows in BATCHES:
        assert torch.equal(token_logprobs(logits[:rows], targets[:rows]), full[:rows])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(2048, 2048), (8192, 2048), (151936, 896)])
def test_gpu_bf16_linear_rows_equal_for_every_batch_size(shape):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiled kernels only")
    generator = torch.Generator(device="cuda").manual_seed(0)
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, device="cuda", generator=generator)
    x = torch.randn(300, in_features, device="cuda", generator=generator)
    weight, x = weight.bfloat16(), x.bfloat16()
    full = linear_batch_invariant(x, weight)
    for rows in (1, 3, 64, 256):
        assert torch.equal(linear_batch_invariant(x[:rows], weight), full[:rows])
    order = torch.randperm(300, device="cuda", generator=generator)
    assert torch.equal(linear_batch_invariant(x[order], weight), full[order])
    torch.testing.assert_close(full.float(), (x.float() @ weight.float().T), atol=0.5, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_packed_attention_equals_paged_attention():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiled kernels only")
    generator = torch.Generator().manual_seed(7)
    lengths = [700, 5, 1300]
    heads, kv_heads, dim, block = 8, 2, 64, 16
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, h, dim, generator=generator).bfloat16().cuda()
        for h in (heads, kv_heads, kv_heads)
    )
    bounds, start = [], 0
    for n in lengths:
        bounds.append((start, start + n))
        start += n
    packed = packed_attention_batch_invariant(q, k, v, bounds, scale=0.125)
    k_cache, v_cache, tables = _paged_layout(lengths, block, kv_heads, dim, generator)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    for s, (lo, hi) in enumerate(bounds):
        positions = torch.arange(hi - lo)
        blocks = tables[s].long()[positions // block]
        k_cache[blocks, positions % block] = k[lo:hi].cpu()
        v_cache[blocks, positions % block] = v[lo:hi].cpu()
    seq = torch.tensor([s for s, n in enumerate(lengths) for _ in range(n)])
    context = torch.tensor([i + 1 for n in lengths for i in range(n)], dtype=torch.int32)
    paged = attention_batch_invariant(
        q,
        k_cache.cuda(),
        v_cache.cuda(),
        context.cuda(),
        scale=0.125,
        block_tables=tables[seq].cuda(),
    )
    assert torch.equal(paged, packed)
    last = (torch.tensor(lengths).cumsum(0) - 1).cuda()
    decode = attention_batch_invariant(
        q[last],
        k_cache.cuda(),
        v_cache.cuda(),
        context.cuda()[last],
        scale=0.125,
        block_tables=tables[seq].cuda()[last],
    )
    assert torch.equal(decode, packed[last])
