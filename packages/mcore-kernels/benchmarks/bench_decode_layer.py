"""A decode step's decoder layers at batch 1: ``decode_layer_tail`` against the ``decode_gemv`` chain.

Workload: the decoder layers of a Qwen2.5-0.5B-shaped model (24 layers, hidden 896, 14 query
and 2 key/value heads of 64 channels, FFN 4864; random bf16 weights, QKV bias) for one token
at a context of ``--context`` positions in a paged cache of 16-position blocks. Two ways,
each captured in one CUDA graph with programmatic dependent launch and replayed back to back:

- ``chain``: per layer ``decode_gemv`` q/k/v (RMSNorm, bias, RoPE, cache write), the paged
  attention, ``decode_gemv`` o (+ residual), gate/up (RMSNorm, SwiGLU), down (+ residual): five
  launches, as the engine's fused decoder runs today;
- ``tail``: the first layer's q/k/v as above, then per layer the attention and one
  ``decode_layer_tail`` launch (o, gate/up, down and the next layer's q/k/v);
- ``layer``: the first layer's q/k/v as above, then per layer one ``decode_layer`` launch (the
  attention too);
- ``model``: the first layer's q/k/v as above, then one ``decode_model`` launch for every layer.

Both must give the same residual stream and cache up to float32 sum order (checked). The
weights of all layers (about 715 MB) exceed the L2 cache, so each replay streams them from HBM;
``% copy`` is the weight bytes over the step time against a device-to-device copy.

Run from the repository root on one GPU::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-kernels/benchmarks/bench_decode_layer.py --out $OUT/kernels
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from mcore_kernels import decode_layer_launch
from mcore_kernels.decode_gemv import decode_gemv
from mcore_kernels.decode_layer import (
    LayerAttention,
    LayerTailConfig,
    NextProjection,
    decode_layer,
    decode_layer_tail,
)
from mcore_kernels.decode_model import DecoderLayerWeights, decode_model
from mcore_kernels.paged_attention import paged_attention
from mcore_kernels.pdl import programmatic_dependent_launch
from mcore_kernels.rotary_kv_write import RotaryCacheWrite

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 896, 14, 2, 64, 4864, 24
BLOCK = 16


def _copy_bandwidth() -> float:
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    torch.cuda.synchronize()
    return 2 * (1 << 30) * 10 / (start.elapsed_time(end) / 1000)


def _layers(generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    def weight(*shape: int, scale: float = 0.03) -> torch.Tensor:
        return (torch.randn(shape, generator=generator, device="cuda") * scale).bfloat16()

    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return [
        {
            "qkv": weight(qkv, HIDDEN),
            "qkv_bias": weight(qkv, scale=0.1),
            "in_norm": 1 + weight(HIDDEN, scale=0.1),
            "o": weight(HIDDEN, HEADS * HEAD_DIM),
            "post_norm": 1 + weight(HIDDEN, scale=0.1),
            "gate_up": weight(2 * FFN, HIDDEN),
            "down": weight(HIDDEN, FFN, scale=0.015),
        }
        for _ in range(LAYERS)
    ]


def _step_inputs(context: int, generator: torch.Generator) -> dict:
    blocks = -(-context // BLOCK) + 1
    shape = (LAYERS, blocks, BLOCK, KV_HEADS, HEAD_DIM)
    initial = (torch.randn(shape, generator=generator, device="cuda") * 0.5).bfloat16()
    order = torch.randperm(blocks, generator=generator, device="cuda").to(torch.int32)
    position = context - 1
    slot = order[position // BLOCK].long() * BLOCK + position % BLOCK
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM))
    angles = (position * inv_freq)[None]
    return {
        "initial": initial,
        "tables": order[None],
        "lens": torch.tensor([context], dtype=torch.int32, device="cuda"),
        "slots": slot.reshape(1),
        "cos": angles.cos(),
        "sin": angles.sin(),
        "x": torch.randn((1, HIDDEN), generator=generator, device="cuda").bfloat16(),
    }


def _rope(inputs: dict, cache: tuple, index: int) -> RotaryCacheWrite:
    return RotaryCacheWrite(
        cos=inputs["cos"],
        sin=inputs["sin"],
        k_cache=cache[0][index],
        v_cache=cache[1][index],
        slot_mapping=inputs["slots"],
        num_q_heads=HEADS,
    )


def _attend(q: torch.Tensor, inputs: dict, cache: tuple, index: int) -> torch.Tensor:
    out = paged_attention(
        q.unflatten(-1, (HEADS, HEAD_DIM)),
        cache[0][index],
        cache[1][index],
        inputs["tables"],
        inputs["lens"],
        scale=HEAD_DIM**-0.5,
    )
    return out.flatten(-2)


def _chain(layers: list, inputs: dict, cache: tuple) -> torch.Tensor:
    residual = inputs["x"]
    for index, layer in enumerate(layers):
        q = decode_gemv(
            residual,
            layer["qkv"],
            layer["qkv_bias"],
            norm_weight=layer["in_norm"],
            rope=_rope(inputs, cache, index),
        )
        out = _attend(q, inputs, cache, index)
        residual = decode_gemv(out, layer["o"], residual=residual)
        activation = decode_gemv(
            residual, layer["gate_up"], norm_weight=layer["post_norm"], swiglu=True
        )
        residual = decode_gemv(activation, layer["down"], residual=residual)
    return residual


def _model(layers: list, inputs: dict, cache: tuple, config: LayerTailConfig) -> torch.Tensor:
    first = layers[0]
    q = decode_gemv(
        inputs["x"],
        first["qkv"],
        first["qkv_bias"],
        norm_weight=first["in_norm"],
        rope=_rope(inputs, cache, 0),
    )
    stacked = [
        DecoderLayerWeights(
            qkv_weight=layer["qkv"],
            qkv_bias=layer["qkv_bias"],
            input_norm_weight=layer["in_norm"],
            o_weight=layer["o"],
            o_bias=None,
            post_norm_weight=layer["post_norm"],
            gate_up_weight=layer["gate_up"],
            down_weight=layer["down"],
        )
        for layer in layers
    ]
    return decode_model(
        q,
        inputs["x"],
        layers=stacked,
        k_cache=cache[0],
        v_cache=cache[1],
        block_tables=inputs["tables"],
        context_lens=inputs["lens"],
        slot_mapping=inputs["slots"],
        cos=inputs["cos"],
        sin=inputs["sin"],
        scale=HEAD_DIM**-0.5,
        config=config,
    )


def _tail(
    layers: list, inputs: dict, cache: tuple, config: LayerTailConfig, attend: bool
) -> torch.Tensor:
    residual = inputs["x"]
    first = layers[0]
    q = decode_gemv(
        residual,
        first["qkv"],
        first["qkv_bias"],
        norm_weight=first["in_norm"],
        rope=_rope(inputs, cache, 0),
    )
    for index, layer in enumerate(layers):
        following = None
        if index + 1 < len(layers):
            nxt = layers[index + 1]
            following = NextProjection(
                weight=nxt["qkv"],
                bias=nxt["qkv_bias"],
                norm_weight=nxt["in_norm"],
                norm_eps=1e-6,
                rope=_rope(inputs, cache, index + 1),
            )
        weights = {
            "o_weight": layer["o"],
            "post_norm_weight": layer["post_norm"],
            "gate_up_weight": layer["gate_up"],
            "down_weight": layer["down"],
            "next_qkv": following,
            "config": config,
        }
        if attend:
            attention = LayerAttention(
                k_cache=cache[0][index],
                v_cache=cache[1][index],
                block_tables=inputs["tables"],
                context_lens=inputs["lens"],
                scale=HEAD_DIM**-0.5,
            )
            residual, q = decode_layer(q, residual, attention=attention, **weights)
        else:
            out = _attend(q, inputs, cache, index)
            residual, q = decode_layer_tail(out, residual, **weights)
    return residual


def _graph_us(fn, cache: tuple, initial: torch.Tensor, replays: int) -> tuple[float, torch.Tensor]:
    """Microseconds per replay of ``fn`` captured under PDL, and its output after one replay."""
    with programmatic_dependent_launch(True):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    cache[0].copy_(initial)
    cache[1].copy_(initial)
    graph.replay()
    torch.cuda.synchronize()
    result = out.clone()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays, result


PHASES = ("wait", "attention", "o", "gate_up", "down", "qkv")
"""Intervals between the kernel's clock stamps (see ``decode_layer._TIMING``)."""


