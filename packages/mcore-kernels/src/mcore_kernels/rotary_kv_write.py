"""RoPE of the new queries and keys fused with the write of keys and values into a paged cache.

A decode step of a decoder layer rotates its new queries and keys (RoPE, the "rotate half"
layout of Hugging Face) and stores the keys and values into their cache slots. Unfused that is
about a dozen small kernels per layer (casts of the tables, slices, products, a concatenation
per tensor, an ``index_copy_`` per cache); this kernel does all of it in one launch: one
program per token reads its query heads as one ``[Hq, D / 2]`` tile pair and its key and value
heads as ``[Hkv, D / 2]`` tiles, writes the rotated queries into a new tensor and the rotated
keys and the values straight into the token's slot. (One program per (token, head), as
before, took 6.13 against 1.96 us for 512 tokens of 14 + 2 heads on one H200: the launch of
9,216 one-warp programs, not the bytes, set the time.)

The products round to the dtype of ``q`` where the unfused expression ``x1 * cos - x2 * sin``
does (the tables, each product, then the sum), in the rotation every RoPE kernel of the package
shares (:func:`mcore_kernels._triton_utils.rotate_half_rounded`, which the compiler cannot
contract into fused multiply-adds): the torch reference's bits. Shapes:

- ``q``: ``[T, Hq, D]``; ``k``, ``v``: ``[T, Hkv, D]`` (strided views of a fused projection are
  fine; the last dimension must be contiguous)
- ``cos``, ``sin``: float32 ``[T, D // 2]``
- ``k_cache``, ``v_cache``: one layer's ``[num_blocks, block_size, Hkv, D]``
- ``slot_mapping``: int64 ``[T]``, ``block * block_size + offset`` of each token
- returns the rotated queries ``[T, Hq, D]`` (contiguous, dtype of ``q``)

The file holds the Triton kernel, its launcher, the ``torch.library`` registration (the op
``torch.ops.mcore_kernels.rotary_kv_write`` writes the caches in place) and the entry point; the
torch reference lives in :mod:`mcore_kernels.reference` (re-exported here). Dispatch: Triton on
CUDA, the torch reference on CPU; ``MCORE_KERNELS_BACKEND=torch|triton``
overrides (with ``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    rotate_half_rounded,
    tl,
    triton,
)
from mcore_kernels._validation import check_rotary_kv_write_args
from mcore_kernels._validation import flat_cache_slots as _flat_slots
from mcore_kernels.errors import KernelBackendError, KernelShapeError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import rotary_kv_write_reference

__all__ = [
    "RotaryCacheWrite",
    "rotary_kv_write",
    "rotary_kv_write_reference",
    "rotary_kv_write_triton",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class RotaryCacheWrite:
    """What :func:`rotary_kv_write` needs besides q/k/v, for a projection that folds it in.

    ``mcore_kernels.decode_gemv.decode_gemv(..., rope=RotaryCacheWrite(...))`` computes the
    q/k/v projection, rotates the queries and keys, stores the keys and values in their cache
    slots and returns the rotated queries: the projection plus :func:`rotary_kv_write` in one
    launch.
    """

    cos: torch.Tensor
    """float32 ``[T, D // 2]`` RoPE cosines of the tokens' positions."""
    sin: torch.Tensor
    """float32 ``[T, D // 2]`` RoPE sines."""
    k_cache: torch.Tensor
    """One layer's key cache ``[num_blocks, block_size, Hkv, D]`` (written in place)."""
    v_cache: torch.Tensor
    """One layer's value cache, shaped like ``k_cache`` (written in place)."""
    slot_mapping: torch.Tensor
    """``[T]`` flat cache slot of each token."""
    num_q_heads: int
    """Query heads ``Hq`` (the projection's rows are ``Hq`` query, ``Hkv`` key, ``Hkv`` value
    heads of ``D`` rows each)."""

    def __post_init__(self) -> None:
        if self.num_q_heads < 1:
            raise KernelShapeError(
                f"RotaryCacheWrite.num_q_heads={self.num_q_heads}; expected >= 1"
            )
        if self.k_cache.dim() != 4:
            raise KernelShapeError(
                f"RotaryCacheWrite.k_cache has shape {tuple(self.k_cache.shape)}; expected "
                "[num_blocks, block_size, Hkv, D]"
            )

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads ``Hkv`` of the cache."""
        return int(self.k_cache.shape[2])

    @property
    def head_dim(self) -> int:
        """Channels per head ``D``."""
        return int(self.k_cache.shape[3])

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, (Hq + 2 Hkv) * D]`` projection output as ``[T, H, D]`` q, k and v views.

        Args:
            qkv: The projection's output.

        Returns:
            The q, k and v views.
        """
        d = self.head_dim
        q_width, kv_width = self.num_q_heads * d, self.num_kv_heads * d
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        return q.unflatten(-1, (-1, d)), k.unflatten(-1, (-1, d)), v.unflatten(-1, (-1, d))

    def check(self, qkv: torch.Tensor) -> None:
        """Check the tensors against a projection output (a meta tensor will do).

        Args:
            qkv: ``[T, (Hq + 2 Hkv) * D]``, shaped and typed like the projection's output.

        Raises:
            KernelShapeError: If the shapes do not fit :func:`rotary_kv_write`.
            KernelDtypeError: If a dtype does not.
        """
        check_rotary_kv_write_args(
            *self.split(qkv), self.cos, self.sin, self.k_cache, self.v_cache, self.slot_mapping
        )


@jit
def _rotary_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cos_token,
    stride_sin_token,
    stride_out_token,
    stride_out_head,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        # Programmatic dependent launch: let the next kernel start, then wait for the previous
        # one (which wrote q, k, v and the tables) before reading anything.
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    channels = tl.arange(0, HALF_PAD)[None, :]
    channel_mask = channels < HALF
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + token * stride_cos_token + channels, mask=channel_mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_sin_token + channels, mask=channel_mask, other=0.0)

    q_heads = tl.arange(0, Q_HEADS_PAD)[:, None]
    q_mask = (q_heads < NUM_Q_HEADS) & channel_mask
    q_source = q_ptr + token * stride_q_token + q_heads * stride_q_head + channels
    x1 = tl.load(q_source, mask=q_mask, other=0.0).to(tl.float32)
    x2 = tl.load(q_source + HALF, mask=q_mask, other=0.0).to(tl.float32)
    first, second = rotate_half_rounded(x1, x2, cos, sin, dtype)
    q_target = q_out_ptr + token * stride_out_token + q_heads * stride_out_head + channels
    tl.store(q_target, first, mask=q_mask)
    tl.store(q_target + HALF, second, mask=q_mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    kv_heads = tl.arange(0, KV_HEADS_PAD)[:, None]
    kv_mask = (kv_heads < NUM_KV_HEADS) & channel_mask
    k_source = k_ptr + token * stride_k_token + kv_heads * stride_k_head + channels
    y1 = tl.load(k_source, mask=kv_mask, other=0.0).to(tl.float32)
    y2 = tl.load(k_source + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    k_first, k_second = rotate_half_rounded(y1, y2, cos, sin, k_ptr.dtype.element_ty)
    cache_dtype = k_cache_ptr.dtype.element_ty
    k_target = k_cache_ptr + slot * stride_kc_slot + kv_heads * stride_kc_head + channels
    tl.store(k_target, k_first.to(cache_dtype), mask=kv_mask)
    tl.store(k_target + HALF, k_second.to(cache_dtype), mask=kv_mask)
    v_source = v_ptr + token * stride_v_token + kv_heads * stride_v_head + channels
    v_target = v_cache_ptr + slot * stride_vc_slot + kv_heads * stride_vc_head + channels
    value_dtype = v_cache_ptr.dtype.element_ty
    low = tl.load(v_source, mask=kv_mask, other=0.0)
    high = tl.load(v_source + HALF, mask=kv_mask, other=0.0)
    tl.store(v_target, low.to(value_dtype), mask=kv_mask)
    tl.store(v_target + HALF, high.to(value_dtype), mask=kv_mask)


def rotary_kv_write_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Triton path of :func:`rotary_kv_write`: one launch, fixed shapes (graph-safe).

    Args:
        q: ``[T, Hq, D]`` new queries.
        k: ``[T, Hkv, D]`` new keys.
        v: ``[T, Hkv, D]`` new values.
        cos: float32 ``[T, D // 2]`` RoPE cosines.
        sin: float32 ``[T, D // 2]`` RoPE sines.
        k_cache: One layer's key cache ``[num_blocks, block_size, Hkv, D]`` (written in place).
        v_cache: One layer's value cache, shaped like ``k_cache`` (written in place).
        slot_mapping: ``[T]`` flat cache slot of each token.

    Returns:
        The rotated queries ``[T, Hq, D]``.

    Raises:
        KernelShapeError: If the shapes do not match the layout above.
        KernelDtypeError: If a dtype is unsupported.
        KernelBackendError: If Triton is not installed.
    """
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    check_rotary_kv_write_args(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    for name, tensor in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        if tensor.stride(-1) != 1:
            raise KernelShapeError(
                f"{name} has strides {tensor.stride()}; expected a contiguous last dimension"
            )
    keys = _flat_slots(k_cache, "k_cache")
    values = _flat_slots(v_cache, "v_cache")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise KernelShapeError("k_cache and v_cache must have a contiguous last dimension")
    half = head_dim // 2
    use_pdl = pdl_enabled(q.device)
    _rotary_kv_write_kernel[(num_tokens,)](
        q,
        k,
        v,
        cos,
        sin,
        out,
        keys,
        values,
        slot_mapping.contiguous(),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PAD=next_power_of_2(num_q_heads),
        KV_HEADS_PAD=next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PAD=next_power_of_2(half),
        USE_PDL=use_pdl,
        # One H200, 512 tokens of 14 + 2 heads: 1.96 us with 4 warps (2.23 with 1).
        num_warps=4,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out


def rotary_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate new queries and keys by RoPE and store keys and values in their cache slots.

    Args:
        q: ``[T, Hq, D]`` new queries (after QK-norm, if any).
        k: ``[T, Hkv, D]`` new keys.
        v: ``[T, Hkv, D]`` new values.
        cos: float32 ``[T, D // 2]`` RoPE cosines.
        sin: float32 ``[T, D // 2]`` RoPE sines.
        k_cache: One layer's key cache ``[num_blocks, block_size, Hkv, D]`` (written in place,
            in its own dtype).
        v_cache: One layer's value cache, shaped like ``k_cache`` (written in place).
        slot_mapping: ``[T]`` flat cache slot (``block * block_size + offset``) of each token.

    Returns:
        The rotated queries ``[T, Hq, D]`` in the dtype of ``q``. Under ``torch.compile`` the
        call is the custom op ``torch.ops.mcore_kernels.rotary_kv_write`` (mutating both
        caches).

    Raises:
        KernelShapeError: If the shapes do not match the layout above.
        KernelDtypeError: If a dtype is unsupported.
        KernelBackendError: If ``MCORE_KERNELS_BACKEND`` names an unknown backend or one that
            cannot run on these tensors.
    """
    if _compile.compiling():
        check_rotary_kv_write_args(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return _rotary_kv_write_op(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return _rotary_kv_write_run(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def _rotary_kv_write_run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    if use_triton(q, k, v):
        return rotary_kv_write_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rotary_kv_write_reference(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


@_compile.custom_op(
    "rotary_kv_write",
    "(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor",
    mutates_args=("k_cache", "v_cache"),
)
def _rotary_kv_write_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    return _rotary_kv_write_run(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


_rotary_kv_write_op.register_fake(lambda q, *args: q.new_empty(q.shape))
