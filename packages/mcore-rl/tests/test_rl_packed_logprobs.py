"""Packed log-probs equal the log-probs of every sequence run on its own."""

import torch

from mcore_kernels import token_logprobs
from mcore_models import GPTConfig, GPTModel
from mcore_rl.logprobs import row_logprobs
from mcore_rl.packing import PackingContext, distribute_bins, pack_sequences


def test_packed_logprobs_equal_unpacked_per_sequence():
    model = GPTModel(
        GPTConfig.from_name(
            "tiny", vocab_size=40, hidden_size=32, num_layers=2, num_attention_heads=2, seed=3
        )
    )
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 11, 5, 9, 4, 6]
    sequences = [torch.randint(3, 40, (n,), generator=g).tolist() for n in lengths]
    prompts = [2, 1, 4, 3, 5, 2, 1]
    info = pack_sequences(lengths, 16, max_sequences_per_bin=3, algorithm="ffd")
    ranks = distribute_bins(info, 2)
    temperature = 0.7
    packed: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for bins in ranks:
            ctx = PackingContext.build(
                sequences, prompts, [0.0] * 7, info, bin_indices=bins, max_sequences_per_bin=3
            )
            rows = torch.stack(
                [row_logprobs(model, ctx, r, temperature=temperature)[0] for r in range(len(bins))]
            )
            packed.update(ctx.gather(rows))
        assert sorted(packed) == list(range(7))
        for i, seq in enumerate(sequences):
            ids = torch.tensor(seq)[None]
            logits = model(ids)[0]
            expected = token_logprobs(logits[:-1], ids[0, 1:], temperature=temperature)
            torch.testing.assert_close(packed[i], expected[prompts[i] - 1 :], atol=1e-5, rtol=1e-5)


def test_loss_positions_only_equals_full_row_on_loss_positions_with_gradients():
    model = GPTModel(
        GPTConfig.from_name(
            "tiny", vocab_size=40, hidden_size=32, num_layers=2, num_attention_heads=2, seed=5
        )
    )
    g = torch.Generator().manual_seed(1)
    lengths = [9, 6, 12]
    sequences = [torch.randint(3, 40, (n,), generator=g).tolist() for n in lengths]
    prompts = [3, 2, 5]
    info = pack_sequences(lengths, 32, max_sequences_per_bin=3, algorithm="ffd")
    ctx = PackingContext.build(sequences, prompts, [0.0] * 3, info, max_sequences_per_bin=3)
    mask = ctx.loss_mask[0].bool()
    weights = torch.randn(2, ctx.loss_mask.shape[1], generator=g) * ctx.loss_mask[0]

    def run(trimmed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        out = row_logprobs(model, ctx, 0, temperature=0.8, loss_positions_only=trimmed)
        (out * weights).sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    full, full_grads = run(False)
    trimmed, trimmed_grads = run(True)
    assert 0 < int(mask.sum()) < mask.numel()
    torch.testing.assert_close(trimmed[:, mask], full[:, mask], atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(trimmed[:, ~mask]) == 0
    for got, expected in zip(trimmed_grads, full_grads):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
