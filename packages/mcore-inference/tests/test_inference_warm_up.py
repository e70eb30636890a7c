"""``InferenceEngine.warm_up`` (run by ``capture_graphs`` on a GPU): after it, no step launches a
Triton kernel under a specialisation it did not launch, so nothing compiles in the request path.

On the CPU the kernels run in Triton's interpreter (a fresh process: Triton decides at import
whether it interprets), which compiles nothing; ``SpecializationLog`` computes the key Triton
would compile under for every launch. On a GPU, Triton's own compile hook counts compiles after
``capture_graphs`` across 1 to 64 concurrent requests.
"""

import random
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.warmup import warm_up_counts
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel


def test_warm_up_counts_cover_powers_of_two_their_neighbours_and_the_buckets():
    assert warm_up_counts(24, (6,)) == (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 24)
    assert warm_up_counts(1) == (1,)


def _params(rng, count):
    """Greedy, sampled (top-k / top-p) and log-prob requests, a few tokens each."""
    params = []
    for i in range(count):
        temperature = 0.0 if i % 3 == 0 else 0.8
        params.append(
            SamplingParams(
                temperature=temperature,
                top_k=5 if i % 3 == 1 else 0,
                top_p=0.9 if i % 3 == 2 else 1.0,
                max_tokens=rng.randint(1, 5),
                return_logprobs=i % 2 == 0,
                seed=i,
            )
        )
    return params


def _keys_of_warm_up_and_sweep(batch_invariant: bool) -> tuple[set, set, set]:
    """In an interpreting process: the keys of one request, of the warm-up and of a sweep."""
    from mcore_kernels.specialization_log import SpecializationLog

    torch.set_num_threads(1)
    model = GPTModel(GPTConfig.from_name("tiny", vocab_size=256, num_layers=1, seed=4)).eval()
    config = InferenceConfig(
        max_batch_size=6,
        max_sequence_length=48,
        block_size=4,
        attention_split_size=16,
        max_tokens_per_step=20,
        prefill_chunk_size=12,
        batch_invariant=batch_invariant,
    )
    rng = random.Random(0)
    with InferenceEngine(model, config) as engine:
        with SpecializationLog() as single:
            engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))
        with SpecializationLog() as warm:
            assert engine.warm_up() > 0
        with SpecializationLog() as sweep:
            for clients in (2, 5, 6, 3):
                prompts = [
                    [rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(clients)
                ]
                engine.generate(prompts, _params(rng, clients))
    return single.keys, warm.keys, sweep.keys


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
def test_after_warm_up_no_step_launches_a_new_specialisation(monkeypatch, batch_invariant):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        future = pool.submit(_keys_of_warm_up_and_sweep, batch_invariant)
        single, warm, sweep = future.result(timeout=600)
    # The sweep needs variants a one-request run does not launch (so the check can fail) ...
    assert sweep - single
    # ... and the warm-up launched every one of them.
    missing = sorted(sweep - warm, key=str)
    assert not missing, f"{len(missing)} specialisations first launched after warm-up: {missing}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nothing_compiles_after_capture_graphs_from_1_to_64_concurrent_requests():
    from mcore_kernels.specialization_log import SpecializationLog

    config = GPTConfig.from_name("tiny", vocab_size=512, num_layers=2, seed=4)
    model = GPTModel(config, device="cuda").eval()
    engine_config = InferenceConfig(max_batch_size=64, max_sequence_length=640, block_size=16)
    rng = random.Random(1)
    with InferenceEngine(model, engine_config) as engine:
        engine.capture_graphs()
        with SpecializationLog() as log:
            for clients in (1, 2, 3, 16, 17, 33, 64):
                prompts = [
                    [rng.randrange(512) for _ in range(rng.randint(1, 500))] for _ in range(clients)
                ]
                params = [
                    SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40))
                    for _ in range(clients)
                ]
                engine.generate(prompts, params)
                engine.generate(prompts, _params(rng, clients))
    assert log.compiles == []
