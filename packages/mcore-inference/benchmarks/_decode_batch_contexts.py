"""GPU time of the captured decode step by batch size and context length, for ``bench_decode.py``.

The engine's fused forward of one token per row (every layer and the LM head; no sampling, no
host work), every row at the same ``context`` over its own blocks of a paged cache filled with
random keys and values, captured in a CUDA graph as the engine captures it (the decoder of
``build_fused_decoder`` with PDL; a block table one attention split wide where the context fits
in one split), timed over back-to-back replays. Per batch size, a least-squares line through
the contexts splits the step into a part that does not depend on the context (weights, GEMMs,
norms, LM head) and one that grows with it (the attention reading the cache): its slope gives
the bytes of cache the attention reads per microsecond.
"""

from __future__ import annotations

from typing import Any

import torch
from _decode_contexts import captured_replay_us

from mcore_inference.fused_decode import build_fused_decoder
from mcore_inference.kv_cache import PagedKVCache


def _replay_us(step: Any, device: torch.device) -> float:
    return captured_replay_us(step, device, warm_replays=3, replays=20)[0]


def _step_us(
    decoder: Any,
    cache: PagedKVCache,
    tables: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
) -> float:
    def step() -> torch.Tensor:
        cache.prepare_step(tables, positions, rows)
        return decoder.logits(tokens, positions[None], kv_cache=cache)

    try:
        return _replay_us(step, positions.device)
    finally:
        cache.clear_step()


def batch_context_sweep(
    model: Any,
    batches: list[int],
    contexts: list[int],
    *,
    split_size: int = 512,
    block_size: int = 16,
) -> list[dict]:
    """Captured step time by batch and context, with the context-free part and the slope.

    Args:
        model: A dense ``GPTModel`` on a CUDA device (random weights are fine).
        batches: Batch sizes (rows of the step).
        contexts: Context lengths (positions attended, the new token included).
        split_size: The cache's attention split (the engine's ``attention_split_size``).
        block_size: Tokens per cache block.

    Returns:
        One dict per batch size: ``batch``, ``contexts``, ``step_us`` (per context),
        ``fixed_us`` and ``us_per_context_token`` (the fitted line), ``kv_bytes_per_token``
        and ``attention_bytes_per_s`` (cache bytes the growing part reads per second).
    """
    config = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.kv_channels * 2
    width = max(-(-max(contexts) // block_size), split_size // block_size)
    decoder = build_fused_decoder(model, True, pdl=True, max_positions=width * block_size)
    assert decoder is not None, "needs a model the fused decoder serves"
    results = []
    for batch in batches:
        cache = PagedKVCache(
            num_layers=config.num_layers,
            num_blocks=batch * width + 1,
            block_size=block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.kv_channels,
            dtype=dtype,
            device=device,
            split_size=split_size,
        )
        generator = torch.Generator(device=device).manual_seed(0)
        cache.keys.normal_(generator=generator)
        cache.values.normal_(generator=generator)
        table = (torch.arange(batch * width, device=device, dtype=torch.int32) + 1).view(
            batch, width
        )
        rows = torch.arange(batch, device=device)
        tokens = torch.ones((1, batch), dtype=torch.long, device=device)
        times = []
        for context in contexts:
            tables = table[:, : split_size // block_size] if context <= split_size else table
            positions = torch.full((batch,), context - 1, dtype=torch.long, device=device)
            times.append(_step_us(decoder, cache, tables, positions, rows, tokens))
        # Least squares: step_us = fixed + slope * context.
        count = len(contexts)
        mean_c, mean_t = sum(contexts) / count, sum(times) / count
        spread = sum((c - mean_c) ** 2 for c in contexts)
        slope = (
            sum((c - mean_c) * (t - mean_t) for c, t in zip(contexts, times, strict=True)) / spread
            if spread
            else float("nan")
        )
        result = {
            "batch": batch,
            "contexts": list(contexts),
            "step_us": times,
            "fixed_us": mean_t - slope * mean_c,
            "us_per_context_token": slope,
            "kv_bytes_per_token": kv_bytes_per_token,
            "attention_bytes_per_s": batch * kv_bytes_per_token / (slope * 1e-6)
            if slope > 0
            else float("nan"),
        }
        print(result, flush=True)
        results.append(result)
        cache.clear_step()
        torch.cuda.empty_cache()
    return results
