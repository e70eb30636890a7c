"""GRPO with a mixture-of-experts policy at expert (EP) and expert tensor (ETP) parallel layouts
(gloo, world 4, fp32): every (training, generation) layout gives the rollouts, metrics (router
loss included) and final weights of the data-parallel run with the same seed, the weight push
moves only each rank's slices, a resumed run equals the uninterrupted one, a policy exported
at one expert layout loads at another, and the router loss added to the GRPO loss has the
gradient of its definition."""

import math

import pytest
import torch
from _rl_layouts import TINY, parameter_blocks, rollout_key, train_layout

from mcore_models import GPTConfig, MoEConfig, MoELayer
from mcore_parallel import initialize
from mcore_parallel.testing import run_distributed
from mcore_rl.cli import parse_grpo_args
from mcore_rl.config import GRPOConfig, MoEModelConfig, ParallelConfig
from mcore_rl.errors import RLConfigError
from mcore_rl.moe_config import moe_config_for
from mcore_rl.policy import load_policy_chunks
from mcore_rl.presets import preset
from mcore_rl.router_loss import ROUTER_LOSS_METRIC, RouterLoss
from mcore_rl.run import run_grpo
from mcore_rl.worker_config import model_config

MOE = {
    "num_experts": 4,
    "top_k": 2,
    "expert_ffn_hidden_size": 32,
    "aux_loss_coeff": 0.01,
    "z_loss_coeff": 0.001,
}
LAYOUTS = {
    # name: (train_parallel, infer_parallel)
    "dp4": ({}, {}),
    "train ep2 dp4, infer ep2 dp4": ({"ep": 2}, {"ep": 2}),
    "train ep2 dp4, infer tp1 dp4": ({"ep": 2}, {}),
    "train tp2 ep2 etp2 dp2, infer ep2 dp4": ({"tp": 2, "ep": 2}, {"ep": 2}),
    "train tp2 sp ep2 etp1 dp2, infer tp2 ep2 etp2 dp2": (
        {"tp": 2, "sequence_parallel": True, "ep": 2, "etp": 1},
        {"tp": 2, "ep": 2},
    ),
    "train pp2 ep2 dp2, infer tp1 dp4": ({"pp": 2, "ep": 2}, {}),
}
SHARED = {"dp4", "train ep2 dp4, infer ep2 dp4"}
"""Layouts whose generation runs the training chunk itself."""
EXPORTED = "train tp2 sp ep2 etp1 dp2, infer tp2 ep2 etp2 dp2"
"""Layout whose trained policy is exported as a Hugging Face checkpoint and loaded at ep2."""
RESUMED = "train ep2 dp4, infer tp1 dp4"
"""Layout resumed from a checkpoint (expert weights and their optimizer state sharded over
the expert-data-parallel ranks)."""


def _config(train, infer, **run):
    sections = {name: dict(values) for name, values in TINY.items()}
    sections["run"] = {**sections["run"], **run}
    # Two layers (one per stage of pp2) keep the six layouts within the test budget.
    sections["model"] = {**sections["model"], "num_layers": 2, "moe": dict(MOE)}
    # Adam moves a weight by about lr x sign(gradient) when the gradient is far above eps, so
    # a rounding difference in a near-zero gradient (an expert that few tokens reach) can flip
    # a whole lr-sized update; eps 1e-6 (gradients here are ~1e-3) bounds that amplification.
    sections["optimizer"] = {**sections["optimizer"], "eps": 1e-6}
    return GRPOConfig.from_dict({**sections, "train_parallel": train, "infer_parallel": infer})


def _comparable(record):
    return {k: v for k, v in record.items() if not k.startswith(("time/", "memory/", "reshard/s"))}


def _resume(root):
    train, infer = LAYOUTS[RESUMED]
    straight = run_grpo(_config(train, infer, num_steps=3, run_dir=f"{root}/straight"))
    run_grpo(_config(train, infer, num_steps=2, run_dir=f"{root}/split"))
    resumed = run_grpo(_config(train, infer, num_steps=3, run_dir=f"{root}/split", resume=True))
    return [_comparable(r) for r in straight.records], [_comparable(r) for r in resumed.records]


