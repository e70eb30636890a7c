"""Mamba-2 kernels: chunked SSD scan (fwd/bwd), decode state update, causal conv1d.

Each Triton kernel has a torch reference with the same signature (``reference``); dispatch is
Triton on CUDA and the reference on CPU, overridable with ``MCORE_KERNELS_BACKEND``.
"""

from mcore_kernels.ssd.conv import causal_conv1d, causal_conv1d_update
from mcore_kernels.ssd.reference import (
    ssd_scan_recurrent,
    ssd_scan_reference,
    ssd_state_update_reference,
)
from mcore_kernels.ssd.scan import ssd_scan, ssd_scan_triton
from mcore_kernels.ssd.state_update import ssd_state_update, ssd_state_update_triton

__all__ = [
    "causal_conv1d",
    "causal_conv1d_update",
    "ssd_scan",
    "ssd_scan_triton",
    "ssd_scan_reference",
    "ssd_scan_recurrent",
    "ssd_state_update",
    "ssd_state_update_triton",
    "ssd_state_update_reference",
]
