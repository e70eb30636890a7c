"""Tensor- and sequence-parallel layers on 4 gloo ranks (tp=2, dp=2) against plain torch.

One run_distributed call computes everything (spawning ranks is the expensive part); each test
checks one behaviour against a plain-torch reference computed here, in the test process.
"""

import pytest
import torch
import torch.nn.functional as F

from mcore_parallel.errors import ParallelConfigError
from mcore_parallel.state import initialize
from mcore_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    gather_from_sequence_parallel_region,
    model_parallel_seed,
    scatter_to_sequence_parallel_region,
)
from mcore_parallel.testing import run_distributed

SEQ, BATCH, HIDDEN, FFN, VOCAB = 4, 2, 8, 16, 10
SEED_FC1, SEED_FC2, SEED_EMB = 11, 12, 13


def _master(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The documented initialisation: the seed drives N(0, 0.02²) on a float32 CPU tensor."""
    torch.manual_seed(seed)
    return torch.empty(shape).normal_(0.0, 0.02)


def _inputs() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
        "dy": torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
        "b1": torch.randn(FFN, generator=generator),
        "b2": torch.randn(HIDDEN, generator=generator),
        "ids": torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator),
        "demb": torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
    }


def _mlp(state, data, sequence_parallel):
    fc1 = ColumnParallelLinear(
        HIDDEN,
        FFN,
        state=state,
        gather_output=False,
        sequence_parallel=sequence_parallel,
        seed=SEED_FC1,
    )
    fc2 = RowParallelLinear(
        FFN,
        HIDDEN,
        state=state,
        input_is_parallel=True,
        sequence_parallel=sequence_parallel,
        seed=SEED_FC2,
    )
    tp = state.tp_size if state is not None else 1
    rank = state.tp_rank if state is not None else 0
    with torch.no_grad():
        fc1.bias.copy_(data["b1"].chunk(tp)[rank])
        fc2.bias.copy_(data["b2"])
    x, dy = data["x"], data["dy"]
    if sequence_parallel:
        x, dy = x.chunk(tp, dim=0)[rank], dy.chunk(tp, dim=0)[rank]
    x = x.clone().requires_grad_()
    y = fc2(F.gelu(fc1(x)))
    (y * dy).sum().backward()
    if sequence_parallel:
        allreduce_sequence_parallel_grads(fc2, state)
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dw1": fc1.weight.grad,
        "db1": fc1.bias.grad,
        "dw2": fc2.weight.grad,
        "db2": fc2.bias.grad,
    }


def _embedding(state, data, sequence_parallel):
    emb = VocabParallelEmbedding(
        VOCAB, HIDDEN, state=state, sequence_parallel=sequence_parallel, seed=SEED_EMB
    )
    out = emb(data["ids"])
    demb = data["demb"]
    if sequence_parallel:
        demb = demb.chunk(state.tp_size, dim=0)[state.tp_rank]
    (out * demb).sum().backward()
    return {"out": out.detach(), "dw": emb.weight.grad}


def _unsplit_chain(state, data):
    col = ColumnParallelLinear(HIDDEN, FFN, state=state, gather_output=True, seed=SEED_FC1)
    row = RowParallelLinear(FFN, HIDDEN, state=state, input_is_parallel=False, seed=SEED_FC2)
    return row(col(data["x"])).detach()


def _sequence_mappings(state, data) -> dict:
    # Sequence along dim 1 here ([b, s, h]) to exercise sequence_dim.
    x = data["x"].transpose(0, 1).contiguous().requires_grad_()
    scattered = scatter_to_sequence_parallel_region(x, state.tp_group, sequence_dim=1)
    (scattered * (state.tp_rank + 1)).sum().backward()
    chunk = x.detach().chunk(2, dim=1)[state.tp_rank].clone().requires_grad_()
    gathered = gather_from_sequence_parallel_region(
        chunk, state.tp_group, sequence_dim=1, tensor_parallel_output_grad=False
    )
    (gathered * data["x"].transpose(0, 1)).sum().backward()
    return {
        "scattered": scattered.detach(),
        "scatter_grad": x.grad,
        "gathered": gathered.detach(),
        "gather_grad": chunk.grad,
    }


def _tp_worker() -> dict:
    state = initialize(tp=2)
    data = _inputs()
    result = {
        "sequence_mappings": _sequence_mappings(state, data),
        "tp_rank": state.tp_rank,
        "dp_rank": state.dp_rank,
        "mlp": _mlp(state, data, sequence_parallel=False),
        "mlp_sp": _mlp(state, data, sequence_parallel=True),
        "emb": _embedding(state, data, sequence_parallel=False),
        "emb_sp": _embedding(state, data, sequence_parallel=True),
        "chain": _unsplit_chain(state, data),
    }
    errors = {}
    for name, build in {
        "column": lambda: ColumnParallelLinear(4, 3, state=state),
        "row": lambda: RowParallelLinear(3, 4, state=state),
        "embedding": lambda: VocabParallelEmbedding(7, 4, state=state),
    }.items():
        try:
            build()
        except ParallelConfigError as error:
            errors[name] = str(error)
    result["errors"] = errors
    masks = []
    for _ in range(2):
        tracker = model_parallel_seed(1234, state)
        with tracker.fork():
            inside = F.dropout(torch.ones(64), p=0.5)
        outside = F.dropout(torch.ones(64), p=0.5)
        masks.append((inside, outside))
    result["rng"] = masks
    return result


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_tp_worker, 4)


@pytest.fixture(scope="module")
def reference():
    data = _inputs()
    w1 = _master(SEED_FC1, (FFN, HIDDEN)).requires_grad_()
    w2 = _master(SEED_FC2, (HIDDEN, FFN)).requires_grad_()
    b1, b2 = data["b1"].clone().requires_grad_(), data["b2"].clone().requires_grad_()
    x = data["x"].clone().requires_grad_()
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    (y * data["dy"]).sum().backward()
    table = _master(SEED_EMB, (VOCAB, HIDDEN)).requires_grad_()
    out = F.embedding(data["ids"], table)
    (out * data["demb"]).sum().backward()
    chain = F.linear(F.linear(data["x"], w1.detach()), w2.detach())
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dw1": w1.grad,
        "db1": b1.grad,
        "dw2": w2.grad,
        "db2": b2.grad,
        "out": out.detach(),
        "dtable": table.grad,
        "chain": chain,
    }


def _close(actual, expected):
    # torch.allclose rather than torch.testing.assert_close, whose first call imports DTensor
    # (seconds of CPU on a shared machine).
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-6), (actual - expected).abs().max()


def test_tp2_column_row_mlp_forward_and_backward_match_single_rank(ranks, reference):
    for result in ranks:
        mlp, r = result["mlp"], result["tp_rank"]
        _close(mlp["y"], reference["y"])
        _close(mlp["dx"], reference["dx"])
        _close(mlp["dw1"], reference["dw1"].chunk(2, dim=0)[r])
        _close(mlp["db1"], reference["db1"].chunk(2)[r])
        _close(mlp["dw2"], reference["dw2"].chunk(2, dim=1)[r])
        _close(mlp["db2"], reference["db2"])


def test_sequence_parallel_mlp_matches_tp_without_sp(ranks):
    for result in ranks:
        mlp, sp, r = result["mlp"], result["mlp_sp"], result["tp_rank"]
        _close(sp["y"], mlp["y"].chunk(2, dim=0)[r])
        _close(sp["dx"], mlp["dx"].chunk(2, dim=0)[r])
        for name in ("dw1", "db1", "dw2", "db2"):
            _close(sp[name], mlp[name])


def test_vocab_parallel_embedding_matches_full_table(ranks, reference):
    for result in ranks:
        r = result["tp_rank"]
        _close(result["emb"]["out"], reference["out"])
        _close(result["emb"]["dw"], reference["dtable"].chunk(2, dim=0)[r])


def test_sequence_parallel_embedding_returns_sequence_chunk(ranks, reference):
    for result in ranks:
        r = result["tp_rank"]
        _close(result["emb_sp"]["out"], reference["out"].chunk(2, dim=0)[r])
        _close(result["emb_sp"]["dw"], reference["dtable"].chunk(2, dim=0)[r])


def test_sequence_scatter_and_gather_along_dim_1_with_their_gradients(ranks):
    x = _inputs()["x"].transpose(0, 1)
    for result in ranks:
        mappings, r = result["sequence_mappings"], result["tp_rank"]
        _close(mappings["scattered"], x.chunk(2, dim=1)[r])
        # The scattered chunk's gradient is (rank + 1) on each rank, gathered back in order.
        expected = torch.cat(
            [torch.full_like(c, i + 1.0) for i, c in enumerate(x.chunk(2, dim=1))], dim=1
        )
        _close(mappings["scatter_grad"], expected)
        _close(mappings["gathered"], x)
        # Without tensor_parallel_output_grad the gradient is only split, not summed.
        _close(mappings["gather_grad"], x.chunk(2, dim=1)[r])


def test_gather_output_and_scattered_input_give_full_result(ranks, reference):
    for result in ranks:
        _close(result["chain"], reference["chain"])


def test_sizes_not_divisible_by_tp_raise_naming_the_argument(ranks):
    errors = ranks[0]["errors"]
    assert "out_features=3" in errors["column"] and "tp=2" in errors["column"]
    assert "in_features=3" in errors["row"]
    assert "num_embeddings=7" in errors["embedding"]


def test_model_parallel_rng_differs_across_tp_and_agrees_across_dp(ranks):
    by_position = {(r["tp_rank"], r["dp_rank"]): r["rng"] for r in ranks}
    inside = {key: masks[0][0] for key, masks in by_position.items()}
    outside = {key: masks[0][1] for key, masks in by_position.items()}
    assert not torch.equal(inside[(0, 0)], inside[(1, 0)])
    assert torch.equal(inside[(0, 0)], inside[(0, 1)])
    assert torch.equal(inside[(1, 0)], inside[(1, 1)])
    assert all(torch.equal(mask, outside[(0, 0)]) for mask in outside.values())
    # Re-seeding reproduces the same masks.
    for masks in by_position.values():
        assert torch.equal(masks[0][0], masks[1][0])
        assert torch.equal(masks[0][1], masks[1][1])


def test_layers_without_state_equal_plain_torch(reference):
    data = _inputs()
    fc1 = ColumnParallelLinear(HIDDEN, FFN, seed=SEED_FC1, bias=False)
    fc2 = RowParallelLinear(FFN, HIDDEN, seed=SEED_FC2, bias=False)
    _close(fc2(fc1(data["x"])).detach(), reference["chain"])
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, seed=SEED_EMB)
    _close(emb(data["ids"]).detach(), reference["out"])


def test_seed_does_not_disturb_global_rng():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    ColumnParallelLinear(4, 4, seed=99)
    assert torch.equal(torch.rand(3), expected)


def test_without_seed_layers_draw_from_global_rng_like_any_module():
    torch.manual_seed(7)
    first = ColumnParallelLinear(4, 6).weight.detach()
    torch.manual_seed(7)
    assert torch.equal(ColumnParallelLinear(4, 6).weight.detach(), first)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ColumnParallelLinear(0, 4), "in_features=0"),
        (lambda: RowParallelLinear(4, -2), "out_features=-2"),
        (lambda: VocabParallelEmbedding(8, 0), "embedding_dim=0"),
        (lambda: RowParallelLinear(4, 4, sequence_parallel=True), "input_is_parallel"),
        (lambda: ColumnParallelLinear(4, 4, sequence_dim=-1), "sequence_dim=-1"),
        (lambda: RowParallelLinear(4, 4, sequence_dim=1.0), "sequence_dim=1.0"),
        (lambda: VocabParallelEmbedding(8, 4, sequence_dim=True), "sequence_dim=True"),
    ],
)
def test_invalid_layer_arguments_raise(build, match):
    with pytest.raises(ParallelConfigError, match=match):
        build()
