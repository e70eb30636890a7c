"""GRPO with a model-parallel policy (gloo, world 4, fp32): every (training, generation) layout
(tensor, sequence, pipeline, interleaved, context parallel) gives the rollouts, losses and final
weights of the data-parallel run with the same seed; the weight push moves only each rank's
slices; a resumed run equals the uninterrupted one."""

import pytest
import torch
import torch.distributed as dist
from _rl_layouts import TINY, rollout_key, train_layout

from mcore_models.gpt.context_parallel import ContextParallelAttention
from mcore_parallel.testing import run_distributed
from mcore_rl.config import GRPOConfig
from mcore_rl.run import run_grpo

SHARED = {"dp4", "train tp2 dp2, infer tp2 dp2", "train pp2 dp2, infer tp1 pp2 dp2"}
"""Layouts whose generation runs the training chunk itself."""
LOCAL_ONLY = {"train tp2 sp cp2, infer tp2 dp2"}
"""Layouts whose push copies locally only: every rank holds (a cp replica of) its blocks."""
LAYOUTS = {
    # name: (train_parallel, infer_parallel)
    "dp4": ({}, {}),
    "train tp2 pp2, infer tp1 dp4": ({"tp": 2, "pp": 2}, {"tp": 1}),
    "train tp2 dp2, infer tp2 dp2": ({"tp": 2}, {"tp": 2}),
    "train pp2 dp2, infer tp1 pp2 dp2": ({"pp": 2}, {"pp": 2}),
    "train tp2 sp dp2, infer tp1 pp2 dp2": ({"tp": 2, "sequence_parallel": True}, {"pp": 2}),
    "train pp2 vp2 dp2, infer tp2 dp2": ({"pp": 2, "vp": 2}, {"tp": 2}),
    # Context parallelism: every packed sequence split over two ranks (ring attention).
    "train tp2 sp cp2, infer tp2 dp2": ({"tp": 2, "cp": 2, "sequence_parallel": True}, {"tp": 2}),
    "train pp2 cp2 all-gather, infer tp1 dp4": (
        {"pp": 2, "cp": 2, "cp_method": "all_gather"},
        {"tp": 1},
    ),
}


def _config(train, infer, **run):
    sections = {name: dict(values) for name, values in TINY.items()}
    sections["run"].update(run)
    return GRPOConfig.from_dict({**sections, "train_parallel": train, "infer_parallel": infer})


def _run_layouts(names):
    torch.set_num_threads(1)
    report = {}
    for name in names:
        train, infer = LAYOUTS[name]
        worker, state, report[name] = train_layout(_config(train, infer))
        report[name]["cp_methods"] = {
            module.method
            for chunk in worker.chunks
            for module in chunk.modules()
            if isinstance(module, ContextParallelAttention)
        }
        worker.close()
        state.destroy()
    return report


@pytest.fixture(scope="module")
def layouts():
    return run_distributed(_run_layouts, 4, list(LAYOUTS), timeout=600)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "dp4"])
def test_layout_trains_like_data_parallel(layouts, name):
    for rank in range(4):
        reference, got = layouts[rank]["dp4"], layouts[rank][name]
        for step, ((tokens, metrics, _), (ref_tokens, ref_metrics, _)) in enumerate(
            zip(got["steps"], reference["steps"])
        ):
            # Sampling is seeded per request: the same rollouts on every layout.
            assert tokens == ref_tokens, (name, rank, step)
            for key, value in rollout_key(ref_metrics).items():
                # fp32, different reduction orders (tp splits, pipeline): 1e-5 relative.
                assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (key, step)
        # The push writes each byte of this rank's generation blocks exactly once (received or
        # copied locally) and nothing else; nothing moves when the engine runs the trained model.
        for _, _, pushed in got["steps"]:
            expected = 0 if got["shared"] else got["local"]
            assert pushed.bytes_received + pushed.bytes_local == expected, (name, rank)
            if name in LOCAL_ONLY:
                assert pushed.bytes_received == pushed.bytes_sent == 0, (name, rank)
        assert got["shared"] == (name in SHARED)
        # Context-parallel layouts attend over the cp ranks with the method they name.
        train = LAYOUTS[name][0]
        expected = {train.get("cp_method", "ring")} if train.get("cp", 1) > 1 else set()
        assert got["cp_methods"] == expected, name
        # Every block this rank holds equals that region of the data-parallel run's weights.
        full = {key: tensor for key, (_, tensor, _) in reference["blocks"].items()}
        assert got["blocks"], name
        for key, (box, tensor, _) in got["blocks"].items():
            # Three Adam steps at lr 1e-2: near-zero gradients move by ~lr whatever their
            # rounding, so weights agree to a small fraction of lr.
            torch.testing.assert_close(tensor, full[key][box], atol=2e-4, rtol=0)


