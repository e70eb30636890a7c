"""Every public kernel under ``torch.compile``: same values and gradients as eager, one graph.

Each entry point is compiled with ``fullgraph=True`` (any graph break fails) on the ``eager`` and
``aot_eager`` backends, with the torch reference dispatch and with the Triton kernels
(interpreted on CPU), and compared against the same call run eagerly. Inductor, the compiler
that choked on a traced Triton kernel on GPU, is checked on CPU too.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _kernels_spawn import run_ranks

from mcore_kernels import rms_norm, token_logprobs
from mcore_kernels.comm import fused_rs_add_rmsnorm_ag
from mcore_kernels.errors import KernelShapeError, KernelValueError
from mcore_kernels.paged_attention import paged_attention
from mcore_kernels.rotary import rotary_embedding
from mcore_kernels.swiglu import swiglu_pair
from mcore_kernels.tensor_ops import masked_update, merge, slice_after

# The Triton dispatch runs the kernels through the interpreter (see conftest.py).
pytestmark = pytest.mark.interpreter

BACKENDS = ["eager", "aot_eager"]
# The op's backward adds the two gradients of ``x + residual`` in float32 before rounding once,
# where eager autograd rounds each to bfloat16 first: a unit in the last place apart.
TOLERANCES = {torch.float32: {}, torch.bfloat16: {"atol": 4e-3, "rtol": 1.6e-2}}


@pytest.fixture(params=["torch", "triton"])
def dispatch(request, monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", request.param)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(outputs, inputs, seed=0):
    """Gradients of a fixed random projection of ``outputs`` with respect to ``inputs``."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(
        (out.float() * torch.randn(out.shape, generator=generator).to(out.device)).sum()
        for out in outputs
    )
    return torch.autograd.grad(total, inputs)


def _leaves(*tensors):
    """Fresh leaves that keep each input's strides (``clone`` preserves a permuted layout)."""
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def _rms_norm_block(x, weight, residual):
    y, hidden = rms_norm(x, weight, 1e-5, residual=residual)
    return y, hidden, rms_norm(hidden * 0.5, weight)


def _rms_norm_inputs(dtype):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, generator=generator).to(dtype)
    weight = (torch.rand(40, generator=generator) + 0.5).to(dtype)
    residual = torch.randn(2, 3, 40, generator=generator).to(dtype)
    return x, weight, residual


def _token_logprobs_block(logits, targets):
    logprobs, entropy = token_logprobs(logits, targets, temperature=0.8, return_entropy=True)
    return logprobs, entropy, token_logprobs(logits * 2, targets)


def _token_logprobs_inputs(dtype):
    generator = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 3, 300, generator=generator) * 3).to(dtype)
    logits[0, 2, :50] = -float("inf")  # a masked part of the vocabulary
    targets = torch.randint(0, 300, (2, 3), generator=generator)
    targets[1, 0] = -100  # an ignored row
    return logits, targets


def _check_matches_eager(block, inputs, backend, *, fullgraph=True, atol=None, rtol=None):
    eager_inputs, compiled_inputs = _leaves(*inputs), _leaves(*inputs)
    differentiable = [t for t in eager_inputs if t.requires_grad]
    expected = block(*eager_inputs)
    expected_grads = _grads(expected, differentiable)
    compiled = torch.compile(block, backend=backend, fullgraph=fullgraph)
    got = compiled(*compiled_inputs)
    got_grads = _grads(got, [t for t in compiled_inputs if t.requires_grad])
    for value, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(value, reference, atol=atol, rtol=rtol)
    for grad, reference in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_compiles_in_one_graph_with_eager_values_and_gradients(dispatch, backend, dtype):
    _check_matches_eager(_rms_norm_block, _rms_norm_inputs(dtype), backend, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_compiles_in_one_graph_with_eager_values_and_gradients(
    dispatch, backend, dtype
):
    _check_matches_eager(
        _token_logprobs_block, _token_logprobs_inputs(dtype), backend, **TOLERANCES[dtype]
    )


def _rotary_swiglu_block(qkv, positions, gate, up, dim=8):
    # RoPE tables from integer positions (not differentiated), a strided query slice of a fused
    # projection and a contiguous key, as the GPT layer does.
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, device=qkv.device).float() / dim))
    angles = positions[..., None].float() * inv_freq
    cos, sin = angles.cos(), angles.sin()
    q = qkv[..., : 3 * dim].unflatten(-1, (3, dim))
    k = qkv[..., 3 * dim : 5 * dim].unflatten(-1, (2, dim)).contiguous()
    return rotary_embedding(q, cos, sin), rotary_embedding(k, cos, sin), swiglu_pair(gate, up)


