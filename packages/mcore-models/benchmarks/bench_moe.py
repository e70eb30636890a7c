"""MoE layer forward + backward throughput against a dense SwiGLU of the same active parameters.

Each case times ``MoELayer`` (dropless with ``torch._grouped_mm`` and the fused
``mcore_kernels.moe`` router/permute/combine/SwiGLU kernels, the same with the kernels' torch
references, dropless with a loop over experts where there are few experts, and drop-and-pad
with capacity factor 1.25) in the same run on the same GPU as its peers: a dense
:class:`~mcore_models.gpt.mlp.SwiGLUMLP` whose FFN width is ``top_k * expert_ffn`` (the same
active matmul parameters per token, router aside) and the equivalent sparse MoE block of
transformers (Mixtral or Qwen3-MoE) with its ``grouped_mm`` experts kernel (and its eager
experts where there are few experts). Inputs are bf16 ``[tokens, hidden]`` random activations;
the backward pass gets a fixed random output gradient. Reports ms per forward + backward,
tokens/s, active TFLOP/s (6 FLOPs per active matmul parameter and token), the throughput ratio
to the dense layer and, for the mcore layers, the share of the layer time spent outside the
expert GEMMs (router, permutation, combine: ``1 - experts_ms / layer_ms``, with ``experts_ms``
the forward + backward of the experts alone on the already permuted tokens).

Run from the repository root on the GPU machine::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-models/benchmarks/bench_moe.py --out $OUT/moe

``--smoke`` runs tiny shapes on the CPU once (a check that the script works, not a result).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mcore_models import GPTConfig, MoEConfig, MoELayer
from mcore_models.gpt.mlp import SwiGLUMLP
from mcore_models.moe.config import expert_capacity
from mcore_models.moe.experts import grouped_mm_supported

CASES = {
    # Mixtral-8x7B layer shape (Jiang et al., 2024): 8 experts, top-2, FFN 14336.
    "mixtral-8x7b": dict(hidden=4096, experts=8, top_k=2, ffn=14336, tokens=8192),
    # Qwen3-30B-A3B layer shape (Qwen3 technical report): 128 experts, top-8, FFN 768.
    "qwen3-30b-a3b": dict(hidden=2048, experts=128, top_k=8, ffn=768, tokens=8192),
    # DeepSeek-V3 MoE layer shape (arXiv:2412.19437): 256 routed experts, top-8, FFN 2048,
    # hidden 7168 (the shared expert and group-limited routing left out).
    "deepseek-v3": dict(hidden=7168, experts=256, top_k=8, ffn=2048, tokens=8192),
    "deepseek-v3-32k": dict(hidden=7168, experts=256, top_k=8, ffn=2048, tokens=32768),
}
FEW_EXPERTS = 16
"""Cases with at most this many experts also time the loops over experts (slow otherwise)."""
SMOKE = {"smoke": dict(hidden=64, experts=4, top_k=2, ffn=32, tokens=64)}


def _moe(case: dict[str, int], device: torch.device, **moe_fields: Any) -> nn.Module:
    moe = MoEConfig(
        num_experts=case["experts"],
        top_k=case["top_k"],
        expert_ffn_hidden_size=case["ffn"],
        **moe_fields,
    )
    config = GPTConfig(hidden_size=case["hidden"], ffn_hidden_size=case["ffn"], moe=moe)
    return _init(MoELayer(config, 0), device)


def _dense(case: dict[str, int], device: torch.device) -> nn.Module:
    config = GPTConfig(hidden_size=case["hidden"], ffn_hidden_size=case["top_k"] * case["ffn"])
    return _init(SwiGLUMLP(config), device)


def _hf_block(case: dict[str, int], device: torch.device, experts: str) -> nn.Module:
    import transformers

    common = dict(
        hidden_size=case["hidden"],
        num_experts_per_tok=case["top_k"],
        num_attention_heads=8,
        num_hidden_layers=1,
    )
    if case["top_k"] == 2:
        config = transformers.MixtralConfig(
            **common, intermediate_size=case["ffn"], num_local_experts=case["experts"]
        )
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    else:
        config = transformers.Qwen3MoeConfig(
            **common,
            moe_intermediate_size=case["ffn"],
            num_experts=case["experts"],
            norm_topk_prob=True,
        )
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeSparseMoeBlock as Block,
        )
    # transformers 5 picks the experts kernel from this config attribute ("eager", "grouped_mm").
    config._experts_implementation = experts
    return _init(Block(config), device)


def _init(module: nn.Module, device: torch.device) -> nn.Module:
    module = module.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else None)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, 0.02)
    return module


def _time(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, warmup: int, iters: int) -> float:
    """Milliseconds per forward + backward (CUDA events on GPU, wall clock on CPU)."""
    inputs = x.requires_grad_(True)
    shaped = inputs if not getattr(module, "wants_3d", False) else inputs[None]
    backend = getattr(module, "kernel_backend", None)
    previous = os.environ.get("MCORE_KERNELS_BACKEND")

    def step() -> None:
        if backend is not None:
            os.environ["MCORE_KERNELS_BACKEND"] = backend
        out = module(shaped)
        out = out.reshape(grad.shape)
        out.backward(grad)
        module.zero_grad(set_to_none=True)
        inputs.grad = None
        if backend is not None:
            if previous is None:
                os.environ.pop("MCORE_KERNELS_BACKEND", None)
            else:
                os.environ["MCORE_KERNELS_BACKEND"] = previous

    for _ in range(warmup):
        step()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    begin = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - begin) * 1e3 / iters


def _profile(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, title: str) -> str:
    """Top operators by device time of two forward + backward steps, as a text table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if x.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    _time(module, x, grad, warmup=1, iters=1)
    with profile(activities=activities) as prof:
        _time(module, x, grad, warmup=0, iters=2)
    key = "self_cuda_time_total" if x.device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60)
    return f"== {title}\n{table}\n"


