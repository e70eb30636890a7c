"""Pipeline schedules on 4 gloo ranks against plain gradient accumulation on one process.

One run_distributed call covers a pp=4 1F1B run with variable microbatch shapes, a pp=2 (dp=2)
1F1B run with 4 microbatches and a fixed tensor shape, and forward-only passes.
"""

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mcore_parallel.errors import ParallelConfigError
from mcore_parallel.pipeline import allreduce_tied_embedding_grads, forward_backward
from mcore_parallel.state import initialize
from mcore_parallel.testing import run_distributed

WIDTH, LAYERS = 8, 4
VARIABLE_ROWS = (2, 3, 2, 1, 2, 3)


def _layers(count: int = LAYERS) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(count)]


def _microbatches(rows: tuple[int, ...]) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "x": torch.randn(n, WIDTH, generator=generator),
            "y": torch.randn(n, WIDTH, generator=generator),
        }
        for n in rows
    ]


def _forward_step(model, input_tensor, microbatch):
    return model(microbatch["x"] if input_tensor is None else input_tensor)


def _loss(output, microbatch):
    return F.mse_loss(output, microbatch["y"])


def _stage(pp_size: int, pp_rank: int) -> tuple[nn.Module, list[int]]:
    per_stage = LAYERS // pp_size
    indices = list(range(pp_rank * per_stage, (pp_rank + 1) * per_stage))
    layers = _layers()
    return nn.Sequential(*[layers[i] for i in indices]), indices


def _grads(model: nn.Module, indices: list[int]) -> dict:
    return {
        global_index: [p.grad.clone() for p in layer.parameters()]
        for global_index, layer in zip(indices, model)
    }


def _run(state, rows, tensor_shape):
    model, indices = _stage(state.pp_size, state.pp_rank)
    no_sync_entries = []

    @contextmanager
    def no_sync():
        no_sync_entries.append(1)
        yield

    out = forward_backward(
        model,
        _microbatches(rows),
        state=state,
        loss_func=_loss,
        forward_step=_forward_step,
        tensor_shape=tensor_shape,
        no_sync=no_sync,
    )
    return {
        "last": state.is_last_stage,
        "losses": out.losses,
        "grads": _grads(model, indices),
        "no_sync_entries": len(no_sync_entries),
    }


def _run_interleaved(state, chunks_per_rank: int, microbatch_count: int, forward_only: bool):
    pp, rank = state.pp_size, state.pp_rank
    layers = _layers(pp * chunks_per_rank)
    indices = [c * pp + rank for c in range(chunks_per_rank)]
    chunks = [nn.Sequential(layers[i]) for i in indices]
    rows = (2,) * microbatch_count
    out = forward_backward(
        chunks,
        _microbatches(rows),
        state=state,
        forward_step=_forward_step,
        loss_func=None if forward_only else _loss,
        forward_only=forward_only,
        tensor_shape=(2, WIDTH),
    )
    grads = (
        {}
        if forward_only
        else {i: [p.grad.clone() for p in chunk.parameters()] for i, chunk in zip(indices, chunks)}
    )
    return {
        "last": state.is_last_stage,
        "losses": out.losses,
        "outputs": out.outputs,
        "grads": grads,
    }


