"""MoE on a GPU: grouped GEMM (bf16) against the expert loop, a CUDA-graph-captured decode step
with expert padding against dropless eager routing, the fused Triton kernels against their
torch references, bitwise-reproducible forward and backward passes, and a dropless step
without host synchronisation."""

from __future__ import annotations

import pytest
import torch

from mcore_kernels.moe.expert_gemms import ExpertGemmRunner, ExpertGemms
from mcore_kernels.moe.grouped_mm import PersistentTiles
from mcore_models import GPTConfig, MoEConfig, MoELayer, set_decode_expert_padding
from mcore_models.moe import dispatcher
from mcore_models.moe.experts import CUBLAS_LOOP_PLAN, grouped_mm_supported

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _layer(dtype: torch.dtype, expert_kernel: str = "grouped_mm") -> MoELayer:
    moe = MoEConfig(
        num_experts=8, top_k=2, shared_expert_ffn_hidden_size=64, expert_kernel=expert_kernel
    )
    config = GPTConfig(hidden_size=128, ffn_hidden_size=96, moe=moe, dtype=dtype)
    torch.manual_seed(0)
    layer = MoELayer(config, 0).cuda()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.05)
    return layer


def test_grouped_gemm_bf16_matches_expert_loop_on_gpu():
    if not grouped_mm_supported(torch.device("cuda"), torch.bfloat16):
        pytest.skip("torch._grouped_mm is not available for bf16 on this GPU")
    layer = _layer(torch.bfloat16)
    x = torch.randn(37, 128, device="cuda", dtype=torch.bfloat16)
    results = []
    for grouped in (True, False):
        layer.experts.grouped_gemm = grouped
        layer.zero_grad()
        out = layer(x)
        out.float().square().sum().backward()
        results.append((out.detach().float(), layer.experts.down_proj.grad.float().clone()))
    torch.testing.assert_close(results[0][0], results[1][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(results[0][1], results[1][1], atol=5e-2, rtol=5e-2)


def _captured(layer: MoELayer, static_x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of ``layer(static_x)`` (warmed up outside the capture), replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    graph.replay()
    torch.cuda.synchronize()
    return graph, static_out


def test_cuda_graph_decode_with_expert_padding_matches_dropless_eager():
    layer = _layer(torch.float32).eval()
    static_x = torch.randn(16, 128, device="cuda")
    with torch.no_grad():
        expected = layer(static_x).clone()
        with set_decode_expert_padding(layer, True):
            graph, static_out = _captured(layer, static_x)
            torch.testing.assert_close(static_out, expected, atol=1e-4, rtol=1e-4)
            fresh = torch.randn(16, 128, device="cuda")
            static_x.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            captured = static_out.clone()
        torch.testing.assert_close(captured, layer(fresh), atol=1e-4, rtol=1e-4)
    assert layer.decode_padding is False


def _step(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_(True)
    out = layer(leaf)
    out.backward(grad)
    return [out.detach(), leaf.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]


def _bf16_case(tokens: int) -> tuple[MoELayer, torch.Tensor, torch.Tensor]:
    """A bf16 layer, ``tokens`` random tokens and an output gradient (skips without
    ``torch._grouped_mm``)."""
    if not grouped_mm_supported(torch.device("cuda"), torch.bfloat16):
        pytest.skip("torch._grouped_mm is not available for bf16 on this GPU")
    x = torch.randn(tokens, 128, device="cuda", dtype=torch.bfloat16)
    return _layer(torch.bfloat16), x, torch.randn_like(x)


def _twice_bitwise_without_host_sync(
    layer: MoELayer, x: torch.Tensor, grad: torch.Tensor
) -> list[torch.Tensor]:
    """Two steps, the second under the sync debug mode "error"; asserts them bitwise equal."""
    first = _step(layer, x, grad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = _step(layer, x, grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    return first


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "drop-and-pad"])
def test_fused_kernels_match_torch_references_on_gpu(capacity_factor, monkeypatch):
    layer = _layer(torch.float32)
    layer.moe_config.capacity_factor = capacity_factor
    x = torch.randn(300, 128, device="cuda")
    grad = torch.randn_like(x)
    results = []
    for backend in ("triton", "torch"):
        monkeypatch.setenv("MCORE_KERNELS_BACKEND", backend)
        results.append(_step(layer, x, grad))
    for fused, reference in zip(*results):
        torch.testing.assert_close(fused, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("expert_kernel", ["grouped_mm", "cublas", "bmm"])
@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "drop-and-pad"])
def test_forward_and_backward_are_bitwise_reproducible_on_gpu(capacity_factor, expert_kernel):
    layer = _layer(torch.bfloat16, expert_kernel)
    layer.moe_config.capacity_factor = capacity_factor
    x = torch.randn(999, 128, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    first, second = _step(layer, x, grad), _step(layer, x, grad)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_dropless_step_does_not_synchronise_with_the_host():
    layer, x, grad = _bf16_case(512)
    _step(layer, x, grad)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(layer, x, grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "drop-and-pad"])
def test_fused_routed_experts_match_unfused_reproducible_and_without_host_sync(
    capacity_factor, monkeypatch
):
    # MoEConfig(fused_experts=True): one autograd operation for permute, grouped GEMMs,
    # weighted SwiGLU and combine; the same kernels and GEMMs as the unfused chain, so the
    # results are equal up to bf16 rounding, bitwise reproducible and free of host syncs.
    layer, x, grad = _bf16_case(777)
    layer.moe_config.capacity_factor = capacity_factor
    # 777 tokens, top-2 of 8 experts: capacity 243 at factor 1.0, below the packing threshold;
    # lower it so that drop-and-pad takes the packed path here.
    monkeypatch.setattr(dispatcher, "PACKED_MIN_CAPACITY", 1)
    layer.experts.fused = False
    unfused = _step(layer, x, grad)
    layer.experts.fused = True
    assert layer.experts.fuses_routing(x)
    first = _twice_bitwise_without_host_sync(layer, x, grad)
    for got, expected in zip(first, unfused, strict=True):
        error = (got.float() - expected.float()).norm() / expected.float().norm()
        assert error < 1e-2, (error, got.shape)


def test_rows_padded_per_expert_match_packed_rows_reproducible_and_without_host_sync():
    # ExpertGemms.row_align: the dispatcher pads every expert's rows to 64 with empty rows and
    # the weight gradients run on the unmasked aligned Triton kernel. Against packed rows on
    # torch._grouped_mm: equal up to bf16 rounding, bitwise reproducible, no host sync.
    layer, x, grad = _bf16_case(777)
    assert layer.experts.fuses_routing(x)
    layer.experts.gemm_plan = ExpertGemms()
    packed = _step(layer, x, grad)
    tiles = PersistentTiles(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
    layer.experts.gemm_plan = ExpertGemms(w_down=tiles, w_gate_up=tiles, row_align=64)
    first = _twice_bitwise_without_host_sync(layer, x, grad)
    for got, expected in zip(first, packed, strict=True):
        error = (got.float() - expected.float()).norm() / expected.float().norm()
        assert error < 1e-2, (error, got.shape)


def test_fused_batched_slots_match_separate_operations_and_are_reproducible():
    # Dropless expert_kernel="bmm" in the fused operation (GroupedExperts.forward_slots: every
    # expert padded to the largest one, torch.bmm for all six GEMMs) against the separate
    # autograd operations (forward_padded) on the same slots: equal up to bf16 rounding,
    # bitwise reproducible.
    layer, x, grad = _bf16_case(999)
    layer.experts.expert_kernel = "bmm"
    calls = []
    real = layer.experts.forward_slots
    layer.experts.forward_slots = lambda *args: calls.append(args[-1]) or real(*args)
    layer.experts.fused = False
    unfused = _step(layer, x, grad)
    assert not calls
    layer.experts.fused = True
    first, second = _step(layer, x, grad), _step(layer, x, grad)
    assert len(calls) == 2
    for a, b, expected in zip(first, second, unfused, strict=True):
        assert torch.equal(a, b)
        error = (a.float() - expected.float()).norm() / expected.float().norm()
        assert error < 1e-2, (error, a.shape)


def test_deepseek_shaped_dropless_layer_pads_to_the_largest_expert():
    # At DeepSeek-V3's shape with 256 rows per expert, dropless routing pads every expert to
    # the largest one for batched GEMMs (measured faster on an H200); not at 1024 rows per
    # expert, not with a GEMM plan set, not under a CUDA graph capture.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the measured plans are for Hopper GPUs")
    from mcore_models.moe.experts import GroupedExperts

    experts = GroupedExperts(256, 7168, 2048, torch.bfloat16, fused=True, device="meta")
    tokens = torch.zeros(4, 7168, device="cuda", dtype=torch.bfloat16)
    assert experts.pads_dropless(8192 * 8, tokens)
    assert not experts.pads_dropless(32768 * 8, tokens)
    experts.gemm_plan = ExpertGemms()
    assert not experts.pads_dropless(8192 * 8, tokens)
    experts.gemm_plan = None
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        capturing = experts.pads_dropless(8192 * 8, tokens)
        tokens.mul_(1.0)  # something to capture
    assert not capturing


def test_mixtral_shaped_layer_loops_over_experts_eagerly_and_not_inside_a_cuda_graph(
    monkeypatch,
):
    # At Mixtral's shape with 2048 rows per expert the measured plan is the cuBLAS loop, which
    # reads the group sizes on the host: dropless routing and the packed kept rows of capacity
    # routing run it eagerly; a CUDA graph capture gets torch._grouped_mm instead.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the measured plans are for Hopper GPUs")
    moe = MoEConfig(num_experts=8, top_k=2)
    config = GPTConfig(hidden_size=4096, ffn_hidden_size=14336, moe=moe, dtype=torch.bfloat16)
    torch.manual_seed(0)
    layer = MoELayer(config, 0, device="cuda").eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.02)
    static_x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    assert layer.experts.plan_for(8192 * 2, static_x) == CUBLAS_LOOP_PLAN
    assert layer.experts.plan_for(8192 * 2, static_x, sync_free=True) == ExpertGemms()
    loops = []
    real = ExpertGemmRunner._expert_spans
    monkeypatch.setattr(
        ExpertGemmRunner,
        "_expert_spans",
        lambda self: (loops.append(1) if self._spans is None else None) or real(self),
    )
    for factor in (None, 1.25):
        layer.moe_config.capacity_factor = factor
        loops.clear()
        with torch.no_grad():
            eager = layer(static_x).float()
            assert loops, factor
            loops.clear()
            _, static_out = _captured(layer, static_x)
        # The warm-up call before the capture runs eagerly; the capture itself loops nowhere.
        assert len(loops) == 1, (factor, loops)
        error = (static_out.float() - eager).norm() / eager.norm()
        assert error < 1e-2


@pytest.mark.parametrize(
    ("expert_kernel", "capacity_factor"),
    [("cublas", None), ("cublas", 1.0), ("bmm", None)],
    ids=["loop-dropless", "loop-packed-capacity", "bmm-padded-dropless"],
)
def test_early_host_counts_change_no_bit(expert_kernel, capacity_factor, monkeypatch):
    # The routing counts copied to the host right after the router (HostCounts) for the cuBLAS
    # loops (dropless, capacity routing's packed kept rows) and the padding to the largest
    # expert (whose sort the dispatch then reuses): outputs and every gradient bitwise equal to
    # reading them when needed, and the loops take their rows from the early copy.
    from mcore_kernels.moe import expert_gemms
    from mcore_models.moe import host_counts

    layer, x, grad = _bf16_case(777)
    layer.experts.expert_kernel = expert_kernel
    layer.moe_config.capacity_factor = capacity_factor
    monkeypatch.setattr(dispatcher, "PACKED_MIN_CAPACITY", 1)
    reads = []
    real = host_counts.HostCounts.values
    monkeypatch.setattr(
        host_counts.HostCounts, "values", lambda self: reads.append(1) or real(self)
    )
    monkeypatch.setattr(host_counts, "EARLY", False)
    late = _step(layer, x, grad)
    assert not reads
    monkeypatch.setattr(host_counts, "EARLY", True)
    monkeypatch.setattr(expert_gemms, "LOOP_PREFIX", False)
    early = _step(layer, x, grad)
    assert reads
    for a, b in zip(early, late, strict=True):
        assert torch.equal(a, b)
    # With the first expert's speculative prefix GEMM (cuBLAS loops): the first expert's rows
    # may come from two GEMMs, so equal up to rounding, and reproducible.
    monkeypatch.setattr(expert_gemms, "LOOP_PREFIX", True)
    first, second = _step(layer, x, grad), _step(layer, x, grad)
    for a, b, expected in zip(first, second, late, strict=True):
        assert torch.equal(a, b)
        error = (a.float() - expected.float()).norm() / expected.float().norm()
        assert error < 1e-2, (error, a.shape)


def test_router_kernel_weights_in_bf16_equal_the_cast_float32_weights_on_gpu():
    # The router kernel stores the weights in bf16 itself (round to nearest even): bitwise the
    # cast of its float32 weights, with the same logits gradient; counts int64.
    from mcore_kernels.moe import moe_router

    logits = torch.randn(4099, 128, device="cuda")
    grad = torch.randn(4099, 8, device="cuda", dtype=torch.bfloat16)
    results = []
    for dtype in (torch.bfloat16, None):
        leaf = logits.clone().requires_grad_(True)
        weights, experts, _, counts = moe_router(leaf, 8, weights_dtype=dtype)
        weights = weights.to(torch.bfloat16)
        (weights * grad).sum().backward()
        results.append((weights.detach(), experts, counts, leaf.grad))
    assert results[0][2].dtype == torch.int64
    for got, expected in zip(*results, strict=True):
        assert torch.equal(got, expected)