def _run_layouts(names, export_dir, run_root):
    torch.set_num_threads(1)
    report = {}
    for name in names:
        train, infer = LAYOUTS[name]
        worker, state, report[name] = train_layout(_config(train, infer))
        report[name]["inference_experts"] = [
            layer.mlp.experts.num_experts
            for layer in worker.inference.model.layers
            if isinstance(layer.mlp, MoELayer)
        ]
        if name == EXPORTED:
            worker.export_hf(export_dir)
        worker.close()
        state.destroy()
    # The exported MoE policy loads at another expert layout, each rank reading its slices.
    state = initialize(ep=2)
    report["loaded"] = parameter_blocks(load_policy_chunks(export_dir, state, dtype="float32"))
    state.destroy()
    report["resume"] = _resume(run_root)
    return report


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    export_dir = str(tmp_path_factory.mktemp("moe_hf"))
    run_root = str(tmp_path_factory.mktemp("moe_runs"))
    return run_distributed(_run_layouts, 4, list(LAYOUTS), export_dir, run_root, timeout=600)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "dp4"])
def test_moe_layout_trains_like_data_parallel(layouts, name):
    infer_ep = LAYOUTS[name][1].get("ep", 1)
    for rank in range(4):
        reference, got = layouts[rank]["dp4"], layouts[rank][name]
        # The generation model holds this rank's experts of the generation layout.
        assert got["inference_experts"] == [MOE["num_experts"] // infer_ep] * 2, name
        for step, ((tokens, metrics, _), (ref_tokens, ref_metrics, _)) in enumerate(
            zip(got["steps"], reference["steps"])
        ):
            # Dropless routing sends a token to the same experts in any batch: the same rollouts.
            assert tokens == ref_tokens, (name, rank, step)
            assert set(metrics) == set(reference["steps"][step][1]), name
            assert ref_metrics[ROUTER_LOSS_METRIC] > 0.0
            for key, value in rollout_key(ref_metrics).items():
                # fp32, different reduction orders (tp splits, expert dispatch): 1e-4 relative.
                assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (key, step)
        # The push writes each byte of this rank's generation blocks exactly once (received or
        # copied locally) and nothing else; nothing moves when the engine runs the trained model.
        for _, _, pushed in got["steps"]:
            expected = 0 if got["shared"] else got["local"]
            assert pushed.bytes_received + pushed.bytes_local == expected, (name, rank)
        assert got["shared"] == (name in SHARED)
        full = {key: tensor for key, (_, tensor, _) in reference["blocks"].items()}
        assert any(".experts." in key for key in got["blocks"]), name
        for key, (box, tensor, _) in got["blocks"].items():
            # Three Adam steps at lr 1e-2: weights agree to a small fraction of lr.
            torch.testing.assert_close(tensor, full[key][box], atol=2e-4, rtol=0)


def test_exported_moe_policy_loads_at_another_expert_layout(layouts):
    # The whole tensors of the exporting layout, assembled from every rank's blocks.
    whole = {}
    for report in layouts:
        for key, (box, tensor, shape) in report[EXPORTED]["blocks"].items():
            whole.setdefault(key, torch.full(shape, float("nan")))[box] = tensor
    assert not any(t.isnan().any() for t in whole.values())
    for rank, report in enumerate(layouts):
        loaded = report["loaded"]
        # At ep2 every rank reads two of the four experts of each layer.
        experts = [tensor for key, (_, tensor, _) in loaded.items() if ".experts." in key]
        assert experts and all(t.shape[0] == MOE["num_experts"] // 2 for t in experts), rank
        assert set(loaded) == set(whole)
        for key, (box, tensor, _) in loaded.items():
            torch.testing.assert_close(tensor, whole[key][box], atol=0, rtol=0)


def test_resumed_moe_run_reproduces_the_uninterrupted_run(layouts):
    straight, resumed = layouts[0]["resume"]
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert ROUTER_LOSS_METRIC in resumed[-1]
    # The resumed step sees the saved expert weights, optimizer and reference state exactly.
    assert resumed == straight


def _reference_router_loss(x, weight, num_experts, top_k, aux_coeff, z_coeff):
    # Switch-Transformer balance loss and ST-MoE z-loss written out from their definitions.
    logits = x @ weight.t()
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    fraction = torch.stack([(chosen == e).sum() for e in range(num_experts)]) / (x.shape[0] * top_k)
    balance = aux_coeff * num_experts * (fraction * probs.mean(dim=0)).sum()
    z = z_coeff * torch.logsumexp(logits, dim=-1).square().mean()
    return balance + z


def test_router_loss_adds_the_weighted_losses_to_the_backward():
    torch.manual_seed(0)
    section = MoEModelConfig(num_experts=4, top_k=2, aux_loss_coeff=0.05, z_loss_coeff=0.01)
    moe = MoEConfig(num_experts=4, top_k=2)
    layer = MoELayer(GPTConfig.from_name("tiny", hidden_size=16, moe=moe), 0)
    torch.nn.init.normal_(layer.router.weight, std=0.5)
    for param in layer.experts.parameters():
        torch.nn.init.normal_(param, std=0.1)
    hooks = RouterLoss([layer], section)
    x = torch.randn(12, 16, requires_grad=True)
    weight = 0.25
    with hooks.weighting(weight):
        output = layer(x)
    # Only the router loss has a gradient: the output's own gradient is zero.
    (output * 0.0).sum().backward()
    router_grad, input_grad = layer.router.weight.grad.clone(), x.grad.clone()
    assert router_grad.abs().min() > 0.0 and input_grad.abs().min() > 0.0

    w = layer.router.weight.detach().clone().requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    expected = weight * _reference_router_loss(xr, w, 4, 2, 0.05, 0.01)
    expected.backward()
    torch.testing.assert_close(router_grad, w.grad)
    torch.testing.assert_close(input_grad, xr.grad)
    metrics = hooks.take_metrics(lambda values: values, 1)
    assert metrics[ROUTER_LOSS_METRIC] == pytest.approx(float(expected.detach()), rel=1e-6)
    # Without autograd (log-prob passes, generation) nothing is added or counted.
    with torch.no_grad(), hooks.weighting(1.0):
        layer(x)
    assert hooks.take_metrics(lambda values: values, 1) == {ROUTER_LOSS_METRIC: 0.0}
    hooks.close()


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"model": {"moe": {"num_experts": -1}}}, "moe.num_experts=-1 must be an integer >= 0"),
        ({"model": {"moe": {"num_experts": 2, "top_k": 3}}}, "moe.top_k=3 must not exceed"),
        ({"model": {"moe": {"num_experts": 4, "aux_loss_coeff": float("nan")}}}, "aux_loss"),
        ({"model": {"moe": {"num_experts": 4, "capacity_factor": 0.0}}}, "capacity_factor=0.0"),
        ({"model": {"moe": {"num_experts": 4, "router_score": "relu"}}}, "router_score='relu'"),
        ({"model": {"moe": {"experts": 4}}}, r"\['experts'\] are not fields of section"),
        ({"train_parallel": {"ep": 2}}, "policy is dense; set model.moe.num_experts"),
        (
            {"model": {"moe": {"num_experts": 6}}, "infer_parallel": {"ep": 4}},
            "infer_parallel.ep=4 must divide model.moe.num_experts=6",
        ),
        (
            {
                "model": {"moe": {"num_experts": 4, "expert_ffn_hidden_size": 30}},
                "train_parallel": {"tp": 4, "etp": 4},
            },
            "train_parallel.etp=4 must divide the expert FFN width 30",
        ),
        (
            {
                "model": {"moe": {"num_experts": 4, "capacity_factor": 1.0}},
                "train_parallel": {"tp": 2, "sequence_parallel": True},
            },
            "capacity_factor=1.0 with train_parallel.sequence_parallel=True",
        ),
        (
            {
                "model": {"moe": {"num_experts": 4, "aux_loss_coeff": 0.01}},
                "train_parallel": {"cp": 2},
            },
            "train_parallel.cp=2 with a MoE router loss or capacity factor",
        ),
        (
            {
                "model": {"moe": {"num_experts": 4, "capacity_factor": 1.5}},
                "train_parallel": {"cp": 2},
            },
            "capacity_factor=1.5\\) would make them depend on each rank's sequence chunk",
        ),
        (
            {"model": {"hf_path": "/ckpt", "moe": {"num_experts": 4}}},
            "moe.num_experts=4 cannot change the shape of the checkpoint",
        ),
        ({"train_parallel": {"etp": 0}}, "etp=0 must be >= 1"),
    ],
)
def test_moe_config_errors(values, match):
    with pytest.raises(RLConfigError, match=match):
        GRPOConfig.from_dict(values)


