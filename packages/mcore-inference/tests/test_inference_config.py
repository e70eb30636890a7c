"""InferenceConfig validation and derived values."""

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceConfigError


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(max_batch_size=0), "max_batch_size=0"),
        (dict(block_size=12), "block_size=12"),
        (dict(block_size=16, attention_split_size=40), "attention_split_size=40"),
        (dict(max_batch_size=64, max_tokens_per_step=32), "max_tokens_per_step=32"),
        (dict(num_blocks=-1), "num_blocks=-1"),
        (dict(kv_memory_bytes=0), "kv_memory_bytes=0"),
        (dict(max_batch_size=8, cuda_graph_batch_sizes=(4, 16)), "cuda_graph_batch_sizes"),
        (dict(cuda_graph_batch_sizes=()), "cuda_graph_batch_sizes"),
        (dict(seed=-1), "seed=-1"),
        (dict(kv_dtype="bfloat16"), "kv_dtype='bfloat16'"),
        (dict(kv_dtype=torch.int8), "kv_dtype=torch.int8"),
        (dict(cuda_graph_mixed_steps="on"), "cuda_graph_mixed_steps='on'"),
    ],
)
def test_invalid_config_names_the_field_and_value(fields, message):
    with pytest.raises(InferenceConfigError, match=message):
        InferenceConfig(**fields)


def test_default_graph_buckets_cover_the_batch_size():
    assert InferenceConfig(max_batch_size=40).graph_batch_sizes() == (1, 2, 4, 8, 16, 32, 40)
    explicit = InferenceConfig(max_batch_size=8, cuda_graph_batch_sizes=(8, 2, 2))
    assert explicit.graph_batch_sizes() == (2, 8)


def test_token_budget_defaults_to_fit_every_decoding_request():
    assert InferenceConfig(max_batch_size=4).max_tokens_per_step == 2048
    assert InferenceConfig(max_batch_size=4096).max_tokens_per_step == 4096


def test_block_table_width_rounds_up():
    assert InferenceConfig(max_sequence_length=33, block_size=16).max_blocks_per_sequence == 3