def run_case(
    name: str, case: dict[str, int], device: torch.device, smoke: bool, profiles: list[str] | None
) -> list[dict]:
    """Time every implementation of one case.

    Args:
        name: Case name.
        case: Shapes (hidden, experts, top_k, ffn, tokens).
        device: Device.
        smoke: Tiny single-iteration run.
        profiles: When a list, a profiler table of each mcore implementation is appended.

    Returns:
        One row per implementation.
    """
    warmup, iters = (1, 1) if smoke else (3, 10)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(case["tokens"], case["hidden"], device=device, dtype=dtype, generator=generator)
    grad = torch.randn_like(x)
    few = case["experts"] <= FEW_EXPERTS
    builders: dict[str, Callable[[], nn.Module]] = {
        "dense SwiGLU (same active params)": lambda: _dense(case, device),
        "mcore MoELayer dropless, grouped GEMM, fused kernels": lambda: _moe(case, device),
        "mcore MoELayer dropless, grouped GEMM, torch references": lambda: _backend(
            _moe(case, device), "torch"
        ),
        "mcore MoELayer drop-and-pad (capacity 1.25), fused kernels": lambda: _moe(
            case, device, capacity_factor=1.25
        ),
        "transformers sparse MoE block (grouped_mm experts)": lambda: _wants_3d(
            _hf_block(case, device, "grouped_mm")
        ),
    }
    if few:
        builders["mcore MoELayer dropless, expert loop"] = lambda: _moe(
            case, device, grouped_gemm=False
        )
        builders["transformers sparse MoE block (eager experts)"] = lambda: _wants_3d(
            _hf_block(case, device, "eager")
        )
    active = 3 * case["hidden"] * case["ffn"] * case["top_k"]
    rows = []
    for implementation, build in builders.items():
        row: dict[str, Any] = {"case": name, "implementation": implementation, **case}
        module: nn.Module | None = None
        try:
            module = build()
            ms = _time(module, x.detach().clone(), grad, warmup, iters)
            if profiles is not None and implementation.startswith("mcore"):
                title = f"{name}: {implementation}"
                profiles.append(_profile(module, x.detach().clone(), grad, title))
            row.update(
                ms=ms,
                tokens_per_s=case["tokens"] / ms * 1e3,
                active_tflops=6 * active * case["tokens"] / ms / 1e9,
            )
            if isinstance(module, MoELayer) and module.experts.grouped_gemm:
                experts_ms = _time_experts(module, x, warmup, iters)
                row.update(experts_ms=experts_ms, non_gemm_share=1.0 - experts_ms / ms)
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        finally:
            module = None
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dense = rows[0].get("ms")
    for row in rows:
        if dense and "ms" in row:
            row["throughput_vs_dense"] = dense / row["ms"]
    return rows