def _rotary_swiglu_inputs(dtype):
    generator = torch.Generator().manual_seed(7)
    return (
        torch.randn(2, 5, 40, generator=generator).to(dtype),
        torch.randint(0, 2048, (2, 5), generator=generator),
        torch.randn(2, 5, 12, generator=generator).to(dtype),
        torch.randn(2, 5, 12, generator=generator).to(dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rotary_and_swiglu_compile_in_one_graph_with_eager_values_and_gradients(
    dispatch, backend, dtype
):
    _check_matches_eager(
        _rotary_swiglu_block, _rotary_swiglu_inputs(dtype), backend, **TOLERANCES[dtype]
    )


def _checked_token_logprobs(logits, targets):
    return token_logprobs(logits, targets, check_targets=True)


def test_compiled_token_logprobs_raises_the_typed_error_on_an_out_of_range_target(dispatch):
    logits, targets = _token_logprobs_inputs(torch.float32)
    compiled = torch.compile(_checked_token_logprobs, backend="aot_eager", fullgraph=True)
    compiled(logits, targets)
    targets[0, 0] = 300
    with pytest.raises(KernelValueError, match="targets holds 300"):
        compiled(logits, targets)


def test_compiled_rms_norm_raises_the_typed_error_on_a_mismatched_weight(dispatch):
    x, weight, residual = _rms_norm_inputs(torch.float32)
    compiled = torch.compile(_rms_norm_block, backend="eager")
    with pytest.raises(KernelShapeError, match=r"weight\.shape"):
        compiled(x, weight[:-1], residual)


def _tensor_ops_block(inp, pos, out, a, b, merged_out, states, idx, new_states):
    slice_after(inp, pos, out)
    merge(a, b, pos, merged_out)
    merge(a, b, pos)
    masked_update(states, idx, new_states)


def _tensor_ops_inputs(position):
    generator = torch.Generator().manual_seed(3)
    return [
        torch.randn(7, 3, generator=generator),
        torch.tensor([position]),
        torch.zeros(4, 3),
        torch.randn(6, 3, generator=generator),
        torch.randn(5, 3, generator=generator),
        torch.full((8, 3), -1.0),
        torch.randn(5, 2, 2, generator=generator),
        torch.tensor([3, -1, 0]),
        torch.randn(3, 2, 2, generator=generator),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_ops_compile_in_one_graph_and_write_like_eager(dispatch, backend):
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(_tensor_ops_block, backend=counter, fullgraph=True)
    # A new position is a new device value, not a new graph.
    for position in (2, 5):
        expected, got = _tensor_ops_inputs(position), _tensor_ops_inputs(position)
        _tensor_ops_block(*expected)
        compiled(*got)
        for value, reference in zip(got, expected, strict=True):
            assert torch.equal(value, reference)
    assert counter.frame_count == 1


def _paged_attention_block(q, k_cache, v_cache, block_tables, context_lens):
    return (paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=0.3) * 2,)


def _paged_attention_inputs():
    generator = torch.Generator().manual_seed(4)
    k_cache = torch.randn(9, 4, 2, 16, generator=generator)
    v_cache = torch.randn(9, 4, 2, 16, generator=generator)
    q = torch.randn(3, 4, 16, generator=generator)
    block_tables = torch.randperm(9, generator=generator)[:6].reshape(3, 2).int()
    context_lens = torch.tensor([1, 5, 8], dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, context_lens


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_compiles_in_one_graph_with_eager_values(dispatch, backend):
    inputs = _paged_attention_inputs()
    compiled = torch.compile(_paged_attention_block, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(*inputs)[0], _paged_attention_block(*inputs)[0])


def _every_kernel(x, weight, logits, targets, inp, pos, out, *attention):
    y = rms_norm(x, weight)
    logprobs = token_logprobs(logits, targets)
    slice_after(inp, pos, out)
    return y, logprobs, paged_attention(*attention, scale=0.3)


def test_traced_graph_holds_opaque_ops_and_no_triton_kernel(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    x, weight, _ = _rms_norm_inputs(torch.float32)
    logits, targets = _token_logprobs_inputs(torch.float32)
    ops = _tensor_ops_inputs(1)[:3]
    compiled = torch.compile(_every_kernel, backend=record, fullgraph=True)
    compiled(x, weight, logits, targets, *ops, *_paged_attention_inputs())
    targets_called = [str(node.target) for node in graphs[0].graph.nodes]
    called = {name.split(".")[1] for name in targets_called if name.startswith("mcore_kernels.")}
    assert called == {"rms_norm_fwd", "token_logprobs_fwd", "slice_after_", "paged_attention"}
    assert not any("triton" in name for name in targets_called)
    graphs.clear()
    compiled = torch.compile(_rotary_swiglu_block, backend=record, fullgraph=True)
    compiled(*_rotary_swiglu_inputs(torch.float32))
    targets_called = [str(node.target) for node in graphs[0].graph.nodes]
    called = {name.split(".")[1] for name in targets_called if name.startswith("mcore_kernels.")}
    assert called == {"rotary_embedding", "swiglu_pair_fwd"}
    assert not any("triton" in name for name in targets_called)


# --- process groups: vocabulary-parallel log-probs and the fused TP communication -------------


def _vocab_parallel_block(logits, targets):
    logprobs, entropy = token_logprobs(
        logits, targets, temperature=0.9, group=dist.group.WORLD, return_entropy=True
    )
    return logprobs, entropy


def _fused_block(partial, residual, weight, normed_out, residual_out):
    first = fused_rs_add_rmsnorm_ag(partial, residual, weight, 1e-6, None)
    fused_rs_add_rmsnorm_ag(partial, residual, weight, 1e-6, None, out=(normed_out, residual_out))
    return first


def _compiled_on_rank(rank: int, world: int) -> dict[str, list[bool]]:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 2 * 64, generator=generator) * 3
    targets = torch.tensor([3, 70, -100, 127])
    local = logits[:, rank * 64 : (rank + 1) * 64]
    partial = torch.randn(5, 16, generator=torch.Generator().manual_seed(rank)).bfloat16()
    residual = torch.randn(5, 16, generator=generator).bfloat16()
    weight = torch.rand(16, generator=generator).bfloat16() + 0.5
    observed: dict[str, list[bool]] = {}
    # One graph serves both dispatches: the op picks the kernel when it runs.
    compiled = torch.compile(_vocab_parallel_block, backend="aot_eager", fullgraph=True)
    for backend in ("torch", "triton"):
        os.environ["MCORE_KERNELS_BACKEND"] = backend
        eager_logits, compiled_logits = _leaves(local, local)
        expected = _vocab_parallel_block(eager_logits, targets)
        expected_grad = _grads(expected, [eager_logits])[0]
        got = compiled(compiled_logits, targets)
        got_grad = _grads(got, [compiled_logits])[0]
        observed[f"logprobs_{backend}"] = [
            torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected, strict=True)
        ] + [torch.allclose(got_grad, expected_grad, atol=1e-6)]
    expected_fused = _fused_block(partial, residual, weight, *torch.empty(2, 5, 16).bfloat16())
    outs = torch.empty(2, 5, 16).bfloat16()
    compiled_fused = torch.compile(_fused_block, backend="aot_eager", fullgraph=True)
    got_fused = compiled_fused(partial, residual, weight, outs[0], outs[1])
    observed["fused"] = [
        torch.equal(got_fused[0], expected_fused[0]),
        torch.equal(got_fused[1], expected_fused[1]),
        torch.equal(outs[0], expected_fused[0]),
        torch.equal(outs[1], expected_fused[1]),
    ]
    return observed


def test_process_group_kernels_compile_in_one_graph_on_gloo():
    for rank, observed in enumerate(
        run_ranks(_compiled_on_rank, 2, start_method="forkserver", timeout_s=120)
    ):
        for key, checks in observed.items():
            assert all(checks), (rank, key, checks)


# --- Inductor ----------------------------------------------------------------------------------


def _training_block(x, weight, residual, logits, targets):
    y, hidden = rms_norm(x, weight, 1e-5, residual=residual)
    logprobs, entropy = token_logprobs(logits, targets, return_entropy=True)
    return y * 2, hidden + 1, logprobs - 1, entropy


def test_inductor_compiles_rotary_and_swiglu_with_eager_values_and_gradients(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check_matches_eager(_rotary_swiglu_block, _rotary_swiglu_inputs(torch.float32), "inductor")


@pytest.mark.parametrize(
    ("dispatch_name", "layout"),
    [("triton", "contiguous"), ("triton", "permuted"), ("torch", "permuted")],
)
def test_inductor_compiles_kernels_with_eager_values_and_gradients(
    monkeypatch, dispatch_name, layout
):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", dispatch_name)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, weight, residual = _rms_norm_inputs(torch.float32)
    logits, targets = _token_logprobs_inputs(torch.float32)
    if layout == "permuted":
        # The ops return contiguous tensors whatever the input layout, as their fakes promise.
        x = x.permute(2, 0, 1).contiguous().permute(1, 2, 0)
        logits, targets = logits[:, :-1], targets[:, :-1]
    inputs = (x, weight, residual, logits, targets)
    _check_matches_eager(_training_block, inputs, "inductor")


# --- GPU: the Inductor path that failed on an H200 -----------------------------------------


def _decoder_like_block(x, weight, residual, logits, targets, qkv, positions):
    y, hidden = rms_norm(x, weight, 1e-5, residual=residual)
    z = rms_norm(hidden, weight, 1e-5)
    logprobs, entropy = token_logprobs(logits, targets, temperature=0.9, return_entropy=True)
    q, k, act = _rotary_swiglu_block(qkv, positions, y[..., :512], hidden[..., :512], 128)
    return y * 2, z, logprobs - 1, entropy, q, k, act


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_inductor_compiles_triton_kernels_with_eager_values_and_gradients():
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(4, 64, 2048, generator=generator).bfloat16().cuda()
    weight = (torch.rand(2048, generator=generator) + 0.5).bfloat16().cuda()
    residual = torch.randn(4, 64, 2048, generator=generator).bfloat16().cuda()
    logits = (torch.randn(4, 64, 32000, generator=generator) * 3).bfloat16().cuda()
    targets = torch.randint(0, 32000, (4, 64), generator=generator).cuda()
    qkv = torch.randn(4, 64, 5 * 128, generator=generator).bfloat16().cuda()
    positions = torch.randint(0, 4096, (4, 64), generator=generator).cuda()
    inputs = (x, weight, residual, logits[:, :-1], targets[:, :-1], qkv, positions)
    _check_matches_eager(_decoder_like_block, inputs, "inductor", **TOLERANCES[torch.bfloat16])


def test_backend_decision_traces_without_looking_the_triton_package_up(monkeypatch):
    # Dynamo refuses to trace importlib.util.find_spec (moe.routed_experts broke its graph on
    # CUDA): the decision reads whether Triton is installed from a value looked up at import.
    import importlib.util

    from mcore_kernels._backend import use_triton

    def refuse(*args, **kwargs):
        raise AssertionError("the backend decision looked the triton package up")

    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setattr(importlib.util, "find_spec", refuse)
    x = torch.ones(3)
    compiled = torch.compile(
        lambda t: t * 2 if use_triton(t) else t + 1, backend="eager", fullgraph=True
    )
    torch.testing.assert_close(compiled(x), x * 2)
