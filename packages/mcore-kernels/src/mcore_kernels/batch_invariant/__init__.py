"""Batch-invariant kernels and the mode that routes a model's GEMMs to them.

A row's value (a token's log-prob, in the end) must not depend on how many other rows share
its kernel launch: batch size, batch composition, chunked-prefill split, padding or CUDA graph
bucket. Here every GEMM and the attention reduce each row in an order fixed by the problem's
inner sizes only, so the inference engine's incremental decode and the trainer's packed forward
give bitwise-identical results (see the user guide, "Batch-invariant mode").
"""

from mcore_kernels.batch_invariant.attention import (
    SPLIT_SIZE,
    TILE,
    attention_batch_invariant,
    packed_attention_batch_invariant,
)
from mcore_kernels.batch_invariant.matmul import (
    bmm_batch_invariant,
    grouped_mm_batch_invariant,
    linear_batch_invariant,
    matmul_reference,
    mm_batch_invariant,
)
from mcore_kernels.batch_invariant.mode import batch_invariant_mode, is_batch_invariant
from mcore_kernels.batch_invariant.reference import attention_batch_invariant_reference

__all__ = [
    "SPLIT_SIZE",
    "TILE",
    "attention_batch_invariant",
    "attention_batch_invariant_reference",
    "batch_invariant_mode",
    "bmm_batch_invariant",
    "grouped_mm_batch_invariant",
    "is_batch_invariant",
    "linear_batch_invariant",
    "matmul_reference",
    "mm_batch_invariant",
    "packed_attention_batch_invariant",
]
