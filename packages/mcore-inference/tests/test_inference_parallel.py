"""The engine over tensor, pipeline, data and expert parallelism (gloo ranks on the CPU) against
the single-process engine: a mixed batch (chunked prefill, stop words and stop tokens, a seeded
sampled request) gives the same tokens and logprobs; a request that fails validation on one
rank fails with the same message on every rank; ``update_weights`` with the full tensors of
other weights makes every layout generate what an engine built from those weights generates,
and a tp=2 trainer's blocks do the same in tp=1 engines (and full tensors in a tp=2 engine).
One ``run_distributed`` call per world size runs every layout of that size in turn."""

from __future__ import annotations

import pytest
import torch
from _engine_configs import small_engine_config

from mcore_inference import (
    InferenceEngine,
    RequestStatus,
    SamplingParams,
)
from mcore_models import GPTConfig, GPTModel, MoEConfig, parallelize
from mcore_parallel import initialize
from mcore_parallel.testing import run_distributed

VOCAB = 64
PROMPTS = [[3, 9, 4], [5, 6, 7, 8, 9, 10, 11, 12, 13], [12], [40, 41, 42, 43, 44, 45], [7, 1]]
MAX_TOKENS = [5, 6, 4, 6, 3]
BAD_TOKEN = 999
"""Put in request 1's prompt on the last rank only."""


def _config(seed: int = 11, variant: str = "dense") -> GPTConfig:
    """``dense``: the 2-layer tiny GPT; ``moe``: with 4 experts; ``deep``: 4 layers (pp=4)."""
    experts = MoEConfig(num_experts=4, top_k=2, dispatcher="alltoall") if variant == "moe" else None
    layers = 4 if variant == "deep" else 2
    return GPTConfig.from_name("tiny", vocab_size=VOCAB, seed=seed, moe=experts, num_layers=layers)


def _params(stop_word: tuple[int, ...], stop_token: int) -> list[SamplingParams]:
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, return_logprobs=True) for n in MAX_TOKENS
    ]
    params[0] = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS[0], stop_words=(stop_word,), return_logprobs=True
    )
    params[2] = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS[2],
        stop_token_ids=(stop_token,),
        return_logprobs=True,
    )
    params[4] = SamplingParams(
        temperature=1.0, seed=5, max_tokens=MAX_TOKENS[4], return_logprobs=True
    )
    return params


def _summary(results) -> list:
    return [(r.tokens, r.logprobs, str(r.finish_reason), r.status.value, r.error) for r in results]


def _reference(config: GPTConfig) -> tuple[list[SamplingParams], list]:
    """Stops chosen from an unstopped run, then the single-process results with them."""
    model = GPTModel(config).eval()
    with InferenceEngine(model, small_engine_config()) as engine:
        free = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
        params = _params(tuple(free[0].tokens[1:3]), free[2].tokens[1])
        return params, _summary(engine.generate(PROMPTS, params))


def _full_weights(config: GPTConfig) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in GPTModel(config).named_parameters()}


def _references(variants: set[str]) -> dict[str, tuple]:
    """Single-process results for both weight seeds, computed once in the test process."""
    torch.set_num_threads(1)
    return {
        variant: (*_reference(_config(variant=variant)), *_reference(_config(99, variant)))
        for variant in variants
    }


def _serve_layouts(layouts: list[tuple[str, dict, str]], references: dict[str, tuple]) -> dict:
    torch.set_num_threads(1)
    report: dict = {}
    for name, sizes, variant in layouts:
        config, other = _config(variant=variant), _config(99, variant)
        params, expected, params_other, expected_other = references[variant]
        state = initialize(**sizes)
        model = parallelize(GPTModel(config), state).eval()
        prompts = [list(p) for p in PROMPTS]
        if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            prompts[1] = [5, BAD_TOKEN]
        with InferenceEngine(model, small_engine_config(), state=state) as engine:
            got = _summary(engine.generate(PROMPTS, params))
            validated = _summary(engine.generate(prompts, params))
            updated = engine.update_weights(_full_weights(other))
            got_other = _summary(engine.generate(PROMPTS, params_other))
            description = engine.describe()
            aborted = _abort_in_flight(engine, params_other)
        report[name] = {
            "got": got,
            "expected": expected,
            "validated": validated,
            "updated": updated,
            "local_parameters": len(list(model.parameters())),
            "got_other": got_other,
            "expected_other": expected_other,
            "description": description,
            "aborted": aborted,
        }
        state.destroy()
    return report


