"""mcore-models: GPT and MoE models in plain torch, parallelized with mcore-parallel."""

from mcore_models._version import __version__
from mcore_models.errors import (
    AttentionBackendError,
    CheckpointFormatError,
    KVCacheError,
    ModelConfigError,
    ModelError,
    ModelInputError,
    PackedSeqError,
)
from mcore_models.gpt import (
    ContiguousKVCache,
    ContiguousLatentKVCache,
    GPTConfig,
    GPTModel,
    KVCache,
    LatentKVCache,
    MLAConfig,
    RopeScaling,
    YarnScaling,
    preset_names,
)
from mcore_models.gpt.qk_clip import (
    attention_logit_maxima,
    clip_qk,
    reset_attention_logit_maxima,
)
from mcore_models.mamba import HybridConfig, HybridModel, MambaStepState, hybrid_preset
from mcore_models.moe import DecodeExpertPadding, MoEConfig, MoELayer, set_decode_expert_padding
from mcore_models.packed_seq import PackedSeqParams
from mcore_models.parallelize import (
    PipelineLayout,
    materialize,
    parallelize,
    stage_layer_ranges,
)
from mcore_models.stages import build_pipeline_stages

__all__ = [
    "__version__",
    "GPTConfig",
    "GPTModel",
    "RopeScaling",
    "PackedSeqParams",
    "KVCache",
    "ContiguousKVCache",
    "MLAConfig",
    "YarnScaling",
    "LatentKVCache",
    "ContiguousLatentKVCache",
    "preset_names",
    "clip_qk",
    "attention_logit_maxima",
    "reset_attention_logit_maxima",
    "ModelError",
    "ModelConfigError",
    "CheckpointFormatError",
    "AttentionBackendError",
    "ModelInputError",
    "PackedSeqError",
    "KVCacheError",
    "MoEConfig",
    "HybridConfig",
    "HybridModel",
    "MambaStepState",
    "hybrid_preset",
    "MoELayer",
    "set_decode_expert_padding",
    "DecodeExpertPadding",
    "PipelineLayout",
    "build_pipeline_stages",
    "materialize",
    "parallelize",
    "stage_layer_ranges",
]
