"""The TP layers and the 1F1B schedule on 2 GPUs over NCCL, against plain torch on one GPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mcore_parallel.pipeline import forward_backward
from mcore_parallel.state import initialize
from mcore_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
)
from mcore_parallel.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs 2 CUDA GPUs",
    ),
]

SEQ, BATCH, HIDDEN, FFN, VOCAB = 8, 2, 32, 64, 64


def _data(device) -> dict:
    generator = torch.Generator().manual_seed(0)
    data = {
        "x": torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
        "dy": torch.randn(SEQ, BATCH, HIDDEN, generator=generator),
        "ids": torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator),
    }
    return {name: tensor.to(device) for name, tensor in data.items()}


def _tp_forward_backward(state, data, sequence_parallel) -> dict:
    device = state.device
    fc1 = ColumnParallelLinear(
        HIDDEN,
        FFN,
        state=state,
        gather_output=False,
        sequence_parallel=sequence_parallel,
        seed=1,
        device=device,
    )
    fc2 = RowParallelLinear(
        FFN,
        HIDDEN,
        state=state,
        input_is_parallel=True,
        sequence_parallel=sequence_parallel,
        seed=2,
        device=device,
    )
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, state=state, seed=3, device=device)
    x, dy = data["x"], data["dy"]
    if sequence_parallel:
        x, dy = x.chunk(2)[state.tp_rank], dy.chunk(2)[state.tp_rank]
    x = x.clone().requires_grad_()
    y = fc2(F.gelu(fc1(x)))
    (y * dy).sum().backward()
    allreduce_sequence_parallel_grads(fc2, state)
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dw1": fc1.weight.grad,
        "dw2": fc2.weight.grad,
        "db2": fc2.bias.grad,
        "emb": emb(data["ids"]).detach(),
    }


def _tp_worker() -> dict:
    state = initialize(tp=2)
    data = _data(state.device)
    return {
        "tp_rank": state.tp_rank,
        "device": str(state.device),
        "tp": _tp_forward_backward(state, data, sequence_parallel=False),
        "sp": _tp_forward_backward(state, data, sequence_parallel=True),
    }


def _stage_layers():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(4)]


def _microbatches(device):
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "x": torch.randn(BATCH, HIDDEN, generator=generator).to(device),
            "y": torch.randn(BATCH, HIDDEN, generator=generator).to(device),
        }
        for _ in range(4)
    ]


def _forward_step(model, input_tensor, microbatch):
    return model(microbatch["x"] if input_tensor is None else input_tensor)


def _loss(output, microbatch):
    return F.mse_loss(output, microbatch["y"])


def _pp_worker() -> dict:
    state = initialize(pp=2)
    layers = _stage_layers()[2 * state.pp_rank : 2 * state.pp_rank + 2]
    model = nn.Sequential(*layers).to(state.device)
    out = forward_backward(
        model,
        _microbatches(state.device),
        state=state,
        loss_func=_loss,
        forward_step=_forward_step,
    )
    # Interleaved: rank r holds layers r and 2 + r as two chunks (virtual stages r, 2 + r).
    chunks = [
        nn.Sequential(_stage_layers()[i]).to(state.device)
        for i in (state.pp_rank, 2 + state.pp_rank)
    ]
    interleaved = forward_backward(
        chunks,
        _microbatches(state.device),
        state=state,
        loss_func=_loss,
        forward_step=_forward_step,
        tensor_shape=(BATCH, HIDDEN),
    )
    return {
        "pp_rank": state.pp_rank,
        "losses": out.losses,
        "grads": [p.grad for p in model.parameters()],
        "interleaved_losses": interleaved.losses,
        "interleaved_grads": [[p.grad for p in chunk.parameters()] for chunk in chunks],
    }


def _close(actual, expected):
    assert actual.shape == expected.shape
    assert torch.allclose(actual.cpu(), expected.cpu(), rtol=1e-4, atol=1e-5), (
        (actual.cpu() - expected.cpu()).abs().max()
    )


def _master(seed, shape):
    torch.manual_seed(seed)
    return torch.empty(shape).normal_(0.0, 0.02).cuda()


def test_nccl_tp2_mlp_sequence_parallel_and_embedding_match_one_gpu():
    results = run_distributed(_tp_worker, 2, backend="nccl")
    data = _data("cuda")
    w1 = _master(1, (FFN, HIDDEN)).requires_grad_()
    w2 = _master(2, (HIDDEN, FFN)).requires_grad_()
    b2 = torch.zeros(HIDDEN, device="cuda", requires_grad=True)
    x = data["x"].clone().requires_grad_()
    y = F.linear(F.gelu(F.linear(x, w1)), w2, b2)
    (y * data["dy"]).sum().backward()
    table = _master(3, (VOCAB, HIDDEN))
    for result in results:
        r = result["tp_rank"]
        assert result["device"] == f"cuda:{r}"
        tp, sp = result["tp"], result["sp"]
        _close(tp["y"], y.detach())
        _close(tp["dx"], x.grad)
        _close(tp["dw1"], w1.grad.chunk(2, dim=0)[r])
        _close(tp["dw2"], w2.grad.chunk(2, dim=1)[r])
        _close(tp["db2"], b2.grad)
        _close(tp["emb"], F.embedding(data["ids"], table))
        _close(sp["y"], y.detach().chunk(2)[r])
        _close(sp["dx"], x.grad.chunk(2)[r])
        _close(sp["dw1"], tp["dw1"])
        _close(sp["db2"], tp["db2"])


def test_nccl_pp2_1f1b_and_interleaved_match_one_gpu():
    results = run_distributed(_pp_worker, 2, backend="nccl")
    layers = _stage_layers()
    full = nn.Sequential(*layers).cuda()
    losses = []
    microbatches = _microbatches("cuda")
    for microbatch in microbatches:
        loss = _loss(full(microbatch["x"]), microbatch)
        (loss / len(microbatches)).backward()
        losses.append(loss.detach())
    by_stage = {r["pp_rank"]: r for r in results}
    for loss, expected in zip(by_stage[1]["losses"], losses):
        _close(loss, expected)
    assert by_stage[0]["losses"] == []
    expected_grads = [p.grad for p in full.parameters()]
    half = len(expected_grads) // 2
    for grad, expected in zip(by_stage[0]["grads"], expected_grads[:half]):
        _close(grad, expected)
    for grad, expected in zip(by_stage[1]["grads"], expected_grads[half:]):
        _close(grad, expected)
    for loss, expected in zip(by_stage[1]["interleaved_losses"], losses):
        _close(loss, expected)
    per_layer = [[p.grad for p in layer.parameters()] for layer in layers]
    for rank, result in by_stage.items():
        for chunk_grads, layer_index in zip(result["interleaved_grads"], (rank, 2 + rank)):
            for grad, expected in zip(chunk_grads, per_layer[layer_index]):
                _close(grad, expected)
