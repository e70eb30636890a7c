"""The torch.library ops of row_argmax, decode_step_metadata, attention_o_proj, the SSD state
update and the MoE row kernels, and the torch-only SSD convolutions, under ``torch.compile``.

``torch.library.opcheck`` checks each op's schema, fake implementation and AOT dispatch; each
public entry point compiled with ``fullgraph=True`` is then compared with its torch reference
on the torch dispatch and on the Triton kernels (interpreted on CPU), and on the GPU with
Inductor.
"""

from __future__ import annotations

import os

import pytest
import torch

from mcore_kernels.decode_attention_gemv import attention_o_proj
from mcore_kernels.decode_step_metadata import decode_step_metadata
from mcore_kernels.moe import reference as moe_reference
from mcore_kernels.moe.rows import aligned_rows, capacity_rows, dropless_rows, padded_slots
from mcore_kernels.reference import (
    attention_o_proj_reference,
    decode_step_metadata_reference,
    row_argmax_reference,
)
from mcore_kernels.row_argmax import row_argmax
from mcore_kernels.ssd import (
    causal_conv1d,
    causal_conv1d_update,
    ssd_state_update,
    ssd_state_update_reference,
)

pytestmark = pytest.mark.interpreter

OPS = torch.ops.mcore_kernels
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["torch", "triton"])
def dispatch(request, monkeypatch):
    if request.param == "triton" and not _INTERPRETED:
        pytest.skip("the Triton dispatch on CPU needs TRITON_INTERPRET=1")
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", request.param)
    return request.param


def _logits(device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3000, generator=generator)
    logits[1, 7] = logits[1, 2900] = 50.0  # a tie: the first index wins
    return logits.to(device)


def _metadata(device: str):
    block_tables = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    positions = torch.tensor([0, 5, 17, 23])
    table_rows = torch.tensor([3, 0, 2, 1])
    return block_tables.to(device), positions.to(device), table_rows.to(device), 4


def _attention(device: str):
    generator = torch.Generator().manual_seed(4)
    tokens, heads, kv_heads, dim, block_size, n = 2, 4, 2, 16, 4, 24
    q = torch.randn(tokens, heads, dim, generator=generator)
    k_cache, v_cache = (
        torch.randn(7, block_size, kv_heads, dim, generator=generator) for _ in "kv"
    )
    tables = torch.tensor([[1, 3, 5], [2, 4, 6]], dtype=torch.int32)
    lens = torch.tensor([9, 12], dtype=torch.int32)
    weight = torch.randn(n, heads * dim, generator=generator) * (heads * dim) ** -0.5
    bias, residual = (
        torch.randn(n, generator=generator),
        torch.randn(tokens, n, generator=generator),
    )
    tensors = [t.to(device) for t in (q, k_cache, v_cache, tables, lens, weight, bias, residual)]
    return tensors, dim**-0.5


def _state_update(device: str):
    generator = torch.Generator().manual_seed(1)
    batch, heads, head_dim, groups, size = 3, 4, 8, 2, 16
    state = torch.randn(5, heads, head_dim, size, generator=generator)
    x = torch.randn(batch, heads, head_dim, generator=generator)
    dt = torch.rand(batch, heads, generator=generator) * 0.5 + 0.1
    decay = -torch.rand(heads, generator=generator) - 0.1
    b, c = (torch.randn(batch, groups, size, generator=generator) for _ in "bc")
    skip = torch.randn(heads, generator=generator)
    indices = torch.tensor([4, -1, 1])
    return [t.to(device) for t in (state, x, dt, decay, b, c, skip, indices)]


def _routing(device: str, experts: int = 4, assignments: int = 30):
    generator = torch.Generator().manual_seed(2)
    chosen = torch.randint(0, experts, (assignments,), generator=generator)
    order = torch.argsort(chosen, stable=True)
    counts = torch.bincount(chosen, minlength=experts)
    return chosen.to(device), order.to(device), counts.to(device)


def _rows_cases(device: str):
    experts, order, counts = _routing(device)
    return [
        (dropless_rows, moe_reference.dropless_rows_reference, (order, counts)),
        (capacity_rows, moe_reference.capacity_rows_reference, (experts, order, counts, 5)),
        (
            lambda e, o, c: aligned_rows(e, o, c, 4),
            lambda e, o, c: moe_reference.aligned_rows_reference(e, o, c, 4, None),
            (experts, order, counts),
        ),
        (
            lambda e, o, c: aligned_rows(e, o, c, 4, capacity=3),
            lambda e, o, c: moe_reference.aligned_rows_reference(e, o, c, 4, 3),
            (experts, order, counts),
        ),
        # Key 3 (the last) holds the assignments to skip.
        (padded_slots, moe_reference.padded_slots_reference, (experts, order, counts, 4)),
    ]


# --- opcheck: schema, fake tensors, AOT dispatch (torch dispatch) --------------------------------