RESUMED = [
    "train tp2 pp2, infer tp1 dp4",
    "train tp2 dp2, infer tp2 dp2",
    "train pp2 dp2, infer tp1 pp2 dp2",
    "train pp2 vp2 dp2, infer tp2 dp2",
]


def _comparable(record):
    return {k: v for k, v in record.items() if not k.startswith(("time/", "memory/", "reshard/s"))}


def _resume_layouts(root, names):
    torch.set_num_threads(1)
    report = {}
    for index, name in enumerate(names):
        train, infer = LAYOUTS[name]
        straight_dir, split_dir = f"{root}/{index}-straight", f"{root}/{index}-split"
        straight = run_grpo(_config(train, infer, num_steps=3, run_dir=straight_dir))
        run_grpo(_config(train, infer, num_steps=2, run_dir=split_dir))
        resumed = run_grpo(_config(train, infer, num_steps=3, run_dir=split_dir, resume=True))
        report[name] = (
            [_comparable(r) for r in straight.records],
            [_comparable(r) for r in resumed.records],
        )
    return report if dist.get_rank() == 0 else None


def test_resume_at_every_layout_reproduces_the_uninterrupted_run(tmp_path):
    report = run_distributed(_resume_layouts, 4, str(tmp_path), RESUMED, timeout=600)[0]
    for name in RESUMED:
        straight, resumed = report[name]
        assert [r["step"] for r in resumed] == [0, 1, 2], name
        # The resumed step sees the saved weights, optimizer and reference state exactly.
        assert resumed == straight, name


CONTEXT_PARALLEL = "train cp2 dp2, infer tp1 dp4"
"""Context x data parallel (gradients reduced over dp x cp), checked through the resume test."""
CONTEXT_PARALLEL_LAYOUT = ({"cp": 2}, {"tp": 1})


def _resume_context_parallel(root):
    torch.set_num_threads(1)
    train, infer = CONTEXT_PARALLEL_LAYOUT
    straight = run_grpo(_config(train, infer, num_steps=3, run_dir=f"{root}/straight"))
    run_grpo(_config(train, infer, num_steps=2, run_dir=f"{root}/split"))
    resumed = run_grpo(_config(train, infer, num_steps=3, run_dir=f"{root}/split", resume=True))
    return [_comparable(r) for r in straight.records], [_comparable(r) for r in resumed.records]


def test_context_parallel_resume_reproduces_the_data_parallel_run(layouts, tmp_path):
    straight, resumed = run_distributed(_resume_context_parallel, 4, str(tmp_path), timeout=600)[0]
    assert [r["step"] for r in resumed] == [0, 1, 2]
    # Checkpoint blocks of cp replicas (replica ids over dp x cp) restore the exact state.
    assert resumed == straight, CONTEXT_PARALLEL
    # The uninterrupted cp2 x dp2 run has the rollouts and metrics of the dp4 run.
    for step, (record, (_, metrics, _)) in enumerate(zip(straight, layouts[0]["dp4"]["steps"])):
        for key, value in rollout_key(metrics).items():
            assert record[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (key, step)