def test_expert_layout_must_fit_the_world():
    layout = ParallelConfig(tp=2, ep=4)
    with pytest.raises(RLConfigError, match=r"ep=4 x etp=2 must divide tp=2 x cp=1 x dp=2"):
        layout.data_parallel_size(4)
    assert ParallelConfig(tp=2, ep=2, etp=1).data_parallel_size(4) == 2
    # Router-loss coefficients are training options: allowed with a checkpoint.
    config = GRPOConfig.from_dict({"model": {"hf_path": "/ckpt", "moe": {"aux_loss_coeff": 0.1}}})
    assert config.model.moe.has_router_loss and not config.model.moe.enabled
    # The section round-trips through the dict form.
    moe = GRPOConfig.from_dict({"model": {"moe": MOE}})
    assert GRPOConfig.from_dict(moe.to_dict()) == moe


def test_cli_spells_the_moe_section_and_expert_layouts():
    config = parse_grpo_args(
        [
            "--preset", "tiny-moe-arith", "--model.moe.num-experts", "8",
            "--model.moe.z-loss-coeff", "1e-3", "--train-parallel.tp", "2",
            "--train-parallel.ep", "2", "--train-parallel.etp", "1", "--infer-parallel.ep", "4",
        ]
    )  # fmt: skip
    moe = config.model.moe
    assert (moe.num_experts, moe.top_k, moe.aux_loss_coeff, moe.z_loss_coeff) == (8, 2, 0.01, 1e-3)
    assert (config.train_parallel.ep, config.train_parallel.expert_tp) == (2, 1)
    assert (config.infer_parallel.ep, config.infer_parallel.expert_tp) == (4, 1)
    # The preset is the main job with a MoE policy; the GPT built from it has its experts.
    preset_config = preset("tiny-moe-arith")
    assert preset_config.replace(model={"moe": {}}) == GRPOConfig()
    shape = moe_config_for(preset_config.model.moe)
    assert shape is not None and (shape.num_experts, shape.top_k) == (4, 2)
    # The router computes no loss itself: RouterLoss adds it, weighted per row.
    assert (shape.aux_loss_coeff, shape.z_loss_coeff) == (0.0, 0.0)


