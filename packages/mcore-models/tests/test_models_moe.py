"""MoE layer on one rank: routing against a plain-torch reference, drop-and-pad, aux losses,
the decode padding switch, grouped GEMM against the loop, config validation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mcore_kernels.moe.expert_gemms import ExpertGemms
from mcore_kernels.moe.grouped_mm import PersistentTiles
from mcore_models import GPTConfig, GPTModel, ModelConfigError, ModelInputError
from mcore_models.moe import (
    MoEConfig,
    MoELayer,
    dispatcher,
    group_limited_top_k,
    set_decode_expert_padding,
)
from mcore_models.moe.config import expert_capacity
from mcore_models.moe.experts import grouped_mm_supported
from mcore_parallel.testing import run_distributed

HIDDEN = 32


def _layer(**moe_fields) -> MoELayer:
    fields = dict(num_experts=4, top_k=2)
    fields.update(moe_fields)
    config = GPTConfig.from_name(
        "tiny", hidden_size=HIDDEN, ffn_hidden_size=48, moe=MoEConfig(**fields)
    )
    torch.manual_seed(0)
    layer = MoELayer(config, 0)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)
    return layer


def _reference(layer: MoELayer, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Token-by-token mixture of experts, written independently of the layer's dispatch."""
    moe = layer.moe_config
    tokens = x.reshape(-1, HIDDEN)
    logits = (tokens @ layer.router.weight.T).float()
    scores = logits.softmax(-1) if moe.router_score == "softmax" else logits.sigmoid()
    out = torch.zeros_like(tokens)
    used = [0] * moe.num_experts
    experts = layer.experts
    for t in range(tokens.shape[0]):
        chosen = scores[t].topk(moe.top_k).indices.tolist()
        weights = scores[t, chosen]
        if moe.normalize_top_k:
            weights = weights / weights.sum()
        for e, w in zip(chosen, weights):
            if capacity is not None:
                used[e] += 1
                if used[e] > capacity:
                    continue
            h = F.silu(experts.gate_up_proj[e, 0] @ tokens[t]) * (
                experts.gate_up_proj[e, 1] @ tokens[t]
            )
            out[t] += w * (experts.down_proj[e] @ h)
    if layer.shared_expert is not None:
        shared = layer.shared_expert(tokens)
        if layer.shared_expert_gate is not None:
            shared = torch.sigmoid(layer.shared_expert_gate(tokens)) * shared
        out = out + shared
    return out.view_as(x)


X = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"normalize_top_k": False, "shared_expert_ffn_hidden_size": 24, "shared_expert_gate": True},
        {"router_score": "sigmoid", "top_k": 3},
    ],
    ids=["mixtral", "qwen2_moe_shared", "sigmoid"],
)
def test_dropless_layer_matches_token_by_token_reference(fields):
    layer = _layer(**fields)
    with torch.no_grad():
        torch.testing.assert_close(layer(X), _reference(layer, X), atol=1e-5, rtol=1e-5)
    assert int(layer.tokens_per_expert.sum()) == X.shape[0] * X.shape[1] * layer.moe_config.top_k


@pytest.mark.parametrize("weights_in_experts", [True, False], ids=["in-experts", "in-combine"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "drop-and-pad"])
def test_input_and_weight_gradients_match_token_by_token_reference(
    capacity_factor, weights_in_experts
):
    # The dispatch has hand-written backward passes (gathers instead of atomic scatters); the
    # routing weights scale the experts' activations (weighted SwiGLU) or their outputs.
    layer = _layer(
        capacity_factor=capacity_factor,
        shared_expert_ffn_hidden_size=16,
        weights_in_experts=weights_in_experts,
    )
    tokens = X.shape[0] * X.shape[1]
    capacity = None if capacity_factor is None else expert_capacity(tokens, 2, 4, capacity_factor)
    upstream = torch.randn(X.shape, generator=torch.Generator().manual_seed(3))
    grads = []
    for forward in (layer, lambda x: _reference(layer, x, capacity)):
        layer.zero_grad()
        x = X.clone().requires_grad_(True)
        (forward(x) * upstream).sum().backward()
        grads.append([x.grad, *(p.grad.clone() for p in layer.parameters())])
    for got, expected in zip(*grads):
        # float32 sums in another order (batched GEMMs against token-by-token products):
        # 1.1e-5 was seen on torch 2.11's CPU kernels, the same bound as the other gradient tests.
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_capacity_factor_drops_assignments_past_capacity_in_token_order():
    layer = _layer(capacity_factor=0.5)
    tokens = X.shape[0] * X.shape[1]
    capacity = expert_capacity(tokens, 2, 4, 0.5)
    assert capacity == math.ceil(tokens * 2 / 4 * 0.5)
    with torch.no_grad():
        torch.testing.assert_close(layer(X), _reference(layer, X, capacity), atol=1e-5, rtol=1e-5)
        assert (layer(X) - _reference(layer, X)).abs().max() > 1e-3  # something was dropped


