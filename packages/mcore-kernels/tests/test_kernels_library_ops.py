"""The torch.library ops of the paged MLA attention, the RoPE cache write, the SSD scan and the
batch-invariant matmul and packed attention.

``torch.library.opcheck`` checks each op's schema, fake implementation, autograd registration
and AOT dispatch; then each public entry point compiled with ``fullgraph=True`` is compared with
its torch reference (values and gradients), on the torch dispatch and on the Triton kernels
(interpreted on CPU, compiled on GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from mcore_kernels import moe
from mcore_kernels.batch_invariant.attention import packed_attention_batch_invariant
from mcore_kernels.batch_invariant.matmul import (
    bmm_batch_invariant,
    grouped_mm_batch_invariant,
    matmul_reference,
)
from mcore_kernels.mla_paged_attention import paged_mla_attention
from mcore_kernels.reference import paged_mla_attention_reference, rotary_kv_write_reference
from mcore_kernels.rotary_kv_write import rotary_kv_write
from mcore_kernels.ssd import ssd_scan, ssd_scan_reference

OPS = torch.ops.mcore_kernels
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _device() -> str:
    return "cuda" if torch.cuda.is_available() and not _INTERPRETED else "cpu"


def _mla_inputs(device: str, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(0)
    tokens, heads, rank, rope = 3, 4, 16, 8
    q_latent = torch.randn(tokens, heads, rank, generator=generator)
    q_rope = torch.randn(tokens, heads, rope, generator=generator)
    cache = torch.randn(6, 4, rank + rope, generator=generator)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    lens = torch.tensor([3, 8, 5], dtype=torch.int32)
    floats = [t.to(device, dtype) for t in (q_latent, q_rope, cache)]
    return (*floats, tables.to(device), lens.to(device))


def _rope_inputs(device: str, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(1)
    tokens, q_heads, kv_heads, dim = 3, 4, 2, 8
    q, k, v = (
        torch.randn(tokens, h, dim, generator=generator).to(device, dtype)
        for h in (q_heads, kv_heads, kv_heads)
    )
    angles = torch.rand(tokens, dim // 2, generator=generator).to(device)
    caches = [torch.randn(4, 2, kv_heads, dim, generator=generator).to(device, dtype) for _ in "kv"]
    slots = torch.tensor([0, 3, 5], device=device)
    return q, k, v, angles.cos(), angles.sin(), caches[0], caches[1], slots


def _ssd_inputs(device: str):
    generator = torch.Generator().manual_seed(2)
    tokens, heads, head_dim, groups, state = 40, 2, 16, 1, 16
    x = torch.randn(tokens, heads, head_dim, generator=generator)
    dt = torch.rand(tokens, heads, generator=generator) * 0.5 + 0.1
    decay = -torch.rand(heads, generator=generator) - 0.1
    b, c = (torch.randn(tokens, groups, state, generator=generator) for _ in "bc")
    skip = torch.randn(heads, generator=generator)
    init = torch.randn(2, heads, head_dim, state, generator=generator)
    cu_seqlens = torch.tensor([0, 17, 40], dtype=torch.int32, device=device)
    floats = [t.to(device) for t in (x, dt, decay, b, c, skip, init)]
    return floats, cu_seqlens


def _value_and_grads(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    loss = sum(
        (o.float() * torch.linspace(-1, 1, o.numel(), device=o.device).view_as(o)).sum()
        for o in outputs
    )
    loss.backward()
    return outputs, [leaf.grad for leaf in leaves]


def _assert_close_lists(actual, expected, **tolerances):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, **tolerances)


# --- opcheck: schema, fake tensors, autograd registration, AOT dispatch (torch dispatch) --------


def test_opcheck_paged_mla_attention_and_rotary_kv_write():
    mla = _mla_inputs("cpu")
    torch.library.opcheck(OPS.paged_mla_attention, (*mla, 0.3, 256))
    torch.library.opcheck(OPS.rotary_kv_write, _rope_inputs("cpu"))


def test_opcheck_ssd_scan_forward_and_backward():
    (x, dt, decay, b, c, skip, init), cu_seqlens = _ssd_inputs("cpu")
    torch.library.opcheck(OPS.ssd_scan_fwd, (x, dt, decay, b, c, skip, init, cu_seqlens, 16))
    torch.library.opcheck(OPS.ssd_scan_fwd, (x, dt, decay, b, c, None, None, cu_seqlens, 16))


def test_opcheck_batch_invariant_matmul_and_packed_attention():
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(20, 8, generator=generator)
    b = torch.randn(3, 8, 5, generator=generator)
    torch.library.opcheck(OPS.batch_invariant_matmul, (a, b, torch.tensor([4, 4, 17]), 0))
    torch.library.opcheck(OPS.batch_invariant_matmul, (a[:18], b, None, 6))
    q = torch.randn(9, 4, 8, generator=generator)
    k, v = (torch.randn(9, 2, 8, generator=generator) for _ in "kv")
    torch.library.opcheck(OPS.packed_attention_batch_invariant, (q, k, v, [0, 4, 4, 9], 0.3))


# --- compiled entry points against the torch references ------------------------------------------


@pytest.fixture(params=["torch", "triton"])
def dispatch(request, monkeypatch):
    if request.param == "triton" and _device() == "cpu" and not _INTERPRETED:
        pytest.skip("the Triton dispatch on CPU needs TRITON_INTERPRET=1")
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", request.param)
    return request.param


def check_mla_and_rope(device: str, backend, scale: float = 1.0) -> None:
    """Compiled paged MLA attention and RoPE cache write against their references.

    ``scale`` multiplies the tolerances (GPU products run on tensor cores).
    """
    mla = _mla_inputs(device)
    compiled = torch.compile(
        lambda *args: paged_mla_attention(*args, scale=0.3), backend=backend, fullgraph=True
    )
    torch.testing.assert_close(
        compiled(*mla),
        paged_mla_attention_reference(*mla, scale=0.3),
        atol=1e-5 * scale,
        rtol=1.3e-6 * scale,
    )
    rope = _rope_inputs(device)
    expected_caches = [t.clone() for t in rope[5:7]]
    expected = rotary_kv_write_reference(*rope[:5], *expected_caches, rope[7])
    actual = torch.compile(rotary_kv_write, backend=backend, fullgraph=True)(*rope)
    # The kernel rounds like the unfused ops up to a fused multiply-add (see its module).
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)
    _assert_close_lists(list(rope[5:7]), expected_caches, atol=1e-6, rtol=1e-6)


def test_compiled_paged_mla_attention_and_rotary_kv_write_match_the_references(dispatch):
    check_mla_and_rope(_device(), "aot_eager")


def check_ssd_scan(device: str, backend, scale: float = 1.0) -> None:
    """Compiled SSD scan against its reference, values and gradients."""
    floats, cu_seqlens = _ssd_inputs(device)

    def scan(x, dt, decay, b, c, skip, init):
        return ssd_scan(
            x, dt, decay, b, c, skip, chunk_size=16, cu_seqlens=cu_seqlens, initial_states=init
        )

    def reference(x, dt, decay, b, c, skip, init):
        return ssd_scan_reference(
            x, dt, decay, b, c, skip, chunk_size=16, cu_seqlens=cu_seqlens, initial_states=init
        )

    compiled = torch.compile(scan, backend=backend, fullgraph=True)
    outputs, grads = _value_and_grads(compiled, *floats)
    expected_outputs, expected_grads = _value_and_grads(reference, *floats)
    tolerance = 1e-4 * scale
    _assert_close_lists(list(outputs), list(expected_outputs), atol=tolerance, rtol=tolerance)
    _assert_close_lists(grads, expected_grads, atol=10 * tolerance, rtol=10 * tolerance)


def test_compiled_ssd_scan_matches_the_reference_values_and_gradients(dispatch):
    check_ssd_scan(_device(), "aot_eager")


def check_batch_invariant_matmuls(device: str, backend, scale: float = 1.0) -> None:
    """Compiled batch-invariant grouped and batched matmuls: values and gradients."""
    tolerance = 1e-4 * scale
    generator = torch.Generator().manual_seed(4)
    a = torch.randn(20, 32, generator=generator).to(device)
    b = torch.randn(3, 32, 16, generator=generator).to(device)
    # The groups cover every row: the Triton path does not write rows after the last group end.
    ends = torch.tensor([4, 4, 20], device=device)

    def grouped(a, b):
        return grouped_mm_batch_invariant(a, b, ends)

    compiled = torch.compile(grouped, backend=backend, fullgraph=True)
    outputs, grads = _value_and_grads(compiled, a, b)
    torch.testing.assert_close(
        outputs[0], matmul_reference(a, b, ends), atol=tolerance, rtol=tolerance
    )
    # The backward is ordinary GEMMs: autograd of the plain grouped product is the oracle.
    _, expected_grads = _value_and_grads(lambda a, b: _plain_grouped(a, b, ends), a, b)
    _assert_close_lists(grads, expected_grads, atol=tolerance, rtol=tolerance)

    def batched(a, b):
        return bmm_batch_invariant(a[:18].view(3, 6, 32), b)

    outputs, grads = _value_and_grads(torch.compile(batched, backend=backend, fullgraph=True), a, b)
    expected_outputs, expected_grads = _value_and_grads(
        lambda a, b: torch.bmm(a[:18].view(3, 6, 32), b), a, b
    )
    torch.testing.assert_close(outputs[0], expected_outputs[0], atol=tolerance, rtol=tolerance)
    _assert_close_lists(grads, expected_grads, atol=tolerance, rtol=tolerance)


def test_compiled_batch_invariant_ops_match_the_references_values_and_gradients(dispatch):
    check_batch_invariant_matmuls(_device(), "aot_eager")


def _plain_grouped(a, b, ends):
    pieces, start = [], 0
    for g, end in enumerate(ends.tolist()):
        pieces.append(a[start:end] @ b[g])
        start = end
    pieces.append(a.new_zeros(a.shape[0] - start, b.shape[2]))
    return torch.cat(pieces)


def check_packed_attention(device: str, backend, scale: float = 1.0) -> None:
    """Compiled batch-invariant packed attention against causal SDPA: values and gradients."""
    tolerance = 1e-4 * scale
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(9, 4, 16, generator=generator).to(device)
    k, v = (torch.randn(9, 2, 16, generator=generator).to(device) for _ in "kv")
    bounds = [(0, 4), (4, 9)]

    def packed(q, k, v):
        return packed_attention_batch_invariant(q, k, v, bounds, scale=0.25)

    def sdpa(q, k, v):
        pieces = []
        for start, end in bounds:
            sq, sk, sv = (t[start:end].transpose(0, 1) for t in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(
                sq, sk, sv, is_causal=True, scale=0.25, enable_gqa=True
            )
            pieces.append(out.transpose(0, 1))
        return torch.cat(pieces)

    outputs, grads = _value_and_grads(
        torch.compile(packed, backend=backend, fullgraph=True), q, k, v
    )
    expected_outputs, expected_grads = _value_and_grads(sdpa, q, k, v)
    torch.testing.assert_close(outputs[0], expected_outputs[0], atol=tolerance, rtol=tolerance)
    _assert_close_lists(grads, expected_grads, atol=tolerance, rtol=tolerance)


def test_compiled_packed_attention_matches_causal_sdpa_values_and_gradients(dispatch):
    check_packed_attention(_device(), "aot_eager")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_inductor_compiles_the_registered_ops_with_reference_values():
    mla = _mla_inputs("cuda", torch.bfloat16)
    compiled = torch.compile(lambda *args: paged_mla_attention(*args, scale=0.3), fullgraph=True)
    torch.testing.assert_close(
        compiled(*mla), paged_mla_attention_reference(*mla, scale=0.3), atol=2e-2, rtol=2e-2
    )
    floats, cu_seqlens = _ssd_inputs("cuda")

    def scan(*args):
        return ssd_scan(*args[:6], chunk_size=16, cu_seqlens=cu_seqlens, initial_states=args[6])

    def reference(*args):
        return ssd_scan_reference(
            *args[:6], chunk_size=16, cu_seqlens=cu_seqlens, initial_states=args[6]
        )

    outputs, grads = _value_and_grads(torch.compile(scan, fullgraph=True), *floats)
    expected_outputs, expected_grads = _value_and_grads(reference, *floats)
    _assert_close_lists(list(outputs), list(expected_outputs), atol=1e-3, rtol=1e-3)
    _assert_close_lists(grads, expected_grads, atol=1e-2, rtol=1e-2)


# --- MoE: the ops of the autograd functions (backward: recomputation + the Function's own) ------


def _moe_problem(device: str):
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(3, 16, generator=generator).to(device)
    rows = torch.tensor([0, 1, -1, 2, 0, 1], device=device)
    slots = torch.tensor([0, 4, 1, 5, 3, -1], device=device)
    fillers = torch.tensor([0, 2, -1, 4, 1, 3], device=device)
    y = torch.randn(6, 16, generator=generator).to(device)
    weights = torch.rand(3, 2, generator=generator).to(device)
    gate_up = torch.randn(6, 32, generator=generator).to(device)
    row_weights = torch.rand(6, generator=generator).to(device)
    logits = torch.randn(5, 4, generator=generator).to(device)
    return x, rows, slots, fillers, y, weights, gate_up, row_weights, logits


def test_opcheck_moe_ops():
    x, rows, slots, fillers, y, weights, gate_up, row_weights, logits = _moe_problem("cpu")
    torch.library.opcheck(OPS.moe_swiglu, (gate_up,))
    torch.library.opcheck(OPS.moe_weighted_swiglu, (gate_up, row_weights))
    torch.library.opcheck(OPS.moe_permute_tokens, (x, rows, slots, 2))
    torch.library.opcheck(OPS.moe_unpermute_combine, (y, weights, slots, fillers))
    torch.library.opcheck(OPS.moe_unpermute_sum, (y, slots, fillers, 2))
    torch.library.opcheck(OPS.moe_router, (logits, 2, "softmax", None, True, 1.0))


def check_moe_functions(device: str, backend, scale: float = 1.0) -> None:
    """Compiled MoE autograd functions against their references: values and gradients."""
    ref = moe.reference
    tolerance = 1e-5 * scale
    x, rows, slots, fillers, y, weights, gate_up, row_weights, logits = _moe_problem(device)
    cases = [
        (moe.swiglu, ref.swiglu_reference, (gate_up,)),
        (moe.weighted_swiglu, ref.weighted_swiglu_reference, (gate_up, row_weights)),
        (
            lambda x: moe.permute_tokens(x, rows, slots, 2),
            lambda x: ref.permute_tokens_reference(x, rows),
            (x,),
        ),
        (
            lambda y, w: moe.unpermute_combine(y, w, slots, fillers),
            lambda y, w: ref.unpermute_combine_reference(y, w, slots),
            (y, weights),
        ),
        (
            lambda y: moe.unpermute_sum(y, slots, fillers, 2),
            lambda y: ref.unpermute_sum_reference(y, slots, 2),
            (y,),
        ),
        (
            lambda z: moe.moe_router(z, 2)[::2],
            lambda z: ref.moe_router_reference(z, 2)[::2],
            (logits,),
        ),
    ]
    for function, reference, inputs in cases:
        compiled = torch.compile(function, backend=backend, fullgraph=True)
        outputs, grads = _value_and_grads(compiled, *inputs)
        expected_outputs, expected_grads = _value_and_grads(reference, *inputs)
        _assert_close_lists(list(outputs), list(expected_outputs), atol=tolerance, rtol=tolerance)
        _assert_close_lists(grads, expected_grads, atol=tolerance, rtol=tolerance)


def test_compiled_moe_functions_match_the_references_values_and_gradients(dispatch):
    check_moe_functions(_device(), "aot_eager")


def check_routed_experts(device: str, backend, scale: float = 1.0) -> None:
    """Compiled routed experts against eager, values and gradients (Triton dispatch: the torch
    one runs the per-expert references directly, not the autograd functions)."""
    tolerance = 1e-5 * scale
    generator = torch.Generator().manual_seed(7)
    tokens, hidden, ffn, experts, top_k = 8, 32, 16, 3, 2
    x = torch.randn(tokens, hidden, generator=generator).to(device)
    weights = torch.rand(tokens, top_k, generator=generator).to(device)
    gate_up = (torch.randn(experts, 2 * ffn, hidden, generator=generator) * 0.2).to(device)
    down = (torch.randn(experts, hidden, ffn, generator=generator) * 0.2).to(device)
    chosen = torch.tensor([0, 2])[torch.randint(0, 2, (tokens * top_k,), generator=generator)]
    order = torch.argsort(chosen, stable=True).to(device)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
    counts = torch.bincount(chosen, minlength=experts).to(device)
    offsets = counts.cumsum(0).to(torch.int32)
    cases = [
        (
            lambda a, b, c, d: moe.routed_experts(a, b, c, d, order, inverse, offsets),
            (x, weights, gate_up, down),
        ),
    ]
    for function, inputs in cases:
        compiled = torch.compile(function, backend=backend, fullgraph=True)
        outputs, grads = _value_and_grads(compiled, *inputs)
        expected_outputs, expected_grads = _value_and_grads(function, *inputs)
        _assert_close_lists(list(outputs), list(expected_outputs), atol=tolerance, rtol=tolerance)
        _assert_close_lists(grads, expected_grads, atol=tolerance, rtol=tolerance)


def test_compiled_routed_experts_match_eager_values_and_gradients(monkeypatch):
    if _device() == "cpu" and not _INTERPRETED:
        pytest.skip("the Triton dispatch on CPU needs TRITON_INTERPRET=1")
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    check_routed_experts(_device(), "aot_eager")