def _abort_in_flight(engine: InferenceEngine, params: list[SamplingParams]) -> dict:
    """Abort a request after two steps (its tokens may be on a later stage); run the rest."""
    ids = [engine.add_request(prompt, params[i]) for i, prompt in enumerate(PROMPTS[:3])]
    finals = {}
    for step in range(1000):
        if step == 2:
            engine.abort(ids[1])
        for snapshot in engine.step():
            if snapshot.done:
                finals[snapshot.request_id] = snapshot
        if step >= 2 and not engine.has_unfinished() and not engine.group_has_work:
            break
    return {
        "results": _summary([finals[i] for i in ids]),
        "all_blocks_free": engine.allocator.num_free == engine.allocator.capacity,
    }


def _matches(got: list, expected: list, atol: float = 1e-4) -> bool:
    for (tokens, logprobs, reason, status, _), (tokens_ref, logprobs_ref, reason_ref, *_) in zip(
        got, expected, strict=True
    ):
        if tokens != tokens_ref or reason != reason_ref or status != "FINISHED":
            return False
        if not torch.allclose(torch.tensor(logprobs), torch.tensor(logprobs_ref), atol=atol):
            return False
    return True


def _check(reports: list[dict], sizes: dict[str, dict]) -> None:
    for rank, report in enumerate(reports):
        for name, result in report.items():
            where = f"{name} rank {rank}"
            expected = result["expected"]
            # The chosen stops end requests 0 and 2 early: the batch really is mixed.
            assert expected[0][2] == "FinishReason.STOP_WORD", where
            assert expected[2][2] == "FinishReason.STOP_TOKEN", where
            assert _matches(result["got"], expected), where
            assert _matches(result["got_other"], result["expected_other"]), where
            assert result["got_other"] != result["got"], where
            assert result["updated"] == result["local_parameters"] > 0, where
            aborted = result["aborted"]["results"]
            assert aborted[1][2] == "FinishReason.ABORTED", where
            kept = [aborted[0], aborted[2]]
            assert _matches(kept, [result["expected_other"][0], result["expected_other"][2]]), where
            assert result["aborted"]["all_blocks_free"], where
            validated = result["validated"]
            assert validated[1][3] == RequestStatus.FAILED.value, where
            assert f"prompt token {BAD_TOKEN}" in validated[1][4], where
            # The other requests of the call are served normally.
            assert _matches(validated[:1] + validated[2:], expected[:1] + expected[2:]), where
            described = result["description"]
            for key, value in sizes[name].items():
                assert described[key] == value, (where, described)
    for name in reports[0]:
        # Every rank reports the same results, also the failure on one rank only.
        assert all(r[name]["validated"] == reports[0][name]["validated"] for r in reports), name


def _two_rank_checks(layouts: list[tuple[str, dict, str]], references: dict) -> dict:
    report = _serve_layouts(layouts, references)
    _, _, params, expected = references["dense"]
    across = {
        d: _update_across_layouts(d, params, expected) for d in ("tp2_into_tp1", "tp1_into_tp2")
    }
    return {"layouts": report, "across": across}


def test_tensor_pipeline_and_data_parallel_engines_match_single_process():
    layouts = [
        ("tp2", {"tp": 2}, "dense"),
        ("pp2", {"pp": 2}, "dense"),
        ("dp2", {}, "dense"),
    ]
    results = run_distributed(_two_rank_checks, 2, layouts, _references({"dense"}), timeout=400)
    # update_weights from a tp=2 trainer's blocks into tp=1 engines, and full tensors into a
    # tp=2 engine, generate what an engine built from those weights generates.
    for result in results:
        for direction, report in result["across"].items():
            assert _matches(report["got"], report["expected"]), direction
            assert report["got"] != report["before"], direction
    reports = [result["layouts"] for result in results]
    _check(reports, {"tp2": {"tp": 2, "pp": 1}, "pp2": {"pp": 2, "tp": 1}, "dp2": {"dp": 2}})
    tp_description = reports[0]["tp2"]["description"]
    # gloo: the fused collective's reduce-scatter + all-gather path, named with its reason.
    assert tp_description["tp_communication"].startswith("fused_rs_add_rmsnorm_ag (gloo")
    assert tp_description["kv_cache"]["kv_heads"] == 1  # 2 KV heads over 2 ranks
    assert reports[1]["pp2"]["description"]["kv_cache"]["first_layer"] == 1


