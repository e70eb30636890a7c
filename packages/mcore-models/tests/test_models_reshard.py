"""Resharder: weights move from a training layout to an inference layout by their slices only.

World 4: the source is the model at tp=2 x pp=2 (perturbed, as after an optimizer step); the
destinations are the same model at tp=1 (every rank a whole replica, as for dp=4 generation)
and at tp=2 (dp=2). After a push every destination equals the source weights gathered, and
every rank received exactly the bytes of its destination blocks that it did not hold itself; a
source replicated on every rank (dp=4) is copied locally, nothing travels.
"""

from __future__ import annotations

import torch

from mcore_models import GPTConfig, GPTModel, build_pipeline_stages, parallelize
from mcore_models.errors import ModelConfigError
from mcore_models.gather import gather_full_tensors
from mcore_models.reshard import Resharder
from mcore_parallel import initialize
from mcore_parallel.testing import run_distributed

CONFIG = GPTConfig.from_name("tiny", num_layers=4, tie_word_embeddings=True, seed=41)


def _perturb(chunks: list[GPTModel]) -> None:
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                param.add_(0.01 * (1 + len(name)))


def _reshard() -> dict:
    train_state = initialize(tp=2, pp=2)
    source = build_pipeline_stages(CONFIG, train_state)
    _perturb(source)
    _, expected = gather_full_tensors(source, train_state, every_rank=True)
    results: dict = {}
    for name, tp in (("tp1_dp4", 1), ("tp2_dp2", 2)):
        infer_state = initialize(tp=tp)
        destination = parallelize(GPTModel(CONFIG.replace(seed=99)), infer_state)
        storages = [p.data_ptr() for p in destination.parameters()]
        resharder = Resharder(source, [destination])
        stats = resharder.push()
        _, got = gather_full_tensors([destination], infer_state, every_rank=True)
        held = sum(p.numel() * p.element_size() for p in destination.parameters())
        results[name] = {
            "error": max((got[k] - expected[k]).abs().max().item() for k in expected),
            "same_storage": storages == [p.data_ptr() for p in destination.parameters()],
            "received_plus_local": stats.bytes_received + stats.bytes_local,
            "held": held,
            "sent": stats.bytes_sent,
            "received": stats.bytes_received,
        }
    # A source replicated on every rank (dp=4): each rank copies its blocks locally.
    replicated = parallelize(GPTModel(CONFIG), initialize(tp=1))
    _perturb([replicated])
    infer_state = initialize(tp=2)
    destination = parallelize(GPTModel(CONFIG.replace(seed=99)), infer_state)
    stats = Resharder([replicated], [destination]).push()
    _, got = gather_full_tensors([destination], infer_state, every_rank=True)
    whole = dict(replicated.named_parameters())
    results["replicated"] = {
        "error": max((got[k] - whole[k]).abs().max().item() for k in got),
        "moved": (stats.bytes_sent, stats.bytes_received),
        "local": stats.bytes_local,
        "held": sum(p.numel() * p.element_size() for p in destination.parameters()),
    }
    wrong = parallelize(GPTModel(CONFIG.replace(hidden_size=32, seed=1)), initialize(tp=1))
    try:
        Resharder(source, [wrong])
    except ModelConfigError as error:
        results["error_message"] = str(error)
    return results


def test_reshard_tp2_pp2_into_tp1_and_tp2_moves_only_the_needed_slices():
    results = run_distributed(_reshard, 4)
    for layout in ("tp1_dp4", "tp2_dp2"):
        assert sum(r[layout]["sent"] for r in results) == sum(
            r[layout]["received"] for r in results
        )
        for result in results:
            entry = result[layout]
            assert entry["error"] == 0.0, (layout, entry)
            assert entry["same_storage"]
            # Exactly the destination blocks arrive (tied embedding counted once).
            assert entry["received_plus_local"] <= entry["held"], (layout, entry)
            assert entry["received_plus_local"] >= entry["held"] - 256 * 64 * 4, (layout, entry)
    assert "embedding.weight" in results[0]["error_message"]
    for result in results:
        entry = result["replicated"]
        assert entry["error"] == 0.0 and entry["moved"] == (0, 0), entry
        assert entry["local"] == entry["held"], entry
