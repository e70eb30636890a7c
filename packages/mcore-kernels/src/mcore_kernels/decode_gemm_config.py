"""Launch configurations of :func:`mcore_kernels.decode_gemm.decode_gemm` and the choice per
projection shape and row count (:func:`decode_gemm_config`)."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_kernels.errors import KernelValueError

__all__ = ["DecodeGemmConfig", "decode_gemm_config"]


@dataclass(kw_only=True, slots=True, frozen=True)
class DecodeGemmConfig:
    """Launch configuration of :func:`mcore_kernels.decode_gemm.decode_gemm`."""

    block_m: int = 64
    """Input rows per program (a power of two >= 16)."""
    block_n: int = 64
    """Output columns per program (with SwiGLU: gate columns, each with its up column)."""
    block_k: int = 64
    """Reduction elements per pipelined loop iteration (a power of two >= 16)."""
    split_k: int = 1
    """Programs sharing one output tile's reduction (float32 partials summed in split order)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 4
    """Software-pipelining stages of the reduction loop."""
    prefetch: bool = True
    """Under programmatic dependent launch, request the program's weights into L2 before
    waiting for the previous kernel."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise KernelValueError(f"DecodeGemmConfig.{name}={value}; expected a power of two")
        for name in ("block_m", "block_n", "block_k"):
            if getattr(self, name) < 16:
                raise KernelValueError(
                    f"DecodeGemmConfig.{name}={getattr(self, name)}; expected >= 16"
                )
        if self.split_k < 1:
            raise KernelValueError(f"DecodeGemmConfig.split_k={self.split_k}; expected >= 1")
        if self.num_stages < 1:
            raise KernelValueError(f"DecodeGemmConfig.num_stages={self.num_stages}; expected >= 1")


def decode_gemm_config(
    rows: int, out_features: int, in_features: int, *, swiglu: bool = False
) -> DecodeGemmConfig:
    """The configuration of a projection of ``rows`` rows.

    Args:
        rows: Input rows ``M``.
        out_features: Output columns ``N_out`` (the activation's width with SwiGLU).
        in_features: Reduction length ``K``.
        swiglu: Whether each program computes gate and up columns.

    Returns:
        The configuration.

    Raises:
        KernelValueError: If a size is not positive.
    """
    for name, value in (
        ("rows", rows),
        ("out_features", out_features),
        ("in_features", in_features),
    ):
        if value < 1:
            raise KernelValueError(f"{name}={value}; expected >= 1")
    # One H200, Qwen2.5-0.5B shapes, 24 chained launches under PDL (round-1 probe): at 64 rows
    # the 896 x 896 o projection ran best with 16 columns per program (3.83 us; 5.06 with 64),
    # at 128 with 32 (4.29 us), at 256 with 64 (5.08 us).
    if rows <= 64:
        block_n = 16
    elif rows <= 128 or swiglu:
        block_n = 32
    else:
        block_n = 64
    tiles = -(-out_features // block_n) * -(-rows // 64)
    split_k = 1
    if tiles < 64:
        # Few output tiles (a narrow projection with a long reduction): share the reduction.
        split_k = max(1, min(128 // tiles, in_features // 512))
    return DecodeGemmConfig(block_n=block_n, split_k=split_k)