def _pipeline_worker() -> dict:
    pp4 = initialize(pp=4)
    result = {"pp4": _run(pp4, VARIABLE_ROWS, None)}
    model, _ = _stage(4, pp4.pp_rank)
    collected = forward_backward(
        model,
        _microbatches(VARIABLE_ROWS),
        state=pp4,
        forward_step=_forward_step,
        forward_only=True,
    )
    scored = forward_backward(
        model,
        _microbatches(VARIABLE_ROWS),
        state=pp4,
        loss_func=_loss,
        forward_step=_forward_step,
        forward_only=True,
    )
    result["forward_only"] = {
        "last": pp4.is_last_stage,
        "outputs": collected.outputs,
        "losses": scored.losses,
        "grads_untouched": all(p.grad is None for p in model.parameters()),
    }
    pp4.destroy()
    pp2 = initialize(pp=2)
    result["pp2"] = _run(pp2, (2, 2, 2, 2), (2, WIDTH))
    result["pp2"]["dp_rank"] = pp2.dp_rank
    result["interleaved"] = {
        "pp2_vp2_m4": _run_interleaved(pp2, 2, 4, False),
        "pp2_vp2_m2": _run_interleaved(pp2, 2, 2, False),
        "pp2_vp3_m6_forward_only": _run_interleaved(pp2, 3, 6, True),
    }
    pp2.destroy()
    pp4 = initialize(pp=4)
    result["interleaved"]["pp4_vp2_m8"] = _run_interleaved(pp4, 2, 8, False)
    result["interleaved"]["pp4_vp2_m4"] = _run_interleaved(pp4, 2, 4, False)
    tied = nn.Parameter(torch.zeros(3))
    tied.grad = torch.full((3,), float(pp4.pp_rank + 1))
    allreduce_tied_embedding_grads([tied], pp4)
    result["tied"] = {"pp_rank": pp4.pp_rank, "grad": tied.grad}
    return result


def _reference(rows, layer_count: int = LAYERS):
    layers = _layers(layer_count)
    full = nn.Sequential(*layers)
    losses, outputs = [], []
    for microbatch in _microbatches(rows):
        output = full(microbatch["x"])
        loss = _loss(output, microbatch)
        (loss / len(rows)).backward()
        losses.append(loss.detach())
        outputs.append(output.detach())
    grads = {i: [p.grad.clone() for p in layer.parameters()] for i, layer in enumerate(layers)}
    return {"losses": losses, "outputs": outputs, "grads": grads}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_pipeline_worker, 4)


def _close(actual, expected):
    # torch.allclose rather than torch.testing.assert_close, whose first call imports DTensor
    # (seconds of CPU on a shared machine).
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-6), (actual - expected).abs().max()


def _check_against_reference(results, reference, layer_count: int = LAYERS):
    seen_layers = set()
    for result in results:
        if result["last"]:
            assert len(result["losses"]) == len(reference["losses"])
            for loss, expected in zip(result["losses"], reference["losses"]):
                _close(loss, expected)
        else:
            assert result["losses"] == []
        for index, grads in result["grads"].items():
            seen_layers.add(index)
            for grad, expected in zip(grads, reference["grads"][index]):
                _close(grad, expected)
    assert seen_layers == set(range(layer_count))


def test_pp2_1f1b_with_4_microbatches_matches_no_pipelining_on_one_rank(ranks):
    reference = _reference((2, 2, 2, 2))
    _check_against_reference([r["pp2"] for r in ranks], reference)
    assert sorted(r["pp2"]["dp_rank"] for r in ranks) == [0, 0, 1, 1]


def test_pp4_1f1b_with_variable_microbatch_shapes_matches_one_rank(ranks):
    _check_against_reference([r["pp4"] for r in ranks], _reference(VARIABLE_ROWS))


def test_no_sync_wraps_every_backward_but_the_last(ranks):
    for result in ranks:
        assert result["pp4"]["no_sync_entries"] == len(VARIABLE_ROWS) - 1
        assert result["pp2"]["no_sync_entries"] == 3


def test_forward_only_collects_outputs_on_last_stage(ranks):
    reference = _reference(VARIABLE_ROWS)
    for result in ranks:
        forward_only = result["forward_only"]
        assert forward_only["grads_untouched"]
        if forward_only["last"]:
            assert len(forward_only["outputs"]) == len(VARIABLE_ROWS)
            for output, expected in zip(forward_only["outputs"], reference["outputs"]):
                _close(output, expected)
            for loss, expected in zip(forward_only["losses"], reference["losses"]):
                _close(loss, expected)
        else:
            assert forward_only["outputs"] == [] and forward_only["losses"] == []