def test_decode_padding_with_default_capacity_factor_equals_dropless():
    layer = _layer(capacity_factor=None)
    model = torch.nn.Sequential(layer)
    with torch.no_grad():
        dropless = layer(X)
        with set_decode_expert_padding(model, True):
            assert layer.decode_padding and layer.capacity_factor == 4 / 2
            padded = layer(X)
    torch.testing.assert_close(padded, dropless, atol=1e-5, rtol=1e-5)


def test_decode_padding_gradients_equal_dropless():
    layer = _layer(shared_expert_ffn_hidden_size=16)
    layer(X).square().sum().backward()
    expected = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    with set_decode_expert_padding(layer, True):
        layer(X).square().sum().backward()
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], atol=1e-4, rtol=1e-4)


def test_padding_switch_restored_after_exception_and_metadata_cleared():
    layer = _layer(decode_capacity_factor=3.0)
    with torch.no_grad():
        layer(X)
    assert layer.tokens_per_expert is not None
    with (
        pytest.raises(RuntimeError, match="boom"),
        set_decode_expert_padding(layer, True, capacity_factor=1.5),
    ):
        assert layer.tokens_per_expert is None
        assert layer.capacity_factor == 1.5
        with torch.no_grad():
            layer(X)
        raise RuntimeError("boom")
    assert layer.decode_padding is False
    assert layer.decode_capacity_factor == 3.0
    assert layer.capacity_factor is None
    assert layer.tokens_per_expert is None


def test_nested_padding_switch_restores_each_level():
    layer = _layer()
    with set_decode_expert_padding(layer, True, capacity_factor=2.5):
        with set_decode_expert_padding(layer, False):
            assert layer.capacity_factor is None
        assert layer.decode_padding and layer.capacity_factor == 2.5
    assert not layer.decode_padding and layer.decode_capacity_factor == 2.0


def test_padding_switch_rejects_bad_capacity_factor_and_leaves_layers_unchanged():
    layer = _layer()
    with pytest.raises(ModelConfigError, match="capacity_factor=-1"):
        set_decode_expert_padding(layer, True, capacity_factor=-1.0)
    assert layer.decode_padding is False


def test_load_balancing_loss_matches_switch_formula_and_trains_router():
    coeff = 0.1
    layer = _layer(aux_loss_coeff=coeff)
    tokens = X.reshape(-1, HIDDEN)
    layer(X).sum().backward()
    with_aux = layer.router.weight.grad.clone()
    # Switch Transformer eq. 4: coeff * E * sum_i f_i * P_i, f_i over the T * k assignments.
    weight = layer.router.weight.detach().clone().requires_grad_(True)
    probs = (tokens @ weight.T).softmax(-1)
    chosen = probs.topk(2).indices
    fraction = torch.stack([(chosen == e).sum() for e in range(4)]).float() / chosen.numel()
    formula = coeff * 4 * (fraction * probs.mean(0)).sum()
    torch.testing.assert_close(layer.router.aux_loss, formula.detach())
    formula.backward()
    layer.zero_grad()
    layer.moe_config.aux_loss_coeff = 0.0
    layer(X).sum().backward()
    torch.testing.assert_close(
        with_aux, layer.router.weight.grad + weight.grad, atol=1e-5, rtol=1e-5
    )


def test_z_loss_matches_formula():
    layer = _layer(z_loss_coeff=0.01)
    layer(X)
    logits = X.reshape(-1, HIDDEN) @ layer.router.weight.detach().T
    expected = 0.01 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(layer.router.aux_loss, expected)