def test_qwen3_moe_preset_has_the_published_shape():
    config = preset("qwen3-moe-30b-a3b")
    shape = model_config(config, config.model.vocab_size)
    assert shape.moe is not None and (shape.moe.num_experts, shape.moe.top_k) == (128, 8)
    assert (shape.num_layers, shape.hidden_size, shape.head_dim) == (48, 2048, 128)
    # The Qwen3-30B-A3B model card gives 30.5B parameters; tying the 151,936 x 2048 embedding
    # to the output layer saves 0.31B of them.
    untied = shape.num_parameters() + shape.vocab_size * shape.hidden_size
    assert 30.4e9 < untied < 30.6e9
    # Its experts split over 8 ranks, the layout it needs.
    split = config.replace(train_parallel={"ep": 8}, infer_parallel={"ep": 8})
    assert split.train_parallel.data_parallel_size(8) == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_policy_trains_on_a_gpu_with_cuda_graphs(tmp_path):
    config = GRPOConfig.from_dict(
        {
            "run": {
                "device": "cuda",
                "num_steps": 5,
                "target_reward": None,
                "progress": False,
                "plot": False,
                "run_dir": str(tmp_path),
            },
            "model": {
                "hidden_size": 128,
                "num_layers": 2,
                "dtype": "bfloat16",
                "moe": {"num_experts": 8, "top_k": 2, "aux_loss_coeff": 0.01, "z_loss_coeff": 1e-3},
            },
            "rollout": {"use_cuda_graphs": True, "num_prompts": 16, "group_size": 8},
        }
    )
    records = run_grpo(config).records
    assert len(records) == 5
    for record in records:
        assert math.isfinite(float(record["loss"])) and 0.0 <= float(record["reward/mean"]) <= 1.0
        # Two layers of load balancing (about coefficient x 1 each when balanced) plus z-loss.
        assert 0.0 < float(record[ROUTER_LOSS_METRIC]) < 1.0
