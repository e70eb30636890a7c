"""Hybrid Mamba-2 models: Mamba-2 mixers mixed with attention, MLP and MoE layers by a pattern."""

from mcore_models.mamba.config import LAYER_KINDS, HybridConfig
from mcore_models.mamba.layers import HybridLayer, SquaredReLUMLP
from mcore_models.mamba.mixer import GatedRMSNorm, Mamba2Mixer, gated_rms_norm
from mcore_models.mamba.model import HybridModel
from mcore_models.mamba.presets import hybrid_preset, hybrid_preset_names
from mcore_models.mamba.state import MambaStepState

__all__ = [
    "LAYER_KINDS",
    "GatedRMSNorm",
    "HybridConfig",
    "HybridLayer",
    "HybridModel",
    "Mamba2Mixer",
    "MambaStepState",
    "SquaredReLUMLP",
    "gated_rms_norm",
    "hybrid_preset",
    "hybrid_preset_names",
]
