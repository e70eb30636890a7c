"""mcore-inference: a dynamic inference engine over a paged KV cache."""

from mcore_inference._version import __version__
from mcore_inference.block_allocator import BlockAllocator
from mcore_inference.config import InferenceConfig, SamplingParams
from mcore_inference.engine import InferenceEngine
from mcore_inference.errors import (
    BlockAllocatorError,
    EngineClosedError,
    InferenceConfigError,
    InferenceError,
    InvalidRequestError,
    KVCacheExhaustedError,
    KVCacheStepError,
    TokenizerUnavailableError,
    UnsupportedModelError,
    WeightUpdateError,
)
from mcore_inference.expert_parallel import find_expert_parallel_group
from mcore_inference.hf_tokenizer import HFTokenizer
from mcore_inference.kv_cache import PagedKVCache
from mcore_inference.request import FinishReason, GenerationResult, RequestStatus
from mcore_inference.weights import model_weight_shards

__all__ = [
    "__version__",
    "InferenceEngine",
    "InferenceConfig",
    "SamplingParams",
    "GenerationResult",
    "RequestStatus",
    "FinishReason",
    "BlockAllocator",
    "PagedKVCache",
    "find_expert_parallel_group",
    "HFTokenizer",
    "model_weight_shards",
    "InferenceError",
    "InvalidRequestError",
    "EngineClosedError",
    "InferenceConfigError",
    "KVCacheExhaustedError",
    "KVCacheStepError",
    "BlockAllocatorError",
    "TokenizerUnavailableError",
    "UnsupportedModelError",
    "WeightUpdateError",
]
