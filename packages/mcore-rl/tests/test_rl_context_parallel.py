"""Packing for context parallelism: slots of 2 cp tokens, the loss mask of the unpadded packing,
each cp rank's chunks of every row gathering back to the full rows, and a checkpoint's policy at
cp=2 giving the whole model's log-probs (gloo, world 2)."""

import pytest
import torch
import torch.distributed as dist

from mcore_models import GPTConfig, GPTModel
from mcore_models.gpt.context_parallel import ContextParallelAttention as ContextParallel
from mcore_parallel.context_parallel import gather_sequence, position_ids
from mcore_parallel.testing import run_distributed
from mcore_rl.config import ParallelConfig
from mcore_rl.context_parallel import packing_multiples, split_packed_rows, split_packing_context
from mcore_rl.errors import PackingError
from mcore_rl.logprobs import row_logprobs
from mcore_rl.packing import PackingContext, pack_sequences
from mcore_rl.policy import load_policy_chunks

CP = 2
SEQUENCES = [
    [1, 2, 3, 4, 5, 6, 7],  # 7 tokens: slot of 8
    [1, 2, 3, 9, 9],  # 5: slot of 8
    [1, 2, 3, 4, 8, 8, 8, 8, 8, 8],  # 10: slot of 12
    [1, 2, 3, 4],  # 4: a full slot
    [5, 6, 7, 8, 9, 10],  # 6: slot of 8
]
PROMPTS = [4, 3, 4, 2, 5]
ADVANTAGES = [0.5, -1.0, 2.0, 0.25, -0.75]


def _context(slot_multiple, budget=20):
    info = pack_sequences(
        [len(s) for s in SEQUENCES],
        token_budget=budget,
        max_sequences_per_bin=3,
        slot_multiple=slot_multiple,
        pad_multiple=8,
    )
    context = PackingContext.build(
        SEQUENCES, PROMPTS, ADVANTAGES, info, max_sequences_per_bin=3, pad_id=0
    )
    return info, context


def test_multiples_follow_the_layout():
    assert packing_multiples(ParallelConfig()) == (8, 1)
    assert packing_multiples(ParallelConfig(cp=2)) == (8, 4)
    # Sequence parallelism splits each cp rank's bin / cp tokens over tp.
    assert packing_multiples(ParallelConfig(tp=4, cp=4, sequence_parallel=True)) == (16, 8)


def test_slots_pad_every_sequence_to_a_multiple_of_2cp_outside_the_loss():
    info, context = _context(2 * CP)
    plain_info, plain = _context(1)
    assert info.lengths == plain_info.lengths == tuple(len(s) for s in SEQUENCES)
    assert [info.slot_length(i) for i in range(len(SEQUENCES))] == [8, 8, 12, 4, 8]
    assert info.bin_size % (2 * CP) == 0
    bounds = context.cu_seqlens
    assert bool(((bounds[:, 1:] - bounds[:, :-1]) % (2 * CP) == 0).all())
    # The same completion tokens count, with the same advantages and targets, in both packings.
    completions = [len(s) - p for s, p in zip(SEQUENCES, PROMPTS)]
    assert context.num_tokens == plain.num_tokens == sum(completions)
    values = [torch.arange(n, dtype=torch.float32) + 10 * i for i, n in enumerate(completions)]
    for packed in (context, plain):
        scattered = packed.scatter(values)
        gathered = packed.gather(scattered)
        for i, value in enumerate(values):
            torch.testing.assert_close(gathered[i], value)
        completion = packed.gather(packed.target_ids.float())
        advantages = packed.gather(packed.advantages)
        for i, (seq, p) in enumerate(zip(SEQUENCES, PROMPTS)):
            assert completion[i].tolist() == [float(t) for t in seq[p:]]
            assert advantages[i].tolist() == [ADVANTAGES[i]] * (len(seq) - p)
    # The padding of a slot is never a loss position: masked tokens are only completions.
    assert float((context.loss_mask * (context.input_ids == 0)).sum()) == 0.0


