"""Every registered ``torch.ops.mcore_kernels`` op compiled by Inductor on the GPU.

Each check compiles public entry points with ``fullgraph=True`` and a backend that hands the
graph to Inductor and records the ``mcore_kernels`` ops of every graph Inductor compiles (the
forward and, after AOT autograd, the backward; in-place ops appear there wrapped in
``auto_functionalized``). Values (and gradients where the op has a backward) are compared with
the torch references or eager calls. Each check declares the ops it must reach; a test that
needs no GPU requires that the declarations together name every op registered in the
namespace, so a new op needs a check here.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mcore_kernels

_NAMESPACE = "mcore_kernels"
_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _ops_of(graph_module: torch.fx.GraphModule) -> set[str]:
    found = set()
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        candidates = [node.target]
        # Functionalised in-place ops: auto_functionalized(op, **kwargs).
        if isinstance(node.target, torch._ops.HigherOrderOperator) and node.args:
            candidates.append(node.args[0])
        for target in candidates:
            if isinstance(target, torch._ops.OpOverload) and target.namespace == _NAMESPACE:
                found.add(target._schema.name.split("::")[1])
    return found


def recording_inductor(seen: set[str]) -> Callable[..., Any]:
    """A ``torch.compile`` backend: Inductor, recording the mcore_kernels ops it compiles."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(graph_module, example_inputs, **kwargs):
        seen.update(_ops_of(graph_module))
        return compile_fx_inner(graph_module, example_inputs, **kwargs)

    def backend(graph_module, example_inputs):
        seen.update(_ops_of(graph_module))
        return compile_fx(graph_module, example_inputs, inner_compile=inner)

    return backend


def _registered_ops() -> set[str]:
    for module in pkgutil.walk_packages(mcore_kernels.__path__, f"{_NAMESPACE}."):
        importlib.import_module(module.name)
    prefix = f"{_NAMESPACE}::"
    return {
        name[len(prefix) :]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith(prefix)
    }


# --- the checks: each compiles entry points on CUDA and compares with a reference --------------


def _training(backend) -> None:
    from test_kernels_compile import TOLERANCES, _check_matches_eager, _decoder_like_block

    generator = torch.Generator().manual_seed(6)
    x = torch.randn(4, 16, 2048, generator=generator).bfloat16().cuda()
    weight = (torch.rand(2048, generator=generator) + 0.5).bfloat16().cuda()
    residual = torch.randn(4, 16, 2048, generator=generator).bfloat16().cuda()
    logits = (torch.randn(4, 16, 32000, generator=generator) * 3).bfloat16().cuda()
    targets = torch.randint(0, 32000, (4, 16), generator=generator).cuda()
    qkv = torch.randn(4, 16, 5 * 128, generator=generator).bfloat16().cuda()
    positions = torch.randint(0, 4096, (4, 16), generator=generator).cuda()
    inputs = (x, weight, residual, logits[:, :-1], targets[:, :-1], qkv, positions)
    _check_matches_eager(_decoder_like_block, inputs, backend, **TOLERANCES[torch.bfloat16])


def _inference(backend) -> None:
    from test_kernels_compile import _tensor_ops_block, _tensor_ops_inputs
    from test_kernels_gpu import _inference_block, _paged_inputs, _rms_inputs

    x, _, weight = _rms_inputs(64, 2048, seed=9)
    inp = torch.randn(10, 16, device="cuda")
    pos = torch.tensor([3], device="cuda")
    args = [x, weight, inp, pos, *_paged_inputs(seed=1)]
    expected = _inference_block(x, weight, inp, pos, torch.zeros(8, 16, device="cuda"), *args[4:])
    compiled = torch.compile(_inference_block, backend=backend, fullgraph=True)
    got = compiled(x, weight, inp, pos, torch.zeros(8, 16, device="cuda"), *args[4:])
    for value, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(value, reference)
    expected_ops = [t.cuda() for t in _tensor_ops_inputs(2)]
    got_ops = [t.cuda() for t in _tensor_ops_inputs(2)]
    _tensor_ops_block(*expected_ops)
    torch.compile(_tensor_ops_block, backend=backend, fullgraph=True)(*got_ops)
    for value, reference in zip(got_ops, expected_ops, strict=True):
        assert torch.equal(value, reference)


def _decode(backend) -> None:
    from test_kernels_decode_gemv import FLAGS, _problem
    from test_kernels_library_ops_decode import _check_compiled

    from mcore_kernels.decode_gemv import decode_gemv
    from mcore_kernels.reference import decode_gemv_reference

    _check_compiled("cuda", backend)
    problem = _problem(2, FLAGS["norm_swiglu_residual"], torch.float32, device="cuda")
    compiled = torch.compile(lambda p: decode_gemv(**p), backend=backend, fullgraph=True)
    # The GPU's products run on tensor cores (tf32 parts of float32 values).
    torch.testing.assert_close(
        compiled(problem), decode_gemv_reference(**problem), atol=2e-2, rtol=2e-2
    )
    _packed_gemv_and_greedy_feed(backend)