@pytest.mark.parametrize("loss", ["square", "sum"], ids=["dense-grad", "expanded-grad"])
def test_grouped_gemm_equals_expert_loop_forward_and_backward(loss, monkeypatch):
    # torch >= 2.9 runs torch._grouped_mm on the CPU too: the grouped path must really run
    # (the probe once rejected every device), also for the zero-stride gradient of sum().
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 9):
        assert grouped_mm_supported(X.device, X.dtype)
    calls = []
    real = torch._grouped_mm

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    layer = _layer()
    results = []
    for grouped in (True, False):
        layer.experts.grouped_gemm = grouped
        layer.zero_grad()
        out = layer(X)
        (out.square().sum() if loss == "square" else out.sum()).backward()
        results.append((out.detach(), [p.grad.clone() for p in layer.parameters()]))
        if grouped:
            # One GEMM for gate and up together, one for down.
            assert len(calls) >= 2 or not grouped_mm_supported(X.device, X.dtype)
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_expert_bias_changes_selection_not_weights_and_update_balances():
    layer = _layer(router_expert_bias=True)
    with torch.no_grad():
        before = layer.router(X.reshape(-1, HIDDEN))
        layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
        after = layer.router(X.reshape(-1, HIDDEN))
        assert (after.experts == 3).any(dim=1).all()
        scores = before.scores.gather(1, after.experts)
        torch.testing.assert_close(after.weights, scores / scores.sum(-1, keepdim=True))
        layer.router.expert_bias.zero_()
        layer(X)
        counts = layer.tokens_per_expert.float()
        layer.update_expert_bias(0.5)
        torch.testing.assert_close(
            layer.router.expert_bias, 0.5 * torch.sign(counts.mean() - counts)
        )


def test_gpt_model_with_moe_builds_dense_and_moe_layers_and_zeroes_expert_bias():
    moe = MoEConfig(num_experts=4, top_k=1, dense_layers=(0,), router_expert_bias=True)
    model = GPTModel(GPTConfig.from_name("tiny", num_layers=3, moe=moe))
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["SwiGLUMLP", "MoELayer", "MoELayer"]
    assert all(layer.mlp.router.expert_bias.eq(0).all() for layer in model.layers[1:])
    assert GPTConfig.from_name("tiny", moe={"num_experts": 2, "top_k": 1}).moe == MoEConfig(
        num_experts=2, top_k=1
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_k": 5}, "top_k=5"),
        ({"num_experts": 0}, "num_experts=0"),
        ({"router_score": "relu"}, "router_score='relu'"),
        ({"dispatcher": "ring"}, "dispatcher='ring'"),
        ({"expert_kernel": "cutlass"}, "expert_kernel='cutlass'"),
        ({"expert_kernel": "triton"}, r"expert_kernel='triton' is unknown; expected one of"),
        ({"capacity_factor": 0.0}, "capacity_factor=0.0"),
        ({"aux_loss_coeff": -1.0}, "aux_loss_coeff=-1.0"),
        ({"shared_expert_gate": True}, "shared_expert_gate=True"),
        ({"router_num_groups": 3}, "router_num_groups=3 must divide num_experts=4"),
        ({"router_num_groups": 2, "router_group_top_k": 3}, "router_group_top_k=3"),
        (
            {"top_k": 3, "router_num_groups": 4, "router_group_top_k": 2},
            "top_k=3 exceeds the 2 experts",
        ),
        ({"router_scaling_factor": 0.0}, "router_scaling_factor=0.0"),
    ],
)
def test_moe_config_rejects_invalid_fields(fields, message):
    with pytest.raises(ModelConfigError, match=message):
        MoEConfig(**{"num_experts": 4, "top_k": 2, **fields})


def test_moe_layer_rejects_wrong_hidden_size():
    with pytest.raises(ModelInputError, match="hidden_size=32"):
        _layer()(torch.zeros(3, 7))


def test_num_parameters_and_flops_per_token_count_moe_layers():
    moe = MoEConfig(
        num_experts=4,
        top_k=2,
        expert_ffn_hidden_size=24,
        shared_expert_ffn_hidden_size=16,
        shared_expert_gate=True,
        dense_layers=(0,),
    )
    config = GPTConfig.from_name("tiny", num_layers=3, moe=moe)
    model = GPTModel(config)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    dense = config.replace(moe=None)
    # Per MoE layer a token uses the router, 2 of 4 experts and the gated shared expert
    # instead of the dense MLP.
    layer = model.layers[1].mlp
    active = (
        layer.router.weight.numel()
        + sum(p.numel() for p in layer.experts.parameters()) // 2
        + sum(p.numel() for p in layer.shared_expert.parameters())
        + layer.shared_expert_gate.weight.numel()
    )
    dense_mlp = sum(p.numel() for p in model.layers[0].mlp.parameters())
    expected = dense.flops_per_token(16) + 6 * 2 * (active - dense_mlp)
    assert config.flops_per_token(16) == expected


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "drop-and-pad"])
def test_zero_tokens_forward_and_backward(capacity_factor):
    # An expert-parallel rank may bring no tokens; the hand-written backward passes too.
    layer = _layer(capacity_factor=capacity_factor)
    x = torch.zeros(0, HIDDEN, requires_grad=True)
    out = layer(x)
    assert out.shape == (0, HIDDEN)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, HIDDEN)
    assert all(p.grad is None or not p.grad.any() for p in layer.parameters())