def _phase_times(
    layers: list, inputs: dict, cache: tuple, config: LayerTailConfig, attend: bool
) -> dict[str, float]:
    """Microseconds of each phase of one layer's launch (median of 5 cold-L2 launches).

    A phase ends when its last program passes the next stamp: the intervals between the
    latest stamps of successive points (``wait`` counts from the earliest program start).
    """
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    layer, nxt = layers[0], layers[1]
    timings = []
    for _ in range(5):
        flush.zero_()  # evicts the layer's weights from L2
        buffer = torch.zeros((4096, 8), dtype=torch.int64, device="cuda")
        decode_layer_launch._TIMING[:] = [buffer]
        try:
            following = NextProjection(
                weight=nxt["qkv"],
                bias=nxt["qkv_bias"],
                norm_weight=nxt["in_norm"],
                norm_eps=1e-6,
                rope=_rope(inputs, cache, 1),
            )
            weights = {
                "o_weight": layer["o"],
                "post_norm_weight": layer["post_norm"],
                "gate_up_weight": layer["gate_up"],
                "down_weight": layer["down"],
                "next_qkv": following,
                "config": config,
            }
            q = torch.randn((1, HEADS * HEAD_DIM), device="cuda").bfloat16()
            residual = inputs["x"]
            with programmatic_dependent_launch(True):
                if attend:
                    attention = LayerAttention(
                        k_cache=cache[0][0],
                        v_cache=cache[1][0],
                        block_tables=inputs["tables"],
                        context_lens=inputs["lens"],
                        scale=HEAD_DIM**-0.5,
                    )
                    decode_layer(q, residual, attention=attention, **weights)
                else:
                    decode_layer_tail(_attend(q, inputs, cache, 0), residual, **weights)
            torch.cuda.synchronize()
        finally:
            decode_layer_launch._TIMING[:] = []
        stamps = buffer[(buffer[:, 0] > 0)].double() / 1000
        latest = stamps.max(dim=0).values
        points = [stamps[:, 0].min().item(), latest[1].item() if attend else None]
        points += [latest[k].item() for k in range(2, 7)]
        if not attend:
            points[1] = points[0]
            points[2] = stamps[:, 0].max().item()
        timings.append([b - a for a, b in itertools.pairwise(points)])
    medians = torch.tensor(timings).median(dim=0).values.tolist()
    return dict(zip(PHASES, medians, strict=True))


