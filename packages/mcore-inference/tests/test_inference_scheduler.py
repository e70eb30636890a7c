"""Scheduler: decode before prefill, token budget, chunk size, first-come-first-served admission."""

import torch

from mcore_inference import BlockAllocator, InferenceConfig, RequestStatus, SamplingParams
from mcore_inference.request import Request
from mcore_inference.scheduler import Scheduler


def _request(request_id, prompt_len, max_new_tokens):
    return Request(
        request_id=request_id,
        prompt=list(range(prompt_len)),
        params=SamplingParams(),
        seed=0,
        max_new_tokens=max_new_tokens,
    )


def _scheduler(**overrides):
    fields = dict(
        max_batch_size=4,
        max_sequence_length=64,
        block_size=4,
        max_tokens_per_step=10,
        prefill_chunk_size=6,
    )
    fields.update(overrides)
    config = InferenceConfig(**fields)
    return Scheduler(config, BlockAllocator(fields.get("num_blocks", 40) + 1), torch.device("cpu"))


def test_decodes_come_first_then_prefill_chunks_within_the_budget():
    scheduler = _scheduler()
    decoding = _request(0, 3, 5)
    decoding.num_computed = 3
    decoding.output = [7]
    long_prompt, short_prompt = _request(1, 20, 5), _request(2, 4, 5)
    for request in (decoding, long_prompt, short_prompt):
        scheduler.waiting.append(request)
    scheduler.admit()
    batch = scheduler.schedule()
    # 1 decode token, a 6-token chunk (chunk size), then 3 tokens left of the budget of 10.
    assert [(r.request_id, n) for r, n in batch] == [(0, 1), (1, 6), (2, 3)]


def test_admission_reserves_the_whole_footprint_and_keeps_arrival_order():
    scheduler = _scheduler(num_blocks=6)
    big, small = _request(0, 10, 10), _request(1, 2, 2)  # 5 blocks and 1 block
    blocker = _request(2, 8, 9)  # 4 blocks: cannot fit next to big
    for request in (big, blocker, small):
        scheduler.waiting.append(request)
    scheduler.admit()
    assert [r.request_id for r in scheduler.active] == [0]
    # The small request waits behind the blocker although it would fit: no starvation.
    assert [r.request_id for r in scheduler.waiting] == [2, 1]
    assert len(big.blocks) == 5 and scheduler.allocator.num_free == 1
    table_row = scheduler.block_tables[big.slot, :5].tolist()
    assert table_row == big.blocks
    scheduler.release(big)
    scheduler.admit()
    assert [r.request_id for r in scheduler.active] == [2, 1]
    assert big.blocks == [] and big.status == RequestStatus.ACTIVE  # the engine sets the status


def test_blocks_needed_skips_the_last_generated_token():
    scheduler = _scheduler()
    assert scheduler.blocks_needed(4, 1) == 1
    assert scheduler.blocks_needed(4, 2) == 2
    assert scheduler.blocks_needed(1, 0) == 1


def test_mixed_token_cap_limits_steps_that_decode_but_not_pure_prefill():
    scheduler = _scheduler(max_tokens_per_step=20)
    scheduler.max_mixed_tokens = 8
    prompts = [_request(1, 20, 5), _request(2, 4, 5)]
    for request in prompts:
        scheduler.waiting.append(request)
    scheduler.admit()
    # Nothing decodes: the whole budget of 20 (chunks of at most 6).
    assert [(r.request_id, n) for r, n in scheduler.schedule()] == [(1, 6), (2, 4)]
    decoding = _request(0, 3, 5)
    decoding.num_computed, decoding.output = 3, [7]
    scheduler.waiting.append(decoding)
    scheduler.admit()
    prompts[0].num_computed = prompts[1].num_computed = 0
    # One decode: the step holds at most 8 tokens, the decode first.
    assert [(r.request_id, n) for r, n in scheduler.schedule()] == [(0, 1), (1, 6), (2, 1)]


def test_mixed_token_cap_never_starves_prefill_when_decodes_fill_it():
    scheduler = _scheduler(max_tokens_per_step=10)
    scheduler.max_mixed_tokens = 2
    decoding = [_request(i, 3, 5) for i in range(2)]
    for request in decoding:
        request.num_computed, request.output = 3, [7]
    prompt = _request(9, 5, 5)
    for request in (*decoding, prompt):
        scheduler.waiting.append(request)
    scheduler.admit()
    # The decodes alone reach the cap: the step falls back to the whole budget.
    assert [(r.request_id, n) for r, n in scheduler.schedule()] == [(0, 1), (1, 1), (9, 5)]