def test_group_limited_top_k_picks_only_from_the_best_groups():
    # Groups of two: group scores (sum of the two best) 1.1, 0.3, 1.0, 0.9; the two best
    # groups are 0 and 2, so expert 7 (the single best score) is excluded.
    choice = torch.tensor([[0.6, 0.5, 0.2, 0.1, 0.55, 0.45, 0.0, 0.9]])
    assert group_limited_top_k(choice, 3, 4, 2).tolist() == [[0, 4, 1]]
    assert group_limited_top_k(choice, 3, 1, 1).tolist() == [[7, 0, 4]]


def _fused_kernel_errors(capacity_factor: float | None) -> list[float]:
    layer = _layer(capacity_factor=capacity_factor, router_score="sigmoid", top_k=3)
    x_small = X[:, :3]
    tokens = x_small.shape[0] * x_small.shape[1]
    capacity = None if capacity_factor is None else expert_capacity(tokens, 3, 4, capacity_factor)
    upstream = torch.randn(x_small.shape, generator=torch.Generator().manual_seed(3))
    results = []
    for forward in (layer, lambda x: _reference(layer, x, capacity)):
        layer.zero_grad()
        x = x_small.clone().requires_grad_(True)
        out = forward(x)
        (out * upstream).sum().backward()
        results.append([out.detach(), x.grad, *(p.grad.clone() for p in layer.parameters())])
    return [(got - expected).abs().max().item() for got, expected in zip(*results)]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="kernels compile for the GPU here; test_models_moe_gpu"
)
@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "drop-and-pad"])
def test_layer_through_the_fused_triton_kernels_matches_token_by_token_reference(
    capacity_factor, monkeypatch
):
    # The fused router, permute, combine and SwiGLU kernels (mcore_kernels.moe) run through
    # the Triton interpreter; outputs and gradients equal the independent reference. Triton
    # decides at import whether it interprets, so the check runs in a fresh process.
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (errors,) = run_distributed(_fused_kernel_errors, 1, capacity_factor)
    assert max(errors) < 1e-4, errors


