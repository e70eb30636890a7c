"""Engine configs shared by test files: a small single-rank engine, and the chunked engine of the
multi-rank tests (tensor, pipeline and expert parallel)."""

from mcore_inference import InferenceConfig


def small_engine_config(use_cuda_graphs=False):
    """Four requests of up to 32 tokens in blocks of 4, decode graphs for batches 1, 2 and 4.

    A budget of 6 tokens a step (prefill chunks of 4) splits the longer prompts into chunks
    over several steps.

    Args:
        use_cuda_graphs: Whether the engine captures and replays CUDA graphs.

    Returns:
        The engine config.
    """
    return InferenceConfig(
        max_batch_size=4,
        max_sequence_length=32,
        block_size=4,
        attention_split_size=8,
        max_tokens_per_step=6,
        prefill_chunk_size=4,
        use_cuda_graphs=use_cuda_graphs,
        cuda_graph_batch_sizes=(1, 2, 4),
    )


def engine_config(**overrides):
    """Eight requests of up to 64 tokens in blocks of 4, prefill chunks of 16 within a budget of
    24 tokens a step.

    Args:
        **overrides: Other values of ``InferenceConfig`` fields.

    Returns:
        The engine config.
    """
    fields = dict(
        max_batch_size=8,
        max_sequence_length=64,
        block_size=4,
        max_tokens_per_step=24,
        prefill_chunk_size=16,
    )
    fields.update(overrides)
    return InferenceConfig(**fields)
