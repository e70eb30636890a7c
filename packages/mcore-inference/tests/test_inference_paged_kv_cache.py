"""PagedKVCache against the models package's contiguous reference cache."""

import pytest
import torch

from mcore_inference import KVCacheStepError, PagedKVCache
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.kv_cache import ContiguousKVCache


def _step_metadata(cache, positions_per_request, tables):
    positions, rows = [], []
    for request, positions_of_request in enumerate(positions_per_request):
        positions += positions_of_request
        rows += [request] * len(positions_of_request)
    position = torch.tensor(positions)
    table = tables[torch.tensor(rows)]
    blocks = table.gather(1, (position // cache.block_size)[:, None])[:, 0].long()
    slot_mapping = blocks * cache.block_size + position % cache.block_size
    cache.set_step(slot_mapping, table, (position + 1).to(torch.int32))


def test_paged_cache_matches_contiguous_caches_over_interleaved_steps():
    config = GPTConfig.from_name("tiny")
    heads, kv_heads, dim = 4, 2, 8
    paged = PagedKVCache(
        num_layers=1,
        num_blocks=12,
        block_size=4,
        num_kv_heads=kv_heads,
        head_dim=dim,
        dtype=torch.float32,
        device=torch.device("cpu"),
        split_size=8,
    )
    # Two requests with shuffled, interleaved physical blocks.
    tables = torch.tensor([[5, 2, 9, 0], [7, 1, 11, 3]], dtype=torch.int32)
    references = [ContiguousKVCache(config, 16), ContiguousKVCache(config, 16)]
    generator = torch.Generator().manual_seed(0)
    # Step 1: a 6-token prefill of request 0 and a 3-token one of request 1; then decodes.
    schedule = [([0, 1, 2, 3, 4, 5], [0, 1, 2]), ([6], [3, 4, 5, 6]), ([7], [7]), ([8], [8])]
    for positions in schedule:
        total = sum(len(p) for p in positions)
        q = torch.randn(total, heads, dim, generator=generator)
        k = torch.randn(total, kv_heads, dim, generator=generator)
        v = torch.randn(total, kv_heads, dim, generator=generator)
        _step_metadata(paged, positions, tables)
        out = paged.attend(0, q, k, v, scale=0.35)
        start = 0
        for request, positions_of_request in enumerate(positions):
            rows = slice(start, start + len(positions_of_request))
            expected = references[request].attend(0, q[rows], k[rows], v[rows], scale=0.35)
            torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
            start += len(positions_of_request)


def test_attend_without_step_metadata_raises():
    paged = PagedKVCache(
        num_layers=1,
        num_blocks=2,
        block_size=4,
        num_kv_heads=1,
        head_dim=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
        split_size=4,
    )
    with pytest.raises(RuntimeError, match="set_step") as raised:
        paged.attend(0, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), scale=1)
    assert isinstance(raised.value, KVCacheStepError)