def _fused_routed_errors(
    capacity_factor: float | None,
    expert_kernel: str = "grouped_mm",
    plan: ExpertGemms | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    # A fresh process: pack the kept rows at any capacity (tiny shapes here).
    dispatcher.PACKED_MIN_CAPACITY = 1
    # Experts 10 and 11 never win (their router rows are pushed far down): empty groups.
    layer = _layer(
        num_experts=12,
        top_k=3,
        fused_experts=True,
        capacity_factor=capacity_factor,
        expert_kernel=expert_kernel,
    )
    with torch.no_grad():
        layer.router.weight[10:] = -5.0 * X.reshape(-1, HIDDEN).mean(0)
    layer.to(dtype)
    layer.experts.gemm_plan = plan
    assert layer.experts.fuses_routing(X)
    tokens = X.shape[0] * X.shape[1]
    capacity = None if capacity_factor is None else expert_capacity(tokens, 3, 12, capacity_factor)
    upstream = torch.randn(X.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    results = []
    for forward in (layer, lambda x: _reference(layer, x, capacity)):
        layer.zero_grad()
        x = X.to(dtype).detach().clone().requires_grad_(True)
        out = forward(x)
        (out * upstream).sum().backward()
        results.append([out.detach(), x.grad, *(p.grad.clone() for p in layer.parameters())])
    assert int((layer.tokens_per_expert == 0).sum()) > 0, layer.tokens_per_expert
    if capacity is not None:  # something was dropped
        assert int((layer.tokens_per_expert > capacity).sum()) > 0, layer.tokens_per_expert
    if dtype == torch.float32:
        return [(got - expected).abs().max().item() for got, expected in zip(*results)]
    # 16-bit: both sides round differently; the error relative to the largest value.
    return [
        ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
        for got, expected in zip(*results)
    ]


def _fused_routed_errors_both() -> list[list[float]]:
    return [_fused_routed_errors(None), _fused_routed_errors(0.5)]


def _fused_padded_rows_errors() -> list[list[float]]:
    tiles = PersistentTiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
    # Every expert's rows padded to 16 (empty rows between experts): the weight gradients on
    # the unmasked aligned kernel, the others on torch._grouped_mm.
    plan = ExpertGemms(w_down=tiles, w_gate_up=tiles, row_align=16)
    return [
        _fused_routed_errors(None, plan=plan, dtype=torch.float16),
        _fused_routed_errors(0.5, plan=plan, dtype=torch.float16),
    ]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="kernels compile for the GPU here; test_models_moe_gpu"
)
@pytest.mark.skipif(
    not grouped_mm_supported(torch.device("cpu"), torch.float32),
    reason="torch._grouped_mm does not run on this CPU build",
)
@pytest.mark.parametrize(
    ("errors", "tolerance"),
    [(_fused_routed_errors_both, 1e-4), (_fused_padded_rows_errors, 1e-2)],
    ids=["rows-packed", "rows-padded-per-expert"],
)
def test_layer_with_fused_routed_experts_matches_token_by_token_reference(
    errors, tolerance, monkeypatch
):
    # MoEConfig(fused_experts=True): permute, grouped GEMMs, weighted SwiGLU and combine in one
    # autograd operation (Triton kernels through the interpreter, torch._grouped_mm on the
    # CPU), with experts that get no token; dropless, and capacity routing whose kept
    # assignments are packed (capacity factor 0.5 drops some). Rows packed, or every expert's
    # rows padded to 16 by empty rows (ExpertGemms.row_align; float16, the weight gradients on
    # the unmasked aligned Triton kernel). Outputs and every gradient against the reference,
    # in one fresh process.
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ((dropless, capacity),) = run_distributed(errors, 1)
    assert max(dropless) < tolerance, dropless
    assert max(capacity) < tolerance, capacity


def _fused_other_gemm_errors() -> list[list[float]]:
    tiles = PersistentTiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
    triton_plan = ExpertGemms(
        gate_up=tiles, down=tiles, d_act=tiles, d_x=tiles, w_down=tiles, w_gate_up=tiles
    )
    from mcore_models.moe import dispatcher, host_counts

    # The cuBLAS loops read each expert's rows on the host through HostCounts (the copy queued
    # after the router): dropless, and capacity routing's packed kept rows (packed here from
    # any capacity), whose ends count at most `capacity` rows per expert.
    ends = []
    real = host_counts.HostCounts.ends

    def spy(self, capacity=None):
        ends.append(capacity)
        return real(self, capacity)

    host_counts.HostCounts.ends = spy  # type: ignore[method-assign]
    dispatcher.PACKED_MIN_CAPACITY = 0
    errors = [
        _fused_routed_errors(None, expert_kernel="cublas")
        + _fused_routed_errors(0.5, expert_kernel="cublas"),
        # The interpreter reads bfloat16 TMA tiles wrongly: float16 for the Triton GEMMs.
        _fused_routed_errors(None, plan=triton_plan, dtype=torch.float16),
    ]
    assert len(ends) == 2 and ends[0] is None and ends[1] is not None, ends
    return errors


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="kernels compile for the GPU here; test_models_moe_gpu"
)
def test_layer_with_fused_experts_on_cublas_loop_and_triton_gemms_matches_reference(
    monkeypatch,
):
    # The fused routed experts with other GEMM kernels: expert_kernel="cublas" (one cuBLAS
    # GEMM per expert, here torch.mm on the CPU) and every GEMM on the persistent Triton
    # kernels (through the interpreter). Outputs and every
    # gradient against the token-by-token reference, experts without tokens included.
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ((loop, triton_gemms),) = run_distributed(_fused_other_gemm_errors, 1)
    assert max(loop) < 1e-4, loop
    assert max(triton_gemms) < 1e-2, triton_gemms


