"""GPU tensors: async staging through pinned memory, and loads into GPU or CPU tensors."""

from __future__ import annotations

import pytest
import torch

import mcore_ckpt
from mcore_parallel.sharding import ShardedTensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_async_save_of_gpu_tensors_snapshots_them_before_returning(tmp_path):
    weights = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    expected = weights.cpu()
    handle = mcore_ckpt.save(tmp_path, {"w": weights}, async_save=True)
    weights.fill_(3.0)
    handle.wait()
    target = {"w": torch.zeros(256, 512, dtype=torch.bfloat16, device="cuda")}
    mcore_ckpt.load(tmp_path, target)
    assert torch.equal(target["w"].cpu(), expected)
    mcore_ckpt.release_staging_buffers(tmp_path)


def test_gpu_blocks_save_and_load_into_cpu_blocks_of_another_split(tmp_path):
    full = torch.arange(64.0, device="cuda").reshape(8, 8)
    mcore_ckpt.save(tmp_path, {"w": ShardedTensor(full.clone(), (8, 8), (0, 0))})
    block = ShardedTensor(torch.zeros(8, 3), (8, 8), (0, 5))
    mcore_ckpt.load(tmp_path, {"w": block})
    assert torch.equal(block.local, full[:, 5:].cpu())
