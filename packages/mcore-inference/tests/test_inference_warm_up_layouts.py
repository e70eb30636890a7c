"""``InferenceEngine.warm_up`` on the engines whose steps are collective or stateful: a hybrid
(Mamba) model, pipeline stages (pp=2) and expert-parallel ranks (ep=2). After it, no step launches
a Triton kernel under a specialisation it did not launch.

On the CPU the kernels run in Triton's interpreter (fresh processes: Triton decides at import
whether it interprets); ``SpecializationLog`` computes the key Triton would compile under for
every launch. Each case also runs a warm-up shortened to one token count, which must miss some
of the sweep's keys (so the check can fail). The GPU test checks Triton's compile hook after
``capture_graphs`` of a hybrid model, which also captures its decode and non-decode graphs.
"""

from __future__ import annotations

import dataclasses
import random
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest
import torch
from _engine_configs import small_engine_config

from mcore_inference import InferenceEngine, SamplingParams

VOCAB = 64


def _sweep_requests(seed: int, rounds: int) -> list[list[tuple[list[int], int]]]:
    """Per round, requests ``(prompt, max_tokens)``: 1 to 4 of them, prompts of 1 to 20 tokens."""
    rng = random.Random(seed)
    return [
        [
            ([rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))], rng.randint(1, 4))
            for _ in range(rng.randint(1, 4))
        ]
        for _ in range(rounds)
    ]


def _keys(engine: InferenceEngine, rounds: list[list[tuple[list[int], int]]]) -> dict:
    """Keys of a warm-up shortened to one token count, of the warm-up and of a sweep."""
    import mcore_inference.warmup as warmup
    from mcore_kernels.specialization_log import SpecializationLog

    full_counts = warmup.warm_up_counts
    warmup.warm_up_counts = lambda limit, extra=(): (1,)  # type: ignore[assignment]
    try:
        with SpecializationLog() as short:
            short_forwards = engine.warm_up()
    finally:
        warmup.warm_up_counts = full_counts  # type: ignore[assignment]
    with SpecializationLog() as warm:
        forwards = engine.warm_up()
    with SpecializationLog() as sweep:
        for requests in rounds:
            params = [SamplingParams(temperature=0.0, max_tokens=n) for _, n in requests]
            if requests:
                params[0] = SamplingParams(temperature=0.8, top_k=5, max_tokens=requests[0][1],
                                           return_logprobs=True, seed=3)  # fmt: skip
            engine.generate([prompt for prompt, _ in requests], params)
    return {
        "short": short.keys,
        "warm": warm.keys,
        "sweep": sweep.keys,
        "forwards": forwards,
        "short_forwards": short_forwards,
    }


def _check(report: dict, where: str) -> None:
    assert report["forwards"] > report["short_forwards"] > 0, where
    # The sweep needs variants a one-count warm-up does not launch (so the check can fail) ...
    assert report["sweep"] - report["short"], where
    # ... and the warm-up launched every one of them.
    missing = sorted(report["sweep"] - report["warm"], key=str)
    assert not missing, f"{where}: {len(missing)} specialisations after warm-up: {missing}"


def _hybrid_keys() -> dict:
    from mcore_models.mamba import HybridModel, hybrid_preset

    torch.set_num_threads(1)
    model = HybridModel(hybrid_preset("tiny-hybrid", seed=7)).eval()
    with InferenceEngine(model, small_engine_config()) as engine:
        return _keys(engine, _sweep_requests(5, 4))


def _distributed_keys(layout: str) -> dict:
    from mcore_models import GPTConfig, GPTModel, MoEConfig, parallelize
    from mcore_parallel import initialize

    torch.set_num_threads(1)
    if layout == "pp2":
        state = initialize(pp=2)
        config = GPTConfig.from_name("tiny", vocab_size=VOCAB, num_layers=2, seed=4)
        # Both stages serve the same requests (one model replica).
        rounds = _sweep_requests(6, 3)
    else:
        state = initialize(ep=2)
        moe = MoEConfig(num_experts=4, top_k=2, dispatcher="alltoall")
        config = GPTConfig.from_name("tiny", vocab_size=VOCAB, num_layers=1, moe=moe, seed=11)
        # Each rank serves its own requests (none in some rounds): lockstep padding steps.
        rounds = _sweep_requests(7 + state.ep_rank, 3)
        if state.ep_rank == 0:
            rounds[1] = []
    model = parallelize(GPTModel(config), state).eval()
    # Expert-parallel ranks are separate engines (no replica state), pipeline stages one.
    replica = state if layout == "pp2" else None
    try:
        with InferenceEngine(model, small_engine_config(), state=replica) as engine:
            return _keys(engine, rounds)
    finally:
        state.destroy()


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter and the Triton backend in the processes the test spawns."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")


def test_hybrid_engine_warm_up_covers_every_specialisation_of_its_steps(interpreted):
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        report = pool.submit(_hybrid_keys).result(timeout=900)
    _check(report, "hybrid")


@pytest.mark.parametrize("layout", ["pp2", "ep2"])
def test_parallel_engine_warm_up_covers_every_specialisation_of_its_steps(interpreted, layout):
    from mcore_parallel.testing import run_distributed

    reports = run_distributed(_distributed_keys, 2, layout, timeout=900)
    for rank, report in enumerate(reports):
        _check(report, f"{layout} rank {rank}")
    if layout == "ep2":
        # Lock step: both ranks ran the same forwards (their MoE exchanges paired up).
        assert reports[0]["forwards"] == reports[1]["forwards"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nothing_compiles_after_capture_graphs_of_a_hybrid_engine():
    from mcore_kernels.specialization_log import SpecializationLog
    from mcore_models.mamba import HybridModel, hybrid_preset

    model = HybridModel(hybrid_preset("tiny-hybrid", seed=7), device="cuda").eval()
    # Non-decode graphs up to 4 tokens: steps of 5 and 6 tokens (the budget) run eagerly.
    config = dataclasses.replace(
        small_engine_config(use_cuda_graphs=True), cuda_graph_prefill_token_counts=(4,)
    )
    rng = random.Random(2)
    with InferenceEngine(model, config) as engine:
        captured = engine.capture_graphs()
        graphs = engine._runner.hybrid_graphs
        assert graphs is not None
        assert captured == len(graphs.batch_sizes) + len(graphs.token_counts)
        with SpecializationLog() as log:
            for round_ in range(8):
                count = rng.randint(1, 4)
                prompts = [
                    [rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))] for _ in range(count)
                ]
                params = [
                    SamplingParams(
                        temperature=0.0 if i % 2 else 0.7,
                        max_tokens=rng.randint(1, 6),
                        return_logprobs=round_ % 2 == 0,
                        seed=i,
                    )
                    for i in range(count)
                ]
                engine.generate(prompts, params)
        assert len(graphs.captured) == captured  # the steps captured nothing more
    assert log.compiles == []
