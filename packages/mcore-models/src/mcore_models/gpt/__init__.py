"""GPT (Llama/Qwen family): config, plain-torch model, KV-cache interface, HF interop."""

from mcore_models.gpt.config import GPTConfig, RopeScaling
from mcore_models.gpt.kv_cache import ContiguousKVCache, KVCache
from mcore_models.gpt.mla_config import MLAConfig, YarnScaling
from mcore_models.gpt.mla_kv_cache import ContiguousLatentKVCache, LatentKVCache
from mcore_models.gpt.model import GPTModel
from mcore_models.gpt.presets import preset_names

__all__ = [
    "GPTConfig",
    "RopeScaling",
    "GPTModel",
    "KVCache",
    "ContiguousKVCache",
    "preset_names",
    "MLAConfig",
    "YarnScaling",
    "LatentKVCache",
    "ContiguousLatentKVCache",
]