def test_no_pipelining_accumulates_the_mean_loss_gradient():
    rows = (2, 3, 1)
    reference = _reference(rows)
    model = nn.Sequential(*_layers())
    out = forward_backward(model, _microbatches(rows), loss_func=_loss, forward_step=_forward_step)
    _close(out.mean_loss, torch.stack(reference["losses"]).mean())
    for layer, expected in zip(model, reference["grads"].values()):
        for grad, ref in zip((p.grad for p in layer.parameters()), expected):
            _close(grad, ref)


def test_loss_func_none_without_forward_only_raises():
    with pytest.raises(ParallelConfigError, match="forward_only"):
        forward_backward(nn.Linear(2, 2), [torch.zeros(1, 2)])


def test_empty_microbatches_raise():
    with pytest.raises(ParallelConfigError, match="microbatches"):
        forward_backward(nn.Linear(2, 2), [], loss_func=_loss)


def test_non_scalar_loss_raises():
    with pytest.raises(ParallelConfigError, match="scalar"):
        forward_backward(nn.Linear(2, 2), [torch.zeros(1, 2)], loss_func=lambda output, _: output)


def test_num_microbatches_takes_items_from_an_iterator():
    rows = (2, 3, 1)
    reference = _reference(rows)
    model = nn.Sequential(*_layers())
    endless = iter(_microbatches(rows) + _microbatches((5, 5)))
    out = forward_backward(
        model, endless, num_microbatches=3, loss_func=_loss, forward_step=_forward_step
    )
    assert len(out.losses) == 3
    for loss, expected in zip(out.losses, reference["losses"]):
        _close(loss, expected)


@pytest.mark.parametrize(("count", "match"), [(0, "num_microbatches=0"), (5, "yielded 3")])
def test_bad_num_microbatches_raises(count, match):
    with pytest.raises(ParallelConfigError, match=match):
        forward_backward(
            nn.Linear(2, 2),
            iter([torch.zeros(1, 2)] * 3),
            num_microbatches=count,
            loss_func=_loss,
        )


@pytest.mark.parametrize(
    ("case", "layer_count", "microbatch_count"),
    [("pp2_vp2_m4", 4, 4), ("pp2_vp2_m2", 4, 2), ("pp4_vp2_m8", 8, 8), ("pp4_vp2_m4", 8, 4)],
)
def test_interleaved_1f1b_matches_no_pipelining_on_one_rank(
    ranks, case, layer_count, microbatch_count
):
    reference = _reference((2,) * microbatch_count, layer_count)
    _check_against_reference([r["interleaved"][case] for r in ranks], reference, layer_count)


def test_interleaved_forward_only_collects_outputs_on_last_stage(ranks):
    reference = _reference((2,) * 6, 6)
    for result in ranks:
        run = result["interleaved"]["pp2_vp3_m6_forward_only"]
        if run["last"]:
            assert len(run["outputs"]) == 6
            for output, expected in zip(run["outputs"], reference["outputs"]):
                _close(output, expected)
        else:
            assert run["outputs"] == []


def test_model_chunks_without_pipelining_run_as_one_model():
    rows = (2, 1)
    reference = _reference(rows)
    layers = _layers()
    chunks = [nn.Sequential(*layers[:2]), nn.Sequential(*layers[2:])]
    out = forward_backward(chunks, _microbatches(rows), loss_func=_loss, forward_step=_forward_step)
    for loss, expected in zip(out.losses, reference["losses"]):
        _close(loss, expected)
    for layer, expected in zip(layers, reference["grads"].values()):
        for grad, ref in zip((p.grad for p in layer.parameters()), expected):
            _close(grad, ref)


def test_tied_embedding_grads_sum_over_first_and_last_stage_only(ranks):
    for result in ranks:
        stage, grad = result["tied"]["pp_rank"], result["tied"]["grad"]
        # Stages 0 and 3 hold the tied copies (grads 1 and 4); middle stages keep their own.
        expected = 5.0 if stage in (0, 3) else stage + 1.0
        assert torch.equal(grad, torch.full((3,), expected))