def test_split_rows_reject_segments_that_are_not_multiples_of_2cp():
    _, plain = _context(1)
    with pytest.raises(PackingError, match="multiple of 2 \\* cp = 4"):
        split_packed_rows(plain.loss_mask, plain.cu_seqlens, CP, 0)
    with pytest.raises(PackingError, match="cp_rank=2 must be in"):
        split_packing_context(plain, CP, 2)


def _split_and_gather():
    rank = dist.get_rank()
    _, context = _context(2 * CP)
    local = split_packing_context(context, CP, rank)
    names = ("input_ids", "position_ids", "target_ids", "loss_mask", "advantages")
    gathered = {}
    for name in names:
        rows = []
        for row in range(context.input_ids.shape[0]):
            part = getattr(local, name)[row : row + 1]
            rows.append(gather_sequence(part, None, dim=1, cu_seqlens=context.cu_seqlens[row]))
        gathered[name] = torch.cat(rows)
    # Positions of the split rows are the context-parallel positions of mcore-parallel's helper.
    expected_positions = torch.stack(
        [
            position_ids(context.max_seqlen, CP, rank, cu_seqlens=context.cu_seqlens[row])
            for row in range(context.input_ids.shape[0])
        ]
    )
    try:
        local.scatter([])
        scatter_refused = False
    except PackingError:
        scatter_refused = True
    return {
        "full": {name: getattr(context, name) for name in names},
        "gathered": gathered,
        "local_shape": tuple(local.input_ids.shape),
        "local_tokens": local.num_tokens,
        "positions_match": torch.equal(local.position_ids, expected_positions),
        "cu_seqlens": torch.equal(local.cu_seqlens, context.cu_seqlens),
        "scatter_refused": scatter_refused,
    }


def test_each_cp_rank_gets_its_chunks_and_they_gather_back_to_the_rows():
    results = run_distributed(_split_and_gather, CP)
    full = results[0]["full"]
    rows, bin_size = full["input_ids"].shape
    for result in results:
        assert result["local_shape"] == (rows, bin_size // CP)
        for name, tensor in result["gathered"].items():
            torch.testing.assert_close(tensor, full[name], rtol=0, atol=0), name
        assert result["positions_match"] and result["cu_seqlens"] and result["scatter_refused"]
    # Every loss token is on exactly one cp rank.
    assert sum(r["local_tokens"] for r in results) == int(full["loss_mask"].sum())


def _hf_logprobs_over_cp(path):
    # The policy loaded from a checkpoint at cp=2 with all-gather attention: each rank's
    # log-probs of its split rows, gathered back, equal the whole model's on the full rows.
    from mcore_parallel.state import initialize

    torch.manual_seed(0)
    state = initialize(cp=CP)
    chunks = load_policy_chunks(path, state, dtype="float32", context_parallel_method="all_gather")
    methods = {
        module.method for module in chunks[0].modules() if isinstance(module, ContextParallel)
    }
    _, context = _context(2 * CP)
    local = split_packing_context(context, CP, state.rank_in("cp"))
    whole = GPTModel.from_hf(path, dtype="float32")
    errors = []
    with torch.no_grad():
        for row in range(context.input_ids.shape[0]):
            got = row_logprobs(chunks[0], local, row)
            full = gather_sequence(
                got, state.group("cp"), dim=1, cu_seqlens=context.cu_seqlens[row]
            )
            expected = row_logprobs(whole, context, row)
            mask = context.loss_mask[row] > 0
            errors.append(float((full - expected)[:, mask].abs().max()))
    state.destroy()
    return methods, errors


def test_policy_from_a_checkpoint_gives_the_whole_model_logprobs_over_cp(tmp_path):
    config = GPTConfig.from_name(
        "tiny", hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, vocab_size=16, seed=3,
    )  # fmt: skip
    GPTModel(config).to_hf(tmp_path)
    for methods, errors in run_distributed(_hf_logprobs_over_cp, CP, str(tmp_path)):
        assert methods == {"all_gather"}
        # fp32; attention split over ranks merges softmax pieces in another order.
        assert max(errors) < 1e-5, errors
