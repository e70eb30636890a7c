"""Generation under expert parallelism (ep=2 on 2 gloo ranks) with different prompts, different
max_tokens and different numbers of requests per rank (zero included): it completes, every rank
runs the same number of forwards, and each rank's greedy results equal a single-process (EP=1)
engine over the same weights. One ``run_distributed`` call checks every case. A GPU test (2
GPUs, NCCL) checks the same with decode CUDA graphs, whose buckets the ranks agree on."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from _engine_configs import small_engine_config

from mcore_inference import (
    InferenceEngine,
    SamplingParams,
)
from mcore_inference.expert_parallel import ExpertParallelSync
from mcore_models import GPTConfig, GPTModel, MoEConfig, parallelize
from mcore_parallel import initialize
from mcore_parallel.testing import run_distributed

VOCAB = 64

ROUNDS: list[tuple[list[tuple[list[int], int]], list[tuple[list[int], int]]]] = [
    # (rank 0's requests, rank 1's requests); a request is (prompt, max_tokens).
    ([([3, 9, 4], 1)], [([5, 6, 7, 8, 9, 10, 11], 6), ([12, 2], 4)]),
    ([], [([7, 1, 7, 1], 6), ([30], 3)]),
    ([([40, 41, 42, 43, 44], 6), ([9, 9], 2), ([17, 3, 8], 5)], []),
    ([([21, 22], 6)], [([50, 51, 52], 1)]),
]
"""Successive ``generate`` calls, each made by both ranks."""

MOE_VARIANTS = {
    "alltoall-dropless": {"dispatcher": "alltoall"},
    "allgather-dropless": {"dispatcher": "allgather"},
    # Capacity num_experts / top_k leaves room for every token (nothing dropped), but the
    # capacity follows the token count, so the ranks must run equal counts.
    "alltoall-drop-and-pad": {"dispatcher": "alltoall", "capacity_factor": 2.0},
    "allgather-drop-and-pad": {"dispatcher": "allgather", "capacity_factor": 2.0},
}


def _generate(engine: InferenceEngine, requests: list[tuple[list[int], int]]) -> list:
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, return_logprobs=True) for _, n in requests
    ]
    results = engine.generate([prompt for prompt, _ in requests], params)
    return [(r.tokens, r.logprobs, str(r.finish_reason)) for r in results]


def _stream(engine: InferenceEngine, requests: list[tuple[list[int], int]]) -> list:
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, return_logprobs=True) for _, n in requests
    ]
    finals = {}
    for snapshot in engine.stream([prompt for prompt, _ in requests], params):
        if snapshot.done:
            finals[snapshot.request_id] = snapshot
    ordered = [finals[i] for i in sorted(finals)]
    return [(r.tokens, r.logprobs, str(r.finish_reason)) for r in ordered]


def _step_loop(engine: InferenceEngine, requests: list[tuple[list[int], int]]) -> list:
    ids = [
        engine.add_request(
            prompt, SamplingParams(temperature=0.0, max_tokens=n, return_logprobs=True)
        )
        for prompt, n in requests
    ]
    finals = {}
    while True:
        for snapshot in engine.step():
            if snapshot.done:
                finals[snapshot.request_id] = snapshot
        if not engine.has_unfinished() and not engine.group_has_work:
            break
    return [(finals[i].tokens, finals[i].logprobs, str(finals[i].finish_reason)) for i in ids]


def _count_call(counter: list[int], *_: object) -> None:
    counter[0] += 1


def _expert_parallel_against_single_process() -> dict:
    torch.set_num_threads(1)
    state = initialize(ep=2)
    rank = state.ep_rank
    report: dict = {}
    for name, changes in MOE_VARIANTS.items():
        moe = MoEConfig(num_experts=4, top_k=2, **changes)
        config = GPTConfig.from_name("tiny", vocab_size=VOCAB, moe=moe, seed=11)
        reference = GPTModel(config).eval()
        sharded = parallelize(GPTModel(config), state).eval()
        forwards = [0]
        hook = sharded.register_forward_pre_hook(partial(_count_call, forwards))
        got, expected = [], []
        with InferenceEngine(sharded, small_engine_config()) as engine:
            for requests in ROUNDS:
                got.append(_generate(engine, requests[rank]))
            group_has_work_after = engine.group_has_work
            if name == "alltoall-dropless":
                streamed = _stream(engine, ROUNDS[1][rank])
                stepped = _step_loop(engine, ROUNDS[0][rank])
        hook.remove()
        with InferenceEngine(reference, small_engine_config()) as engine:
            for requests in ROUNDS:
                expected.append(_generate(engine, requests[rank]))
        if name == "alltoall-dropless":
            # stream() and a step() loop pair up with the peers like generate().
            got += [streamed, stepped]
            expected += [expected[1], expected[0]]
        report[name] = {
            "got": got,
            "expected": expected,
            "forwards": forwards[0],
            "group_has_work_after": group_has_work_after,
        }
    report["agreements"] = _agreements(sharded, state, rank)
    state.destroy()
    return report


AGREEMENT_CASES = [
    # ((rank 0's tokens, graph sizes), (rank 1's tokens, graph sizes)) -> (max tokens, graphs)
    (((3, (1, 2, 4)), (0, (1, 2, 4))), (3, True)),
    (((3, (1, 2, 4)), (1, None)), (3, False)),  # rank 1 prefills: everyone runs eagerly
    (((2, (1, 2, 4)), (2, (1, 2, 8))), (2, False)),  # different buckets: eager
    (((6, (1, 2, 4)), (1, (1, 2, 4))), (6, False)),  # larger than every graph
    (((0, (1, 2)), (0, None)), (0, False)),  # nobody has work
]


def _agreements(model: GPTModel, state, rank: int) -> list[tuple[int, bool, bool]]:
    sync = ExpertParallelSync(model, state.ep_group, torch.device("cpu"))
    outcomes = []
    for inputs, _ in AGREEMENT_CASES:
        agreement = sync.agree(*inputs[rank])
        outcomes.append((agreement.max_tokens, agreement.use_graphs, sync.group_has_work))
    return outcomes


def _tokens_and_logprobs_match(got: list, expected: list, atol: float = 1e-4) -> bool:
    for got_round, expected_round in zip(got, expected, strict=True):
        for (tokens, logprobs, reason), (tokens_ref, logprobs_ref, reason_ref) in zip(
            got_round, expected_round, strict=True
        ):
            if tokens != tokens_ref or reason != reason_ref:
                return False
            if not torch.allclose(torch.tensor(logprobs), torch.tensor(logprobs_ref), atol=atol):
                return False
    return True


def test_generation_under_expert_parallelism_with_uneven_work_matches_single_process():
    reports = run_distributed(_expert_parallel_against_single_process, 2, timeout=240)
    expected_agreements = [(n, graphs, n > 0) for _, (n, graphs) in AGREEMENT_CASES]
    for rank, report in enumerate(reports):
        assert report.pop("agreements") == expected_agreements, rank
        assert set(report) == set(MOE_VARIANTS)
        for name, result in report.items():
            rounds = [*ROUNDS, ROUNDS[1], ROUNDS[0]] if name == "alltoall-dropless" else ROUNDS
            counts = [len(requests[rank]) for requests in rounds]
            assert [len(round_) for round_ in result["got"]] == counts, name
            lengths = [[len(tokens) for tokens, _, _ in round_] for round_ in result["got"]]
            assert lengths == [[n for _, n in requests[rank]] for requests in rounds], name
            assert _tokens_and_logprobs_match(result["got"], result["expected"]), name
            assert not result["group_has_work_after"], name
    for name in MOE_VARIANTS:
        # Lock step: the MoE collectives of every forward pair up across the EP ranks.
        assert reports[0][name]["forwards"] == reports[1][name]["forwards"] > 0, name


def _graphs_against_eager_single_process() -> dict:
    state = initialize(ep=2)
    rank = state.ep_rank
    report: dict = {}
    for name in ("alltoall-dropless", "allgather-dropless"):
        moe = MoEConfig(num_experts=4, top_k=2, **MOE_VARIANTS[name])
        config = GPTConfig.from_name("tiny", vocab_size=VOCAB, moe=moe, seed=11)
        reference = GPTModel(config).cuda().eval()
        sharded = parallelize(GPTModel(config, device="cuda"), state).eval()
        got, expected = [], []
        with InferenceEngine(sharded, small_engine_config(use_cuda_graphs=True)) as engine:
            for requests in ROUNDS:
                got.append(_generate(engine, requests[rank]))
            captured = engine._graphs.captured if engine._graphs is not None else ()
        with InferenceEngine(reference, small_engine_config()) as engine:
            for requests in ROUNDS:
                expected.append(_generate(engine, requests[rank]))
        report[name] = {"got": got, "expected": expected, "captured": captured}
    return report


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_graph_decode_under_expert_parallelism_with_uneven_batches_matches_single_process():
    reports = run_distributed(_graphs_against_eager_single_process, 2, backend="nccl")
    for report in reports:
        for name, result in report.items():
            assert result["captured"], name
            assert _tokens_and_logprobs_match(result["got"], result["expected"], atol=1e-3), name
    for name in reports[0]:
        # Every rank replays the bucket of the larger batch, so both captured the same ones.
        assert reports[0][name]["captured"] == reports[1][name]["captured"], name
