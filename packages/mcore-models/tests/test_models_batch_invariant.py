"""GPTConfig.batch_invariant: a sequence's log-probs do not depend on what it is packed with."""

import pytest
import torch

from mcore_models import ModelConfigError, MoEConfig, PackedSeqParams
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel

VOCAB = 128


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=["dense", "moe"])
def models(request):
    moe = MoEConfig(num_experts=4, top_k=2) if request.param == "moe" else None
    invariant = GPTModel(
        GPTConfig.from_name("tiny", vocab_size=VOCAB, seed=5, moe=moe, batch_invariant=True)
    ).eval()
    plain = GPTModel(GPTConfig.from_name("tiny", vocab_size=VOCAB, seed=5, moe=moe)).eval()
    return invariant, plain


def _sequences(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]


@torch.no_grad()
def _packed_logprobs(model, sequences):
    ids = torch.cat(sequences)[None]
    labels = torch.cat([torch.cat([s[1:], s[:1]]) for s in sequences])[None]
    lengths = torch.tensor([len(s) for s in sequences])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    packed = PackedSeqParams(cu_seqlens=cu, max_seqlen=int(lengths.max()))
    out = model(ids, packed_seq_params=packed, labels=labels)[0]
    return list(out.split(lengths.tolist()))


def test_sequence_logprobs_bitwise_equal_whatever_it_is_packed_with(models):
    invariant, _ = models
    sequences = _sequences((9, 30, 1, 17))
    together = _packed_logprobs(invariant, sequences)
    shuffled = _packed_logprobs(invariant, sequences[::-1])[::-1]
    for i, sequence in enumerate(sequences):
        alone = _packed_logprobs(invariant, [sequence])[0]
        assert torch.equal(alone, together[i])
        assert torch.equal(shuffled[i], together[i])
    # An unpacked batch of equal-length rows gives the same values too.
    rows = torch.stack([sequences[0], sequences[0]])
    labels = torch.cat([rows[:, 1:], rows[:, :1]], dim=1)
    with torch.no_grad():
        batched = invariant(rows, labels=labels)
    assert torch.equal(batched[1], together[0])


def test_batch_invariant_forward_matches_the_default_forward_to_rounding(models):
    invariant, plain = models
    sequences = _sequences((12, 20), seed=1)
    for got, want in zip(
        _packed_logprobs(invariant, sequences), _packed_logprobs(plain, sequences), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_batch_invariant_backward_gives_the_default_gradients(models):
    invariant, plain = models
    ids = _sequences((16,), seed=2)[0][None]
    grads = []
    for model in (invariant, plain):
        model.zero_grad()
        model(ids).logsumexp(-1).sum().backward()
        grads.append(model.layers[0].self_attention.q_proj.weight.grad.clone())
        model.zero_grad()
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-3)


def test_batch_invariant_must_be_a_bool():
    with pytest.raises(ModelConfigError, match="batch_invariant"):
        GPTConfig.from_name("tiny", batch_invariant="yes")