def _parse_configs(text: str) -> list[LayerTailConfig]:
    configs = []
    for item in filter(None, text.split(";")):
        pps, warps, bo, bgu, bd, bq, prefetch, sleep = (int(v) for v in item.split(","))
        configs.append(
            LayerTailConfig(
                programs_per_sm=pps,
                num_warps=warps,
                block_n_o=bo,
                block_n_gate_up=bgu,
                block_n_down=bd,
                block_n_qkv=bq,
                prefetch_l2=bool(prefetch),
                barrier_sleep_ns=sleep,
            )
        )
    return configs or [LayerTailConfig()]


def main() -> None:
    """Run the benchmark and write ``decode_layer.json`` and ``decode_layer.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument(
        "--ways", default="tail,layer,model", help="persistent ways besides the chain"
    )
    parser.add_argument(
        "--phase-times",
        action="store_true",
        help="also time each phase of one layer's launch from the kernel's clock stamps",
    )
    parser.add_argument(
        "--configs",
        default="",
        help="LayerTailConfig sweep: 'programs_per_sm,warps,bn_o,bn_gate_up,bn_down,bn_qkv,"
        "prefetch_l2,barrier_sleep_ns;...'",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    layers = _layers(generator)
    inputs = _step_inputs(args.context, generator)
    weight_bytes = sum(t.nbytes for layer in layers for t in layer.values())
    bandwidth = _copy_bandwidth()
    cache = (inputs["initial"].clone(), inputs["initial"].clone())
    rows = []
    chain_us, expected = _graph_us(
        lambda: _chain(layers, inputs, cache), cache, inputs["initial"], args.replays
    )
    expected_cache = (cache[0].clone(), cache[1].clone())
    rows.append({"way": "chain", "us": chain_us})
    print(json.dumps(rows[-1]), flush=True)
    ways = [
        (way, config) for config in _parse_configs(args.configs) for way in args.ways.split(",")
    ]
    for way, config in ways:
        row: dict = {"way": way, "config": str(config)}
        try:
            us, actual = _graph_us(
                lambda config=config, way=way: (
                    _model(layers, inputs, cache, config)
                    if way == "model"
                    else _tail(layers, inputs, cache, config, way == "layer")
                ),
                cache,
                inputs["initial"],
                args.replays,
            )
            row["us"] = us
            row["max_abs_diff"] = (actual.float() - expected.float()).abs().max().item()
            row["cache_max_abs_diff"] = max(
                (a.float() - b.float()).abs().max().item()
                for a, b in zip(cache, expected_cache, strict=True)
            )
            if args.phase_times and way != "model":
                row["phase_us"] = _phase_times(layers, inputs, cache, config, way == "layer")
        except Exception as error:  # a configuration that does not compile or fit
            row["error"] = repr(error)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    for row in rows:
        if "us" in row:
            row["copy_fraction"] = weight_bytes / (row["us"] * 1e-6) / bandwidth
    result = {
        "benchmark": "decode_layer",
        "device": torch.cuda.get_device_name(),
        "context": args.context,
        "weight_bytes": weight_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "rows": rows,
        "elapsed_s": time.perf_counter() - started,
    }
    (out_dir / "decode_layer.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"Decoder layers of one decode token (Qwen2.5-0.5B shape, 24 layers, context "
        f"{args.context}); {result['device']}, copy {bandwidth / 1e12:.2f} TB/s; CUDA graph "
        "with PDL.",
        "",
        "| way | config | us per step | % copy | max abs diff | cache max abs diff |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['way']} | {row.get('config', '-')} | {row.get('us', float('nan')):.1f} | "
            f"{100 * row.get('copy_fraction', float('nan')):.0f}% | "
            f"{row.get('max_abs_diff', 0.0):.3g} | {row.get('cache_max_abs_diff', 0.0):.3g} | "
            + (f" {row['error']}" if "error" in row else "")
        )
    timed = [row for row in rows if "phase_us" in row]
    if timed:
        lines += [
            "",
            "One layer's launch, cold L2 (median of 5): microseconds until the last program "
            "passes each point (`wait`: from the first program's start to the PDL wait's end; "
            "the `tail` way has no attention phase; each phase includes its grid barrier).",
            "",
            "| way | config | " + " | ".join(PHASES) + " |",
            "|---|---|" + "---:|" * len(PHASES),
        ]
        lines += [
            f"| {row['way']} | {row['config']} | "
            + " | ".join(f"{row['phase_us'][phase]:.1f}" for phase in PHASES)
            + " |"
            for row in timed
        ]
    (out_dir / "decode_layer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
