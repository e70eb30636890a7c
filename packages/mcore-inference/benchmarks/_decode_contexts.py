"""GPU time of the captured batch-1 decode step by context length, for ``bench_decode.py``.

The engine's fused forward of one token (every layer and the LM head; no sampling, no host
work) over a paged cache holding ``context`` positions, captured in a CUDA graph with
programmatic dependent launch as the engine captures it (block table one attention split wide
where the context fits in one split, as the engine's narrow decode graph), timed over
back-to-back replays. Each context runs twice: with the fused decoder's attention inside the o
projection (``FusedDecoder(attention_in_o_proj=True)``: splits of 32 positions merged by the o
projection) and with the attention kernel before the o projection; the argmax of both steps'
logits is compared.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_inference.fused_decode import FusedDecoder
from mcore_inference.kv_cache import PagedKVCache


def _captured_step_us(
    decoder: FusedDecoder, cache: PagedKVCache, tables: torch.Tensor, context: int
) -> tuple[float, torch.Tensor]:
    device = tables.device
    position = torch.tensor([context - 1], device=device)
    row = torch.zeros(1, dtype=torch.long, device=device)
    token = torch.tensor([[1]], device=device)

    def step() -> torch.Tensor:
        cache.prepare_step(tables, position, row)
        return decoder.logits(token, position[None], kv_cache=cache)

    return captured_replay_us(step, device)


def captured_replay_us(
    step: Any, device: torch.device, *, warm_replays: int = 5, replays: int = 40
) -> tuple[float, torch.Tensor]:
    """Capture ``step`` in a CUDA graph and time back-to-back replays.

    Args:
        step: A callable returning a tensor; it runs twice on a side stream before capture.
        device: The CUDA device.
        warm_replays: Replays before timing.
        replays: Replays per timed round (best of three rounds).

    Returns:
        The best round's microseconds per replay and a copy of the captured output.
    """
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        output = step()
    for _ in range(warm_replays):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / replays)
    result = output.clone()
    graph.reset()
    return best, result


def context_sweep(model: Any, contexts: list[int], *, split_size: int = 256) -> list[dict]:
    """Captured batch-1 step time by context, attention inside the o projection or not.

    Args:
        model: A dense ``GPTModel`` on a CUDA device (random weights are fine).
        contexts: Context lengths (positions attended, the new token included).
        split_size: The cache's attention split (the engine's ``attention_split_size``).

    Returns:
        One dict per context: ``context``, ``fused_us`` and ``unfused_us`` (GPU time of one
        captured step), ``argmax_equal`` (the two steps' greedy tokens agree).
    """
    config = model.config
    device = next(model.parameters()).device
    block_size = 16
    width = max(-(-max(contexts) // block_size), split_size // block_size)
    cache = PagedKVCache(
        num_layers=config.num_layers,
        num_blocks=width + 1,
        block_size=block_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.kv_channels,
        dtype=next(model.parameters()).dtype,
        device=device,
        split_size=split_size,
    )
    generator = torch.Generator(device=device).manual_seed(0)
    cache.keys.normal_(generator=generator)
    cache.values.normal_(generator=generator)
    table = (torch.arange(width, device=device, dtype=torch.int32) + 1)[None]
    decoders = {
        fused: FusedDecoder(
            model, pdl=True, max_positions=width * block_size, attention_in_o_proj=fused
        )
        for fused in (True, False)
    }
    rows = []
    for context in contexts:
        # The engine's narrow graph while the context fits in one split, else the full table.
        narrow = split_size // block_size
        tables = table[:, :narrow] if context <= split_size else table
        fused_us, fused_logits = _captured_step_us(decoders[True], cache, tables, context)
        unfused_us, unfused_logits = _captured_step_us(decoders[False], cache, tables, context)
        rows.append(
            {
                "context": context,
                "fused_us": fused_us,
                "unfused_us": unfused_us,
                "argmax_equal": bool(fused_logits.argmax() == unfused_logits.argmax()),
            }
        )
        print(rows[-1], flush=True)
    return rows