def test_opcheck_row_argmax_and_decode_step_metadata():
    torch.library.opcheck(OPS.row_argmax, (_logits("cpu"),))
    torch.library.opcheck(OPS.decode_step_metadata, _metadata("cpu"))


def test_opcheck_attention_o_proj():
    (q, k, v, tables, lens, weight, bias, residual), scale = _attention("cpu")
    args = (q, k, v, tables, lens, weight, bias, scale, residual, None, None, None, None)
    torch.library.opcheck(OPS.attention_o_proj, args)
    torch.library.opcheck(OPS.attention_o_proj, (*args[:6], None, scale, None, 8, 8, 4, False))


def test_opcheck_ssd_state_update():
    state, *rest = _state_update("cpu")
    torch.library.opcheck(OPS.ssd_state_update_, (state, *rest))
    without_skip = [*rest[:5], None, rest[6]]
    torch.library.opcheck(OPS.ssd_state_update_, (state.clone(), *without_skip))


def test_opcheck_moe_row_ops():
    experts, order, counts = _routing("cpu")
    torch.library.opcheck(OPS.moe_dropless_rows, (order, counts))
    torch.library.opcheck(OPS.moe_capacity_rows, (experts, order, counts, 5))
    torch.library.opcheck(OPS.moe_aligned_rows, (experts, order, counts, 4, None))
    torch.library.opcheck(OPS.moe_aligned_rows, (experts, order, counts, 4, 3))
    torch.library.opcheck(OPS.moe_padded_slots, (experts, order, counts, 4))


# --- compiled entry points against the torch references --------------------------------------------


def _check_compiled(device: str, backend: str) -> None:
    logits = _logits(device)
    compiled = torch.compile(row_argmax, backend=backend, fullgraph=True)
    assert torch.equal(compiled(logits), row_argmax_reference(logits))
    metadata = _metadata(device)
    compiled = torch.compile(decode_step_metadata, backend=backend, fullgraph=True)
    for got, expected in zip(
        compiled(*metadata), decode_step_metadata_reference(*metadata), strict=True
    ):
        assert torch.equal(got, expected)
    (q, k, v, tables, lens, weight, bias, residual), scale = _attention(device)

    def attend(q, weight, bias, residual):
        return attention_o_proj(
            q, k, v, tables, lens, weight, bias, scale=scale, residual=residual, split_size=8
        )

    got = torch.compile(attend, backend=backend, fullgraph=True)(q, weight, bias, residual)
    expected = attention_o_proj_reference(
        q, k, v, tables, lens, weight, bias, scale=scale, residual=residual
    )
    # The GPU's attention products run on tensor cores (bf16 parts of float32 values).
    tolerance = 1e-4 if device == "cpu" else 5e-3
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    state, *rest = _state_update(device)
    expected_state = state.clone()
    expected = ssd_state_update_reference(expected_state, *rest[:6], state_indices=rest[6])

    def update(state, x, dt, decay, b, c, skip, indices):
        return ssd_state_update(state, x, dt, decay, b, c, skip, state_indices=indices)

    got = torch.compile(update, backend=backend, fullgraph=True)(state, *rest)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)
    for function, reference, inputs in _rows_cases(device):
        compiled = torch.compile(function, backend=backend, fullgraph=True)
        for value, want in zip(compiled(*inputs), reference(*inputs), strict=True):
            assert torch.equal(value, want)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_ops_match_the_references(dispatch, backend):
    _check_compiled("cpu", backend)


def _conv_problem(device: str):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(11, 6, generator=generator)
    weight = torch.randn(6, 4, generator=generator)
    bias = torch.randn(6, generator=generator)
    init = torch.randn(2, 6, 3, generator=generator)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    return [t.to(device) for t in (x, weight, bias, init, cu)]


def _check_conv_compiled(device: str, backend: str | None) -> None:
    # Torch-only functions: torch.compile traces them (no custom op hides them from fusion).
    x, weight, bias, init, cu = _conv_problem(device)

    def prefill(x, weight, bias, init):
        return causal_conv1d(x, weight, bias, cu_seqlens=cu, initial_states=init)

    options = {"fullgraph": True} | ({"backend": backend} if backend else {})
    got = torch.compile(prefill, **options)(x, weight, bias, init)
    for value, want in zip(got, prefill(x, weight, bias, init), strict=True):
        torch.testing.assert_close(value, want, atol=1e-5, rtol=1e-5)
    slots = torch.randn(3, 6, 3, device=device)
    eager_slots = slots.clone()
    indices = torch.tensor([2, 0], device=device)

    def step(x, slots, weight, bias):
        return causal_conv1d_update(x, slots, weight, bias, state_indices=indices)

    got = torch.compile(step, **options)(x[:2], slots, weight, bias)
    torch.testing.assert_close(got, step(x[:2], eager_slots, weight, bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(slots, eager_slots)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_causal_conv1d_matches_eager(backend):
    _check_conv_compiled("cpu", backend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_inductor_compiles_the_decode_and_row_ops_with_reference_values(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    _check_compiled("cuda", "inductor")
    _check_conv_compiled("cuda", None)
