"""Fused tensor-parallel communication: reduce-scatter + residual add + RMSNorm + all-gather.

``fused_rs_add_rmsnorm_ag`` is what a tensor-parallel layer calls after a row-parallel linear
layer in inference, in place of an all-reduce followed by the residual add and the next RMSNorm.
"""

from mcore_kernels.comm.fallback import rs_add_rmsnorm_ag_collectives
from mcore_kernels.comm.fused import fused_rs_add_rmsnorm_ag

__all__ = ["fused_rs_add_rmsnorm_ag", "rs_add_rmsnorm_ag_collectives"]