def _time_experts(layer: MoELayer, x: torch.Tensor, warmup: int, iters: int) -> float:
    """Milliseconds per forward + backward of the layer's experts alone, on the tokens already
    permuted into expert order (dropless) or into their capacity slots (drop-and-pad)."""
    moe = layer.moe_config
    with torch.no_grad():
        routing = layer.router(x)
    flat = routing.experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    permuted = x.index_select(0, order // moe.top_k).detach()
    counts = torch.bincount(flat, minlength=moe.num_experts)
    factor = layer.capacity_factor
    if factor is None:
        # The experts are a submodule, so that _time's zero_grad clears their gradients (else
        # every step would add into the previous step's gradients).
        class Experts(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.experts = layer.experts

            def forward(self, rows: torch.Tensor) -> torch.Tensor:
                return self.experts(rows, counts)

        module: nn.Module = Experts()
        rows = permuted
    else:
        capacity = expert_capacity(x.shape[0], moe.top_k, moe.num_experts, factor)

        class Experts(nn.Module):  # type: ignore[no-redef]
            def __init__(self) -> None:
                super().__init__()
                self.experts = layer.experts

            def forward(self, rows: torch.Tensor) -> torch.Tensor:
                slots = rows.view(moe.num_experts, capacity, -1)
                return self.experts.forward_padded(slots).flatten(0, 1)

        module = Experts()
        rows = torch.randn(moe.num_experts * capacity, x.shape[1], device=x.device, dtype=x.dtype)
    grad = torch.randn_like(rows)
    ms = _time(module, rows.clone(), grad, warmup, iters)
    layer.zero_grad(set_to_none=True)
    return ms


def _backend(module: nn.Module, backend: str) -> nn.Module:
    module.kernel_backend = backend  # type: ignore[assignment]
    return module


def _wants_3d(module: nn.Module) -> nn.Module:
    module.wants_3d = True  # type: ignore[assignment]
    return module


def _markdown(device_name: str, rows: list[dict]) -> str:
    lines = [
        f"MoE layer forward + backward on {device_name} (bf16 on GPU)",
        "",
        "| case | implementation | tokens | ms | tokens/s | active TFLOP/s | vs dense | "
        "outside expert GEMMs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "ms" not in row:
            lines.append(
                f"| {row['case']} | {row['implementation']} | {row['tokens']} | "
                f"error: {row['error'][:60]} | | | | |"
            )
            continue
        lines.append(
            f"| {row['case']} | {row['implementation']} | {row['tokens']} | {row['ms']:.2f} | "
            f"{row['tokens_per_s']:,.0f} | {row['active_tflops']:.0f} | "
            f"{row.get('throughput_vs_dense', float('nan')):.2f}x | "
            + (f"{100 * row['non_gemm_share']:.0f}% |" if "non_gemm_share" in row else "|")
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and write ``moe.json`` and ``moe.md`` under ``--out``.

    Args:
        argv: Command-line arguments (default ``sys.argv``).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run")
    parser.add_argument("--cases", nargs="*", help="case names to run (default: all)")
    parser.add_argument(
        "--profile", action="store_true", help="also write moe_profile.txt (top operators)"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    rows: list[dict] = []
    profiles: list[str] | None = [] if args.profile else None
    for name, case in (SMOKE if args.smoke else CASES).items():
        if args.cases and name not in args.cases:
            continue
        rows.extend(run_case(name, case, device, args.smoke, profiles))
        print(_markdown(device_name, rows), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result = {
        "device": device_name,
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "grouped_mm_supported": grouped_mm_supported(device, dtype),
        "rows": rows,
    }
    if profiles is not None:
        (out / "moe_profile.txt").write_text("".join(profiles))
    (out / "moe.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "moe.md").write_text(_markdown(device_name, rows))
    print(_markdown(device_name, rows))


if __name__ == "__main__":
    main()