def _packed_gemv_and_greedy_feed(backend) -> None:
    from test_kernels_packed_gemv import _problem as packed_problem

    from mcore_kernels.packed_gemv import packed_gemv
    from mcore_kernels.reference import packed_gemv_reference
    from mcore_kernels.row_argmax import greedy_feed

    problem = packed_problem(1, norm=True, swiglu=True, residual=True)
    compiled = torch.compile(lambda p: packed_gemv(**p), backend=backend, fullgraph=True)
    torch.testing.assert_close(
        compiled(problem).float(), packed_gemv_reference(**problem).float(), atol=2e-2, rtol=2e-2
    )
    logits = torch.randn(3, 5000, device="cuda")
    samples = torch.zeros(3, dtype=torch.float64, device="cuda")
    tokens = torch.zeros(3, dtype=torch.int64, device="cuda")
    positions = torch.arange(3, device="cuda")
    index = torch.compile(greedy_feed, backend=backend, fullgraph=True)(
        logits, samples, tokens, positions
    )
    assert torch.equal(index, logits.argmax(dim=-1)) and torch.equal(tokens, index)
    assert torch.equal(samples, index.double()) and positions.tolist() == [1, 2, 3]


def _attention_and_scan(backend) -> None:
    from test_kernels_library_ops import check_mla_and_rope, check_ssd_scan

    check_mla_and_rope("cuda", backend, scale=1e3)
    check_ssd_scan("cuda", backend, scale=100)


def _batch_invariant(backend) -> None:
    from test_kernels_library_ops import check_batch_invariant_matmuls, check_packed_attention

    check_batch_invariant_matmuls("cuda", backend, scale=100)
    check_packed_attention("cuda", backend, scale=100)


def _moe(backend) -> None:
    from test_kernels_library_ops import check_moe_functions, check_routed_experts

    check_moe_functions("cuda", backend, scale=1e3)
    check_routed_experts("cuda", backend, scale=1e3)


def _communication(backend) -> None:
    from test_kernels_compile import _fused_block

    # One rank of a one-process NCCL group: the op's graph, fake and dispatch on CUDA tensors.
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        generator = torch.Generator().manual_seed(5)
        partial = torch.randn(5, 16, generator=generator).bfloat16().cuda()
        residual = torch.randn(5, 16, generator=generator).bfloat16().cuda()
        weight = (torch.rand(16, generator=generator) + 0.5).bfloat16().cuda()
        expected = _fused_block(partial, residual, weight, *torch.empty(2, 5, 16).bfloat16().cuda())
        outs = torch.empty(2, 5, 16).bfloat16().cuda()
        compiled = torch.compile(_fused_block, backend=backend, fullgraph=True)
        got = compiled(partial, residual, weight, outs[0], outs[1])
        for value, reference in zip((*got, *outs), (*expected, *expected), strict=True):
            assert torch.equal(value, reference)
    finally:
        if owns_group:
            dist.destroy_process_group()


CHECKS: dict[str, tuple[Callable[[Any], None], frozenset[str]]] = {
    "training": (
        _training,
        frozenset(
            {
                "rms_norm_fwd",
                "rms_norm_bwd",
                "token_logprobs_fwd",
                "token_logprobs_bwd",
                "rotary_embedding",
                "swiglu_pair_fwd",
                "swiglu_pair_bwd",
            }
        ),
    ),
    "inference": (
        _inference,
        frozenset({"rms_norm_fwd", "slice_after_", "paged_attention", "merge_", "masked_update_"}),
    ),
    "decode": (
        _decode,
        frozenset(
            {
                "row_argmax",
                "decode_step_metadata",
                "attention_o_proj",
                "ssd_state_update_",
                "moe_dropless_rows",
                "moe_capacity_rows",
                "moe_aligned_rows",
                "moe_padded_slots",
                "decode_gemv",
                "packed_gemv",
                "greedy_feed",
            }
        ),
    ),
    "attention_and_scan": (
        _attention_and_scan,
        frozenset({"paged_mla_attention", "rotary_kv_write", "ssd_scan_fwd", "ssd_scan_bwd"}),
    ),
    "batch_invariant": (
        _batch_invariant,
        frozenset(
            {
                "batch_invariant_matmul",
                "batch_invariant_matmul_bwd",
                "packed_attention_batch_invariant",
                "packed_attention_batch_invariant_bwd",
            }
        ),
    ),
    "moe": (
        _moe,
        frozenset(
            f"moe_{name}{suffix}"
            for name in (
                "swiglu",
                "weighted_swiglu",
                "permute_tokens",
                "unpermute_combine",
                "unpermute_sum",
                "router",
                "routed_experts",
            )
            for suffix in ("", "_bwd")
        ),
    ),
    "communication": (_communication, frozenset({"fused_rs_add_rmsnorm_ag"})),
}
"""Each check and the ops it must hand to Inductor (forward and backward graphs)."""


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("name", list(CHECKS))
def test_inductor_compiles_the_ops_with_reference_values(name, monkeypatch):
    check, expected = CHECKS[name]
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    torch._dynamo.reset()
    seen: set[str] = set()
    try:
        check(recording_inductor(seen))
    finally:
        torch._dynamo.reset()
    assert expected - seen == set()


def test_every_registered_op_has_a_gpu_inductor_check():
    declared = set().union(*(ops for _, ops in CHECKS.values()))
    registered = _registered_ops()
    assert registered - declared == set()
    assert declared - registered == set()
