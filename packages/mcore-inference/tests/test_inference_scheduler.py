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


def _graph_scheduler(backlog_steps):
    scheduler = _scheduler(max_tokens_per_step=20)
    scheduler.graph_step_tokens = 8
    scheduler.graph_backlog_steps = backlog_steps
    for request in (_request(1, 20, 5), _request(2, 4, 5)):
        scheduler.waiting.append(request)
    scheduler.admit()
    return scheduler


def test_a_small_prompt_backlog_goes_a_graph_step_at_a_time():
    scheduler = _graph_scheduler(backlog_steps=8)  # 24 prompt tokens fit in 8 steps of 8
    assert [(r.request_id, n) for r, n in scheduler.schedule()] == [(1, 6), (2, 2)]
    decoding = _request(0, 3, 5)
    decoding.num_computed, decoding.output = 3, [7]
    scheduler.waiting.append(decoding)
    scheduler.admit()
    # A decode first, then prompt tokens up to the graph's 8 tokens.
    assert [(r.request_id, n) for r, n in scheduler.schedule()] == [(0, 1), (1, 6), (2, 1)]


def test_a_large_prompt_backlog_takes_the_whole_budget():
    scheduler = _graph_scheduler(backlog_steps=2)  # 24 prompt tokens > 2 steps of 8
    assert [(r.request_id, n) for r, n in scheduler.schedule()] == [(1, 6), (2, 4)]


def test_decodes_that_fill_the_graph_leave_the_whole_budget_to_prefill():
    scheduler = _scheduler(max_tokens_per_step=10)
    scheduler.graph_step_tokens = 2
    decoding = [_request(i, 3, 5) for i in range(2)]
    for request in decoding:
        request.num_computed, request.output = 3, [7]
    prompt = _request(9, 5, 5)
    for request in (*decoding, prompt):
        scheduler.waiting.append(request)
    scheduler.admit()
    assert [(r.request_id, n) for r, n in scheduler.schedule()] == [(0, 1), (1, 1), (9, 5)]
