"""MoE on a GPU: grouped GEMM (bf16) against the expert loop, and a CUDA-graph-captured
decode step with expert padding against dropless eager routing."""

from __future__ import annotations

import pytest
import torch

from mcore_models import GPTConfig, MoEConfig, MoELayer, set_decode_expert_padding
from mcore_models.moe.experts import grouped_mm_supported

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _layer(dtype: torch.dtype) -> MoELayer:
    moe = MoEConfig(num_experts=8, top_k=2, shared_expert_ffn_hidden_size=64)
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


def test_cuda_graph_decode_with_expert_padding_matches_dropless_eager():
    layer = _layer(torch.float32).eval()
    static_x = torch.randn(16, 128, device="cuda")
    with torch.no_grad():
        expected = layer(static_x).clone()
        with set_decode_expert_padding(layer, True):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                layer(static_x)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = layer(static_x)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(static_out, expected, atol=1e-4, rtol=1e-4)
            fresh = torch.randn(16, 128, device="cuda")
            static_x.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            captured = static_out.clone()
        torch.testing.assert_close(captured, layer(fresh), atol=1e-4, rtol=1e-4)
    assert layer.decode_padding is False