def test_four_rank_layouts_match_single_process():
    layouts = [
        ("tp2_pp2", {"tp": 2, "pp": 2}, "dense"),
        # Experts over ep=2 with dense tp=2 and two data-parallel replicas in lock step ...
        ("tp2_ep2_dp2", {"tp": 2, "ep": 2}, "moe"),
        # ... and each expert also split over etp=2 (ep x etp = the 4 ranks).
        ("tp2_ep2_etp2", {"tp": 2, "ep": 2, "etp": 2}, "moe"),
        ("pp4", {"pp": 4}, "deep"),
    ]
    references = _references({"dense", "moe", "deep"})
    reports = run_distributed(_serve_layouts, 4, layouts, references, timeout=600)
    _check(
        reports,
        {
            "tp2_pp2": {"tp": 2, "pp": 2, "dp": 1},
            "tp2_ep2_dp2": {"tp": 2, "ep": 2, "dp": 2},
            "tp2_ep2_etp2": {"tp": 2, "ep": 2, "dp": 2},
            "pp4": {"pp": 4, "tp": 1},
        },
    )


def _update_across_layouts(direction: str, params: list, expected: list) -> dict:
    config, other = _config(), _config(seed=99)
    state = initialize(tp=2)
    if direction == "tp2_into_tp1":
        # A trainer holds the other weights over tp=2; each engine is a single-rank one.
        trainer = parallelize(GPTModel(other), state)
        from mcore_inference import model_weight_shards

        shards: list = [None, None]
        torch.distributed.all_gather_object(shards, model_weight_shards(trainer))
        weights = {name: [shards[0][name], shards[1][name]] for name in shards[0]}
        engine = InferenceEngine(GPTModel(config).eval(), small_engine_config())
    else:
        weights = _full_weights(other)
        model = parallelize(GPTModel(config), state).eval()
        engine = InferenceEngine(model, small_engine_config(), state=state)
    with engine:
        before = _summary(engine.generate(PROMPTS, params))
        engine.update_weights(weights)
        got = _summary(engine.generate(PROMPTS, params))
    state.destroy()
    return {"before": before, "got": got, "expected": expected}


def _graph_layouts() -> dict:
    from mcore_kernels.comm import symmetric

    config = _config()
    params, expected = _reference_on(config, "cuda")
    engine_config = small_engine_config(use_cuda_graphs=True)
    reports = {}
    for name, sizes in (("tp2", {"tp": 2}), ("pp2", {"pp": 2})):
        state = initialize(**sizes)
        model = parallelize(GPTModel(config, device="cuda"), state).eval()
        with InferenceEngine(model, engine_config, state=state) as engine:
            got = _summary(engine.generate(PROMPTS, params))
            captured = engine._graphs.captured if engine._graphs is not None else ()
            description = engine.describe()
            workspaces_while_open = len(symmetric._workspaces)
        reports[name] = {
            "got": got,
            "expected": expected,
            "captured": captured,
            "description": description,
            "workspaces_while_open": workspaces_while_open,
            "workspaces_after_close": len(symmetric._workspaces) + len(symmetric._retired),
        }
        state.destroy()
    return reports


def _reference_on(config: GPTConfig, device: str) -> tuple[list[SamplingParams], list]:
    model = GPTModel(config, device=device).eval()
    with InferenceEngine(model, small_engine_config()) as engine:
        free = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
        params = _params(tuple(free[0].tokens[1:3]), free[2].tokens[1])
        return params, _summary(engine.generate(PROMPTS, params))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_graph_decode_over_tensor_and_pipeline_parallel_ranks_matches_single_process():
    """tp=2 replays the fused collective in its graphs and releases its buffers; pp=2 stages
    replay their own graphs (the last stage from received hidden states)."""
    results = run_distributed(_graph_layouts, 2, backend="nccl", timeout=300)
    for reports in results:
        for name, report in reports.items():
            assert report["captured"], name
            assert _matches(report["got"], report["expected"], atol=1e-3), name
        tp = reports["tp2"]
        assert tp["description"]["tp_communication"].startswith("fused_rs_add_rmsnorm_ag")
        if tp["description"]["tp_communication"].endswith("(symmetric memory)"):
            assert tp["workspaces_while_open"] > 0
        assert tp["workspaces_after_close"] == 0
