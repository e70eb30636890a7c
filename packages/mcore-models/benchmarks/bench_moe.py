"""MoE layer forward + backward throughput against a dense SwiGLU of the same active parameters.

Each case times ``MoELayer`` in the same run on the same GPU as its peers:

- dropless with ``torch._grouped_mm`` and drop-and-pad with batched GEMMs
  (``expert_kernel="grouped_mm"``), both with the fused router/permute/combine/SwiGLU kernels
  and the routing weights applied inside the experts (the default), and dropless once more
  with the weights applied in the combine (``weights_in_experts=False``);
- dropless on batched GEMMs padded to the largest expert (``expert_kernel="bmm"``, a host
  sync) and, with few experts, one cuBLAS GEMM per expert inside the fused operation
  (``expert_kernel="cublas"``);
- the default's fused operation with every GEMM on ``torch._grouped_mm`` (the default before
  the per-shape GEMM plan of ``choose_expert_gemms``) and, at DeepSeek-V3 8k, with session 8's
  plan (the down projection and its input gradient on Triton);
- where the default pads dropless routing to the largest expert (``prefers_slots``: DeepSeek-V3
  8k), the shape's grouped GEMM plan without that padding and the padded batched GEMMs as
  separate autograd operations (the defaults before session 12); where there are few experts,
  drop-and-pad's packed kept rows on ``torch._grouped_mm`` without host sync (the default
  before session 12) and drop-and-pad on batched GEMMs over every capacity slot;
- dropless with the kernels' torch references (cases with few experts only: it is the slowest
  row), and the loop over experts where there are few experts.

Peers: a dense :class:`~mcore_models.gpt.mlp.SwiGLUMLP` whose FFN width is ``top_k *
expert_ffn`` (the same active matmul parameters per token, router aside), as written (separate
gate and up GEMMs, torch SiLU and product) and fused like the experts (one gate/up GEMM and the
fused SwiGLU kernel); "vs dense" divides the faster of the two by the row's time. And the
equivalent sparse MoE block of transformers (Mixtral or Qwen3-MoE) with its ``grouped_mm``
experts kernel (and its eager experts where there are few experts). Inputs are bf16 ``[tokens,
hidden]`` random activations; the backward pass gets a fixed random output gradient. Reports ms
per forward + backward, tokens/s, active TFLOP/s (6 FLOPs per active matmul parameter and
token), the ratios to dense and to transformers' grouped_mm block and, for the mcore layers,
the share of the layer time spent outside the expert GEMMs (router, permutation, combine: ``1 -
experts_ms / layer_ms``, with ``experts_ms`` the forward + backward of the experts alone on
tokens already in expert order, or in their capacity slots).

The rows the issue's ratios read (:data:`RATIO_ROWS`: both dense layers, our dropless and
drop-and-pad defaults, transformers' ``grouped_mm`` block, and below 32k tokens the two
defaults' experts alone for their ``experts_ms``) are built together and timed by
``moe_windows.rotate``: 2 s of continuous load through all of them, then ``--rounds`` (5; 3 at
32k tokens) rounds that visit each layer once in a rotated order, each visit two windows: the
case's step count started right after a synchronisation (``ms_from_idle``, the measure until
session 15, whose first step waits for the host to queue its first kernels) and, after
``LEAD_STEPS`` untimed steps queued without a synchronisation, at least ``MIN_WINDOW_MS`` of
timed steps (the steady state, as a layer runs inside a model whose host queues it while the
GPU still runs the layers before it). ``ms`` is the median of a row's steady windows, the
ratios divide medians, and ``moe.json`` keeps every window (``windows_ms``,
``windows_ms_from_idle``), each round's own ratio (``throughput_vs_dense_rounds``) and, where
NVML can be read, each window's mean SM clock (``windows_sm_mhz``, median ``sm_mhz``): the
H200 runs these layers at its power limit, where one window's clock depends on what ran just
before it. Every other row is built and timed alone by :func:`_time` (0.5 s of synchronised
steps, then the same two windows once).

Run from the repository root on the GPU machine::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-models/benchmarks/bench_moe.py --out $OUT/moe --profile

``--smoke`` runs tiny shapes on the CPU once (a check that the script works, not a result).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os

# Set before torch initialises CUDA: the 32k-token DeepSeek-V3 rows need 60+ GB of an 80 GB
# H100, and the blocks freed by earlier rows would otherwise be too fragmented.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from moe_windows import (  # type: ignore[import-not-found]
    LEAD_STEPS,
    MIN_WINDOW_MS,
    ClockSampler,
    allocator_events,
    rotate,
    round_ratios,
    stepper,
    window,
)
from torch import nn

from mcore_kernels.moe import swiglu
from mcore_kernels.moe.expert_gemms import (
    GROUPED_MM,
    ExpertGemms,
    measured_expert_gemms,
    prefers_slots,
)
from mcore_kernels.moe.grouped_mm import PersistentTiles
from mcore_kernels.moe.routed import grouped_experts
from mcore_kernels.moe.rows import aligned_rows
from mcore_models import GPTConfig, MoEConfig, MoELayer
from mcore_models.gpt.mlp import SwiGLUMLP
from mcore_models.moe.config import expert_capacity
from mcore_models.moe.dispatcher import PACKED_MIN_CAPACITY
from mcore_models.moe.experts import grouped_mm_supported
from mcore_models.moe.permute import padded_capacity

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
DENSE = "dense SwiGLU (same active params), separate gate/up GEMMs"
DENSE_FUSED = "dense SwiGLU (same active params), one gate/up GEMM + fused SwiGLU"
HF_GROUPED = "transformers sparse MoE block (grouped_mm experts)"
DEFAULT = (
    "mcore MoELayer dropless (default: one fused op of permute, the measured GEMM plan of the "
    "shape, SwiGLU, combine)"
)
DROP_AND_PAD = (
    "mcore MoELayer drop-and-pad (capacity 1.25, default: kept rows packed for grouped GEMMs "
    "from capacity 384, batched GEMMs over the padded slots below)"
)
LARGE = 10**8
"""Cases with more token elements than this run fewer iterations (the whole script must stay
within two minutes)."""
FEW_EXPERTS = 16
"""Cases with at most this many experts also time the loops over experts (slow otherwise)."""
SMOKE = {"smoke": dict(hidden=64, experts=4, top_k=2, ffn=32, tokens=64)}


GROUPED_MM_ONLY = (
    "mcore MoELayer dropless, fused op with every expert GEMM on torch._grouped_mm "
    "(the default before the per-shape GEMM plan)"
)
PACKED_ROWS = (
    "mcore MoELayer dropless, rows packed (no padding rows; weight gradients on "
    "torch._grouped_mm: the session-9 plan)"
)


GROUPED_PLAN = (
    "mcore MoELayer dropless, the shape's grouped GEMM plan without padding to the largest "
    "expert (the default before session 12)"
)
BMM_UNFUSED = (
    "mcore MoELayer dropless, batched GEMMs padded to the largest expert, unfused "
    '(expert_kernel="bmm" before session 12)'
)
DROP_SYNC_FREE = (
    "mcore MoELayer drop-and-pad (capacity 1.25), kept rows packed on torch._grouped_mm "
    "without host sync (the default before session 12)"
)
DROP_ALL_SLOTS = (
    "mcore MoELayer drop-and-pad on every capacity slot (capacity 1.25, "
    'expert_kernel="bmm": batched GEMMs, 1.25x the routed rows)'
)


SESSION8_PLAN = (
    "mcore MoELayer dropless, fused op with session 8's GEMM plan (down projection and its "
    "input gradient on Triton)"
)
FUSED_LOOP = (
    "mcore MoELayer dropless, fused op with one cuBLAS GEMM per expert "
    '(expert_kernel="cublas", host sync)'
)


WARMUP_SECONDS = 0.5
"""Seconds of untimed steps before each timed window on a GPU (steady clocks for every row)."""
RATIO_ROWS = (DENSE, DENSE_FUSED, DEFAULT, DROP_AND_PAD, HF_GROUPED)
"""The rows whose ratios the issue's targets read: built together and timed in rotated rounds
of windows (:func:`moe_windows.rotate`); the other rows get one :func:`_time` each."""
ROUNDS = 5
"""Rounds of windows of the ratio rows (the ``--rounds`` default)."""
LARGE_ROUNDS = 3
"""At most this many rounds in cases above :data:`LARGE` (windows of 0.3-0.6 s each)."""
EXPERTS_ALONE = " [experts alone]"
"""Suffix of the rotation's entries that time a ratio row's experts alone (its
``experts_ms``: the same rounds as the layer, so that ``non_gemm_share`` compares windows of
the same clocks)."""
CLOCK: ClockSampler | None = None
"""SM clock sampler of the run's GPU (set by :func:`main`; None where NVML cannot read it)."""


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _moe(case: dict[str, int], device: torch.device, **moe_fields: Any) -> nn.Module:
    moe = MoEConfig(
        num_experts=case["experts"],
        top_k=case["top_k"],
        expert_ffn_hidden_size=case["ffn"],
        **moe_fields,
    )
    config = GPTConfig(
        hidden_size=case["hidden"], ffn_hidden_size=case["ffn"], moe=moe, dtype=_dtype(device)
    )
    # Every row of a case gets the same weights, hence the same routing: the rows differ only
    # in how they run it (the dropless slot plan depends on the largest expert's row count).
    torch.manual_seed(0)
    # Built on the device: DeepSeek-V3's 256 experts are 11G parameters.
    return _init(MoELayer(config, 0, device=device))