def _fused_slot_errors() -> list[list[float]]:
    # expert_kernel="bmm" never packs: dropless pads every expert to the largest one (through
    # GroupedExperts.forward_slots), capacity routing keeps its padded slots (the separate
    # operations).
    from mcore_models.moe import permute
    from mcore_models.moe.experts import GroupedExperts

    # Tiny shapes pad far more than the default limit allows.
    permute.PADDING_LIMIT = 100.0
    calls = []
    real = GroupedExperts.forward_slots

    def spy(self, x, weights, fillers, kept, capacity):
        calls.append((capacity, self.slot_plan().slotted))
        return real(self, x, weights, fillers, kept, capacity)

    GroupedExperts.forward_slots = spy  # type: ignore[method-assign]
    errors = [
        _fused_routed_errors(None, expert_kernel="bmm"),
        _fused_routed_errors(0.5, expert_kernel="bmm"),
    ]
    # One call for the dropless layer step (the reference does not route): batched GEMMs.
    assert [slotted for _, slotted in calls] == [True], calls
    # Routing too uneven to pad: the grouped rows, from the sort made for the padding decision.
    permute.PADDING_LIMIT = 1.0
    errors[0] += _fused_routed_errors(None, expert_kernel="bmm")
    assert len(calls) == 1, calls
    return errors


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="kernels compile for the GPU here; test_models_moe_gpu"
)
@pytest.mark.skipif(
    not grouped_mm_supported(torch.device("cpu"), torch.float32),
    reason="torch._grouped_mm does not run on this CPU build",
)
def test_layer_with_fused_experts_on_batched_slots_matches_reference(monkeypatch):
    # Equal slots per expert in the fused operation, on torch.bmm (ExpertGemms BATCHED):
    # dropless routing padded to the largest expert; and drop-and-pad (factor 0.5 drops some)
    # with expert_kernel="bmm"; experts without tokens included. Outputs and every gradient
    # against the token-by-token reference, in one fresh process (Triton interpreter).
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ((dropless, capacity),) = run_distributed(_fused_slot_errors, 1)
    assert max(dropless) < 1e-4, dropless
    assert max(capacity) < 1e-4, capacity


def test_host_counts_ends_and_largest_match_the_device_counts():
    # HostCounts on the host: the running sum of the (kept) counts, as capacity_rows' offsets,
    # and the largest count, as padded_capacity reads it; an expert without rows included.
    from mcore_models.moe.host_counts import HostCounts
    from mcore_models.moe.permute import capacity_rows, padded_capacity

    experts = torch.tensor([3, 0, 3, 3, 1, 0, 3, 1, 3], dtype=torch.int64)
    counts = torch.bincount(experts, minlength=5)
    host = HostCounts(counts)
    assert host.values() == [2, 2, 0, 5, 0]
    assert host.ends() == counts.cumsum(0).tolist()
    offsets = capacity_rows(experts, counts, 3)[3]
    assert host.ends(3) == offsets.tolist() == [2, 4, 4, 7, 7]
    assert host.largest() == 5
    assert padded_capacity(counts, 100, host.largest()) == padded_capacity(counts, 100) == 8
    assert HostCounts(torch.zeros(0, dtype=torch.int64)).largest() == 0


def test_cublas_expert_loop_matches_token_by_token_reference_with_an_idle_expert():
    # expert_kernel="cublas": one GEMM per expert and pass, weight gradients written per
    # expert (zero for an expert without tokens).
    layer = _layer(expert_kernel="cublas", num_experts=12)
    upstream = torch.randn(X.shape, generator=torch.Generator().manual_seed(5))
    results = []
    for forward in (layer, lambda x: _reference(layer, x)):
        layer.zero_grad()
        x = X.clone().requires_grad_(True)
        out = forward(x)
        (out * upstream).sum().backward()
        results.append([out.detach(), x.grad, *(p.grad.clone() for p in layer.parameters())])
    assert int((layer.tokens_per_expert == 0).sum()) > 0, layer.tokens_per_expert
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("limit", [100.0, 1.0], ids=["padded", "too-uneven"])
def test_bmm_dropless_pads_to_the_largest_expert_and_matches_reference(limit, monkeypatch):
    # expert_kernel="bmm": every expert padded to the largest count (dropping nothing) and run
    # as batched GEMMs; routing that would pad past the limit runs the grouped path instead.
    from mcore_models.moe import dispatcher, permute

    monkeypatch.setattr(permute, "PADDING_LIMIT", limit)
    used = []
    real = dispatcher.sorted_slots
    monkeypatch.setattr(
        dispatcher, "sorted_slots", lambda *args: used.append(args[2]) or real(*args)
    )
    layer = _layer(expert_kernel="bmm", num_experts=5)
    upstream = torch.randn(X.shape, generator=torch.Generator().manual_seed(7))
    results = []
    for use_layer in (True, False):
        layer.zero_grad()
        x = X.clone().requires_grad_(True)
        out = layer(x) if use_layer else _reference(layer, x)
        (out * upstream).sum().backward()
        results.append([out.detach(), x.grad, *(p.grad.clone() for p in layer.parameters())])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    largest = int(layer.tokens_per_expert.max())
    assert used == ([max(8, -(-largest // 8) * 8)] if limit > 1 else [])