def _dense(case: dict[str, int], device: torch.device) -> nn.Module:
    config = GPTConfig(
        hidden_size=case["hidden"],
        ffn_hidden_size=case["top_k"] * case["ffn"],
        dtype=_dtype(device),
    )
    with torch.device(device):
        return _init(SwiGLUMLP(config))


class FusedDenseSwiGLU(nn.Module):
    """Dense SwiGLU computed like the experts: one gate/up GEMM, the fused SwiGLU kernel."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(2 * ffn, hidden))
        self.down = nn.Parameter(torch.empty(hidden, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(swiglu(F.linear(x, self.gate_up)), self.down)


def _dense_fused(case: dict[str, int], device: torch.device) -> nn.Module:
    with torch.device(device):
        module = FusedDenseSwiGLU(case["hidden"], case["top_k"] * case["ffn"])
    return _init(module.to(_dtype(device)))


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
    previous = torch.get_default_dtype()
    torch.set_default_dtype(_dtype(device))
    try:
        with torch.device(device):
            block = Block(config)
    finally:
        torch.set_default_dtype(previous)
    return _init(block)


def _init(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, 0.02)
    return module


LAST_MEMORY: dict[str, float] = {}
"""Peak allocated GiB and allocator events per step of the last timed GPU run."""


LAST_WINDOWS: dict[str, float] = {}
"""The two windows of the last timed GPU run: ``from_idle_ms`` (per step, the window started
right after a synchronisation), ``steady_steps`` (steps in the steady-state window) and, with
:data:`CLOCK`, ``sm_mhz`` (the steady window's mean SM clock)."""


def _time(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, warmup: int, iters: int) -> float:
    """Milliseconds per forward + backward in the steady state (CUDA events on GPU, wall clock
    on CPU).

    On a GPU, after :data:`WARMUP_SECONDS` of steps, two windows: ``iters`` steps started right
    after a synchronisation (the window of sessions 8 to 15, kept in
    ``LAST_WINDOWS["from_idle_ms"]``), then, after :data:`LEAD_STEPS` untimed steps queued
    without a synchronisation, at least ``iters`` steps and :data:`MIN_WINDOW_MS`
    (returned). A window started on an idle GPU makes its first step wait for the host to
    queue the step's first kernels (at Qwen3-30B-A3B about 1 ms, 0.2 ms per step of a 6-step
    window) while a layer inside a model is queued while the GPU still runs the layers before
    it; the steady-state window measures that case, for every row alike. It also runs long
    enough to use up the clock headroom that the synchronised settling steps leave a layer
    whose GPU idles during each step's host fill (one H200, Qwen3-30B-A3B: 1650-1700 MHz in the
    old window against about 1550 MHz sustained; docs/benchmarks/moe.md, session 16).
    """
    step = stepper(module, x, grad)
    for _ in range(warmup):
        step()
    if x.device.type == "cuda":
        # Every row reaches the GPU's steady clocks before it is timed: right after an idle
        # moment the first row ran at boost clocks (one H200: 1725-1732 MHz against the
        # 1420-1490 MHz every row settles at under the 700 W power limit), which favoured the
        # row timed first (the dense layer) by 2-5 %.
        torch.cuda.synchronize()
        settle = time.perf_counter()
        while time.perf_counter() - settle < WARMUP_SECONDS:
            step()
            torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = allocator_events()
        from_idle = window(step, iters)
        steady_steps = max(iters, math.ceil(MIN_WINDOW_MS / max(from_idle, 1e-3)))
        for _ in range(LEAD_STEPS):
            step()
        queued = time.perf_counter()
        ms = window(step, steady_steps)
        mhz = CLOCK.mean(queued, time.perf_counter()) if CLOCK is not None else None
        after = allocator_events()
        counted = iters + LEAD_STEPS + steady_steps
        LAST_MEMORY.clear()
        LAST_MEMORY.update(
            peak_gib=torch.cuda.max_memory_allocated() / 2**30,
            **{key: (after[key] - before[key]) / counted for key in after},
        )
        LAST_WINDOWS.clear()
        LAST_WINDOWS.update(from_idle_ms=from_idle, steady_steps=steady_steps)
        if mhz is not None:
            LAST_WINDOWS["sm_mhz"] = mhz
        return ms
    begin = time.perf_counter()
    for _ in range(iters):
        step()
    ms = (time.perf_counter() - begin) * 1e3 / iters
    LAST_WINDOWS.clear()
    LAST_WINDOWS.update(from_idle_ms=ms, steady_steps=iters)
    return ms


_GEMM_NAMES = ("cutlass", "nvjet", "gemm", "tma_", "sm90", "m_grouped_kernel", "k_grouped_kernel")


def _category(kernel: str) -> str:
    """Kind of a device kernel for the profile summary."""
    name = kernel.lower()
    if any(key in name for key in _GEMM_NAMES) and "prepare_grouped" not in name:
        return "GEMM"
    if "swiglu" in name:
        return "SwiGLU"
    if any(key in name for key in ("gather_rows", "sum_rows", "weight_grad_kernel", "permute")):
        return "permute/combine"
    if any(key in name for key in ("router", "sort", "topk", "scan", "scatter", "softmax")):
        return "routing"
    return "other"


def _profile(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, title: str) -> str:
    """Device kernels of two forward + backward steps, in ms per step, as Markdown."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if x.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    # Steady clocks first; the profiled steps themselves are only these two (until session 15
    # the profile also recorded _time's 0.5 s of settling steps, divided by two).
    _time(module, x, grad, warmup=1, iters=1)
    step = stepper(module, x, grad)
    steps = 2
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if x.device.type == "cuda":
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        on_device = event.device_type != torch.autograd.DeviceType.CPU
        if on_device or x.device.type == "cpu":
            entry = kernels.setdefault(event.name, [0.0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
    total = sum(entry[1] for entry in kernels.values()) / steps / 1e3
    spans = sorted(
        (event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.device_type != torch.autograd.DeviceType.CPU
    )
    # GPU idle time between consecutive kernels (the host enqueueing too slowly, or syncs).
    idle = sum(max(0.0, nxt[0] - cur[1]) for cur, nxt in itertools.pairwise(spans)) / steps / 1e3
    shares: dict[str, float] = {}
    for name, (_, micros) in kernels.items():
        category = _category(name)
        shares[category] = shares.get(category, 0.0) + micros / steps / 1e3
    summary = ", ".join(f"{key} {value:.3f}" for key, value in sorted(shares.items()))
    lines = [
        f"### {title}",
        "",
        f"Device time per step: {total:.3f} ms ({'kernels' if x.device.type == 'cuda' else 'CPU ops'})"
        + (f"; GPU idle between kernels: {idle:.3f} ms" if x.device.type == "cuda" else ""),
        "",
        f"By kind (ms per step): {summary}",
        "",
        "| kernel | calls / step | ms / step |",
        "|---|---|---|",
    ]
    ranked = sorted(kernels.items(), key=lambda item: -item[1][1])
    for name, (calls, micros) in ranked[:12]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short}` | {calls / steps:g} | {micros / steps / 1e3:.3f} |")
    return "\n".join(lines) + "\n\n"


def run_case(
    name: str,
    case: dict[str, int],
    device: torch.device,
    smoke: bool,
    profiles: list[str] | None,
    skip: list[str] | None = None,
    emit: Callable[[list[dict]], None] | None = None,
    rounds: int = ROUNDS,
    only: list[str] | None = None,
) -> list[dict]:
    """Time every implementation of one case.

    The rows of :data:`RATIO_ROWS` are built together and timed in ``rounds`` rotated rounds
    of windows (:func:`moe_windows.rotate`; ``ms`` is the median of their steady-state
    windows); every other row is built and timed alone by :func:`_time`.

    Args:
        name: Case name.
        case: Shapes (hidden, experts, top_k, ffn, tokens).
        device: Device.
        smoke: Tiny single-iteration run.
        profiles: When a list, a profiler table of each mcore implementation is appended.
        skip: Implementations whose name contains one of these words are left out.
        emit: Called with the rows so far after every implementation (and every round).
        rounds: Rounds of the ratio rows (at most :data:`LARGE_ROUNDS` above :data:`LARGE`);
            0 times them alone like the other rows.
        only: When given, only implementations whose name contains one of these words run.

    Returns:
        One row per implementation, in the order of the builders.
    """
    warmup, iters = (1, 1) if smoke else (2, 6)
    if case["tokens"] * case["hidden"] > LARGE:
        warmup, iters = 1, 3
        rounds = min(rounds, LARGE_ROUNDS)
    dtype = _dtype(device)
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(case["tokens"], case["hidden"], device=device, dtype=dtype, generator=generator)
    grad = torch.randn_like(x)
    builders = _builders(case, device)
    for implementation in list(builders):
        left_out = any(word in implementation for word in skip or ())
        if only:
            left_out = left_out or not any(word in implementation for word in only)
        if left_out:
            del builders[implementation]
    rows: dict[str, dict[str, Any]] = {}

    def ordered() -> list[dict]:
        done = [rows[implementation] for implementation in builders if implementation in rows]
        _ratios(done)
        return done

    def publish() -> None:
        if emit is not None:
            emit(ordered())

    rotated = [key for key in builders if key in RATIO_ROWS] if rounds > 0 else []
    if rotated:
        modules = _rotate_case(
            name, case, rotated, builders, rows, (x, grad), (warmup, iters), rounds, publish
        )
        for implementation in rotated:
            module = modules.pop(implementation, None)
            row = rows[implementation]
            if module is not None and "error" not in row:
                experts = "experts_ms" not in row
                _extras(row, module, name, x, grad, warmup, iters, profiles, experts)
            module = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            publish()
    for implementation, build in builders.items():
        if implementation in rows:
            continue
        row: dict[str, Any] = {"case": name, "implementation": implementation, **case}
        begin = time.perf_counter()
        try:
            module = build()
            ms = _time(module, x.detach().clone(), grad, warmup, iters)
            # Kept before the profile and the experts' timing run _time again.
            row.update(LAST_MEMORY)
            windows = dict(LAST_WINDOWS)
            row.update(ms_from_idle=windows.pop("from_idle_ms"), **windows)
            row.update(_speeds(case, ms))
            _extras(row, module, name, x, grad, warmup, iters, profiles)
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        finally:
            module = None
        rows[implementation] = row
        print(f"{name}: {implementation}: {time.perf_counter() - begin:.1f} s", flush=True)
        publish()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return ordered()


def _rotate_case(
    name: str,
    case: dict[str, int],
    rotated: list[str],
    builders: dict[str, Callable[[], nn.Module]],
    rows: dict[str, dict[str, Any]],
    inputs: tuple[torch.Tensor, torch.Tensor],
    steps: tuple[int, int],
    rounds: int,
    publish: Callable[[], None],
) -> dict[str, nn.Module]:
    """Build the ratio rows of one case, time them in rotated rounds and put their rows in
    ``rows`` (``publish`` after every round). MoE layers of equal shapes share one set of
    weights: two DeepSeek-V3 layers and transformers' block would hold 63 GiB of parameters.

    Returns:
        The modules that ran, for the profile and the experts' timing.
    """
    x, grad = inputs
    warmup, iters = steps
    begin = time.perf_counter()
    modules: dict[str, nn.Module] = {}
    for implementation in rotated:
        row: dict[str, Any] = {"case": name, "implementation": implementation, **case}
        rows[implementation] = row
        try:
            module = builders[implementation]()
            for other in modules.values():
                if _share_weights(module, other):
                    break
            modules[implementation] = module
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        module = None
        if x.device.type == "cuda":
            torch.cuda.empty_cache()
    if not modules:
        return modules
    timed_modules = dict(modules)
    experts_inputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    # At 32k tokens the experts' inputs would add 17 GB to the resident layers: there they are
    # timed alone after the rounds (_extras), as the other rows' experts are.
    large = case["tokens"] * case["hidden"] > LARGE
    for implementation, module in modules.items():
        if not large and isinstance(module, MoELayer) and module.experts.grouped_gemm:
            try:
                experts, rows_in, grad_out = _experts_alone(module, x)
            except Exception:  # the row keeps no experts_ms
                traceback.print_exc()
                continue
            timed_modules[implementation + EXPERTS_ALONE] = experts
            experts_inputs[implementation + EXPERTS_ALONE] = (rows_in, grad_out)

    def update(timed: dict[str, dict[str, Any]]) -> None:
        for implementation, fields in timed.items():
            if implementation in modules:
                row = {"case": name, "implementation": implementation, **case, **fields}
                if "error" not in fields:
                    row.update(_speeds(case, fields["ms"]))
                rows[implementation] = row
        for implementation in modules:
            experts = timed.get(implementation + EXPERTS_ALONE, {})
            if "ms" in experts and "ms" in rows[implementation]:
                rows[implementation].update(
                    experts_ms=experts["ms"],
                    experts_windows_ms=experts["windows_ms"],
                    non_gemm_share=1.0 - experts["ms"] / rows[implementation]["ms"],
                )
        publish()

    try:
        # Published after every round (the last round's fields are the result).
        rotate(
            timed_modules,
            x,
            grad,
            warmup,
            iters,
            rounds,
            clock=CLOCK,
            emit=update,
            inputs=experts_inputs,
        )
    except Exception as exc:  # e.g. out of memory in the settle: the rows say so
        for implementation in modules:
            rows[implementation].setdefault("error", f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    for module in timed_modules.values():
        module.zero_grad(set_to_none=True)
    print(
        f"{name}: {len(modules)} ratio rows, {rounds} rounds: {time.perf_counter() - begin:.1f} s",
        flush=True,
    )
    return modules


def _share_weights(module: nn.Module, source: nn.Module) -> bool:
    """Make two MoE layers of equal parameter shapes share ``source``'s parameters (the
    benchmark builds every layer of a case with the same seed: the values are the same).

    Returns:
        Whether the parameters are now shared.
    """
    if not (isinstance(module, MoELayer) and isinstance(source, MoELayer)):
        return False
    mine = dict(module.named_parameters())
    theirs = dict(source.named_parameters())
    if mine.keys() != theirs.keys() or any(
        mine[key].shape != theirs[key].shape or mine[key].dtype != theirs[key].dtype for key in mine
    ):
        return False
    for key in mine:
        owner_name, _, attribute = key.rpartition(".")
        owner = module.get_submodule(owner_name)
        setattr(owner, attribute, theirs[key])
    return True


def _speeds(case: dict[str, int], ms: float) -> dict[str, float]:
    """``ms``, tokens/s and active TFLOP/s (6 FLOPs per active matmul parameter and token)."""
    active = 3 * case["hidden"] * case["ffn"] * case["top_k"]
    return {
        "ms": ms,
        "tokens_per_s": case["tokens"] / ms * 1e3,
        "active_tflops": 6 * active * case["tokens"] / ms / 1e9,
    }


def _extras(
    row: dict[str, Any],
    module: nn.Module,
    name: str,
    x: torch.Tensor,
    grad: torch.Tensor,
    warmup: int,
    iters: int,
    profiles: list[str] | None,
    experts: bool = True,
) -> None:
    """The profile of a timed row (``profiles``) and, for MoE layers with ``experts``, the
    experts alone."""
    implementation = row["implementation"]
    try:
        if profiles is not None and implementation.startswith(("mcore", "dense")):
            title = f"{name}: {implementation}"
            profiles.append(_profile(module, x.detach().clone(), grad, title))
        if experts and isinstance(module, MoELayer) and module.experts.grouped_gemm:
            experts_ms = _time_experts(module, x, warmup, iters)
            row.update(experts_ms=experts_ms, non_gemm_share=1.0 - experts_ms / row["ms"])
    except Exception as exc:
        row["extras_error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()


def _builders(case: dict[str, int], device: torch.device) -> dict[str, Callable[[], nn.Module]]:
    """Every implementation of one case, by row name."""
    few = case["experts"] <= FEW_EXPERTS
    builders: dict[str, Callable[[], nn.Module]] = {
        DENSE: lambda: _dense(case, device),
        DENSE_FUSED: lambda: _dense_fused(case, device),
        DEFAULT: lambda: _moe(case, device),
        "mcore MoELayer dropless, torch._grouped_mm, separate autograd ops (fused_experts=False)": (
            lambda: _moe(case, device, fused_experts=False)
        ),
        "mcore MoELayer dropless, torch._grouped_mm, weights in the combine": (
            lambda: _moe(case, device, weights_in_experts=False)
        ),
        "mcore MoELayer dropless, batched GEMMs padded to the largest expert (host sync)": (
            lambda: _moe(case, device, expert_kernel="bmm")
        ),
        GROUPED_MM_ONLY: lambda: _plan(_moe(case, device), ExpertGemms()),
        DROP_AND_PAD: lambda: _moe(case, device, capacity_factor=1.25),
        "mcore MoELayer drop-and-pad (capacity 1.25), batched GEMMs over the padded slots": (
            lambda: _moe(case, device, capacity_factor=1.25, fused_experts=False)
        ),
        HF_GROUPED: lambda: _wants_3d(_hf_block(case, device, "grouped_mm")),
    }
    if case["experts"] == 256 and case["tokens"] <= 8192:
        builders[SESSION8_PLAN] = lambda: _plan(_moe(case, device), _session8_plan())
    routed = case["tokens"] * case["top_k"]
    plan = measured_expert_gemms(routed, case["hidden"], case["ffn"], case["experts"])
    if prefers_slots(routed, case["hidden"], case["ffn"], case["experts"], device):
        builders[GROUPED_PLAN] = lambda: _plan(_moe(case, device), plan)
        builders[BMM_UNFUSED] = lambda: _moe(case, device, expert_kernel="bmm", fused_experts=False)
    if few:
        builders[DROP_SYNC_FREE] = lambda: _plan(
            _moe(case, device, capacity_factor=1.25), ExpertGemms()
        )
        builders[DROP_ALL_SLOTS] = lambda: _moe(
            case, device, capacity_factor=1.25, expert_kernel="bmm"
        )
    if plan.row_align > 1:
        packed = replace(plan, row_align=1, w_down=GROUPED_MM, w_gate_up=GROUPED_MM)
        builders[PACKED_ROWS] = lambda: _plan(_moe(case, device), packed)
    if few:
        builders[FUSED_LOOP] = lambda: _moe(case, device, expert_kernel="cublas")
        builders[
            "mcore MoELayer dropless, one cuBLAS GEMM per expert, separate autograd ops (host sync)"
        ] = lambda: _moe(case, device, expert_kernel="cublas", fused_experts=False)
        builders["mcore MoELayer dropless, torch references of the kernels"] = lambda: _backend(
            _moe(case, device, fused_experts=False), "torch"
        )
        builders["mcore MoELayer dropless, expert loop"] = lambda: _moe(
            case, device, grouped_gemm=False
        )
        builders["transformers sparse MoE block (eager experts)"] = lambda: _wants_3d(
            _hf_block(case, device, "eager")
        )
    return builders


def _ratios(rows: list[dict]) -> None:
    """Add "vs dense" (the faster dense peer) and "vs transformers" to one case's rows, for
    the steady-state windows and (``*_from_idle``) for the windows started on an idle GPU.

    Rows timed in rounds also get each round's ratios (``throughput_vs_dense_rounds``,
    ``speedup_vs_hf_grouped_mm_rounds``: the round's windows divided, the dense peer the
    faster of the two in that round); the plain ratios divide the medians."""
    for key, suffix in (("ms", ""), ("ms_from_idle", "_from_idle")):
        times = {row["implementation"]: row.get(key) for row in rows}
        dense = min((t for k, t in times.items() if k in (DENSE, DENSE_FUSED) and t), default=None)
        hf = times.get(HF_GROUPED)
        for row in rows:
            if key in row:
                if dense:
                    row["throughput_vs_dense" + suffix] = dense / row[key]
                if hf:
                    row["speedup_vs_hf_grouped_mm" + suffix] = hf / row[key]
    windows = {row["implementation"]: row["windows_ms"] for row in rows if "windows_ms" in row}
    peers = {
        "throughput_vs_dense_rounds": [windows[k] for k in (DENSE, DENSE_FUSED) if k in windows],
        "speedup_vs_hf_grouped_mm_rounds": [windows[k] for k in (HF_GROUPED,) if k in windows],
    }
    for row in rows:
        for field, peer in peers.items():
            mine = row.get("windows_ms")
            if peer and mine and all(len(times) == len(mine) for times in peer):
                row[field] = round_ratios(peer, mine)


def _time_experts(layer: MoELayer, x: torch.Tensor, warmup: int, iters: int) -> float:
    """Milliseconds per forward + backward of the layer's experts alone, on the tokens already
    permuted into expert order (dropless) or into their capacity slots (drop-and-pad)."""
    experts, rows, grad = _experts_alone(layer, x)
    ms = _time(experts, rows, grad, warmup, iters)
    layer.zero_grad(set_to_none=True)
    return ms


def _experts_alone(
    layer: MoELayer, x: torch.Tensor
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The layer's experts as a module of their own, with its input (the tokens of ``x``
    already permuted into expert order, or capacity slots) and an output gradient."""
    moe = layer.moe_config
    with torch.no_grad():
        routing = layer.router(x)
    flat = routing.experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    permuted = x.index_select(0, order // moe.top_k).detach()
    counts = torch.bincount(flat, minlength=moe.num_experts)
    factor = layer.capacity_factor
    experts = layer.experts
    # The routing weights scale the activations inside the experts on this path.
    folded = moe.weights_in_experts and factor is None
    if layer.comm is not None and (layer.comm.ep_group is not None or layer.comm.etp_group):
        folded = False
    row_weights = routing.weights.reshape(-1)[order].detach() if folded else None
    capacity = (
        None if factor is None else expert_capacity(x.shape[0], moe.top_k, moe.num_experts, factor)
    )
    padded_dropless = False
    if capacity is None and experts.pads_dropless(flat.numel(), x):
        # Dropless on batched GEMMs: the experts run the padded slots.
        capacity = padded_capacity(counts, flat.numel())
        padded_dropless = capacity is not None
    one_rank = layer.comm is None or (layer.comm.ep_group is None and layer.comm.etp_group is None)
    packed = (
        capacity is not None
        and capacity >= PACKED_MIN_CAPACITY
        and one_rank
        and experts.expert_kernel != "bmm"
        and not padded_dropless
    )
    fused = experts.fuses_routing(x)
    # Dropless routing padded to the largest expert in the fused operation
    # (GroupedExperts.forward_slots); drop-and-pad's slots run the separate operations.
    slotted = fused and moe.weights_in_experts and one_rank and padded_dropless
    align = experts.plan_for(flat.numel(), x).row_align
    if fused and moe.weights_in_experts and one_rank and (capacity is None or packed):
        # The fused grouped experts' rows: dropless, or the kept rows of capacity routing,
        # packed or padded per expert to the plan's row multiple (empty rows: zero input and
        # zero weight).
        rows_order, _, offsets = aligned_rows(flat, order, counts, align, capacity=capacity)
        used = rows_order >= 0
        source = torch.where(used, rows_order, 0)
        permuted = (x.index_select(0, source // moe.top_k) * used[:, None]).detach()
        weights = routing.weights.reshape(-1).index_select(0, source)
        row_weights = (weights * used).detach()
        capacity = None
    slot_weights = None
    folded_slots = moe.weights_in_experts and one_rank
    if capacity is not None and folded_slots:
        slot_weights = torch.rand(moe.num_experts, capacity, device=x.device, dtype=x.dtype)

    if slotted:
        assert capacity is not None and slot_weights is not None
        ends = torch.arange(1, moe.num_experts + 1, device=x.device, dtype=torch.int32)
        offsets = ends * capacity
        row_weights = slot_weights.reshape(-1)
    elif not (fused and row_weights is not None):
        offsets = counts.cumsum(0).to(torch.int32)

    # The experts are a submodule, so that _time's zero_grad clears their gradients (else
    # every step would add into the previous step's gradients).
    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = experts

        def forward(self, rows: torch.Tensor) -> torch.Tensor:
            if slotted:
                # The layer's fused operation on equal slots, without gather and combine.
                return grouped_experts(
                    rows,
                    row_weights,
                    self.experts._gate_up_weight(),
                    self.experts.down_proj,
                    offsets,
                    self.experts.slot_plan(),
                )
            if capacity is None and fused and row_weights is not None:
                # The layer's fused operation without its gather and combine (same GEMM plan).
                plan = self.experts.plan_for(flat.numel(), rows)
                return grouped_experts(
                    rows,
                    row_weights,
                    self.experts._gate_up_weight(),
                    self.experts.down_proj,
                    offsets,
                    plan,
                )
            if capacity is None:
                return self.experts(rows, counts, row_weights)
            slots = rows.view(moe.num_experts, capacity, -1)
            return self.experts.forward_padded(slots, slot_weights).flatten(0, 1)

    if capacity is None:
        rows = permuted
    else:
        rows = torch.randn(moe.num_experts * capacity, x.shape[1], device=x.device, dtype=x.dtype)
    return Experts(), rows, torch.randn_like(rows)


def _session8_plan() -> ExpertGemms:
    """DeepSeek-V3 at 8192 tokens: the default plan of session 8 (the down projection and its
    input gradient on the persistent Triton kernels), against which this session's plan (also
    the gate/up projection and its input gradient on Triton) is measured."""
    wide = PersistentTiles(block_m=128, block_n=256, block_k=64, num_stages=4, flatten=True)
    wide3 = PersistentTiles(block_m=128, block_n=256, block_k=64, num_stages=3, flatten=True)
    return ExpertGemms(down=wide, d_act=wide3)


def _plan(layer: nn.Module, plan: ExpertGemms) -> nn.Module:
    layer.experts.gemm_plan = plan  # type: ignore[union-attr]
    return layer


def _backend(module: nn.Module, backend: str) -> nn.Module:
    module.kernel_backend = backend  # type: ignore[assignment]
    return module


def _wants_3d(module: nn.Module) -> nn.Module:
    module.wants_3d = True  # type: ignore[assignment]
    return module


def _ratio(row: dict, key: str) -> str:
    return f"{row[key]:.3f}x" if key in row else ""


def _range(row: dict, key: str, unit: str = "", digits: int = 2) -> str:
    """``min-max`` of a row's per-round list ``key`` (empty for rows timed once)."""
    values = [value for value in row.get(key) or () if value is not None]
    if not values:
        return ""
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}{unit}"


def _markdown(device_name: str, rows: list[dict]) -> str:
    lines = [
        f"MoE layer forward + backward on {device_name} (bf16 on GPU)",
        "",
        "ms, tokens/s, active TFLOP/s and the ratios: steady-state windows (untimed steps "
        'queued first, at least 100 ms timed); "from idle": the window started right after a '
        "synchronisation (the benchmark's measure until session 15). The rows with a round "
        "count (the dense layers, our dropless and drop-and-pad defaults, transformers' "
        "grouped_mm block) were built together and timed in rotated rounds after 2 s of "
        "continuous load: ms is the median of their windows, the ratios divide the medians, "
        '"rounds" gives the range of the windows and of each round\'s own ratio; the other '
        "rows were timed once each. SM MHz: the GPU's mean SM clock during the steady "
        "window(s) (median over the rounds).",
        "",
        "| case | implementation | tokens | ms | rounds: ms | SM MHz | ms from idle | "
        "tokens/s | active TFLOP/s | vs dense | rounds: vs dense | vs dense from idle | "
        "vs transformers grouped_mm | vs transformers from idle | outside expert GEMMs | "
        "peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "ms" not in row:
            lines.append(
                f"| {row['case']} | {row['implementation']} | {row['tokens']} | "
                f"error: {row.get('error', '')[:60]} |" + " |" * 12
            )
            continue
        share = f"{100 * row['non_gemm_share']:.0f}%" if "non_gemm_share" in row else ""
        peak = f"{row['peak_gib']:.1f}" if "peak_gib" in row else ""
        idle = f"{row['ms_from_idle']:.2f}" if "ms_from_idle" in row else ""
        mhz = f"{row['sm_mhz']:.0f}" if "sm_mhz" in row else ""
        windows = _range(row, "windows_ms")
        if windows:
            windows += f" ({row['rounds']})"
        lines.append(
            f"| {row['case']} | {row['implementation']} | {row['tokens']} | {row['ms']:.2f} | "
            f"{windows} | {mhz} | {idle} | {row['tokens_per_s']:,.0f} | "
            f"{row['active_tflops']:.0f} | {_ratio(row, 'throughput_vs_dense')} | "
            f"{_range(row, 'throughput_vs_dense_rounds', 'x', 3)} | "
            f"{_ratio(row, 'throughput_vs_dense_from_idle')} | "
            f"{_ratio(row, 'speedup_vs_hf_grouped_mm')} | "
            f"{_ratio(row, 'speedup_vs_hf_grouped_mm_from_idle')} | {share} | {peak} |"
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
        "--profile", action="store_true", help="also write moe_profile.md (top kernels)"
    )
    parser.add_argument(
        "--skip", nargs="*", default=[], help="leave out implementations containing these words"
    )
    parser.add_argument(
        "--only", nargs="*", default=[], help="run only implementations containing these words"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help="rotated rounds of the ratio rows (at most 3 at 32k tokens; 0: one window each)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 0:
        parser.error(f"--rounds={args.rounds} must be at least 0")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    rows: list[dict] = []
    profiles: list[str] | None = [] if args.profile else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = _dtype(device)
    global CLOCK
    CLOCK = ClockSampler.open(device)

    def write(case_rows: list[dict]) -> None:
        # Written after every row, so that an interrupted run keeps what it measured.
        every = rows + case_rows
        result = {
            "device": device_name,
            "torch": torch.__version__,
            "dtype": str(dtype).removeprefix("torch."),
            "grouped_mm_supported": grouped_mm_supported(device, dtype),
            "rounds": args.rounds,
            "sm_clock_sampled": CLOCK is not None,
            "rows": every,
        }
        (out / "moe.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "moe.md").write_text(_markdown(device_name, every))
        if profiles is not None:
            header = (
                f"Kernels of every mcore and dense row on {device_name} (torch.profiler, two "
                "forward + backward steps; the twelve kernels with the most device time).\n\n"
            )
            (out / "moe_profile.md").write_text(header + "".join(profiles))

    for name, case in (SMOKE if args.smoke else CASES).items():
        if args.cases and name not in args.cases:
            continue
        rows.extend(
            run_case(
                name,
                case,
                device,
                args.smoke,
                profiles,
                args.skip,
                write,
                rounds=args.rounds,
                only=args.only,
            )
        )
        write([])
    if CLOCK is not None:
        CLOCK.close()
    print(_markdown(device_name, rows), flush=True)


if __name__ == "__main__":
    main()
