"""Argument checks shared by the kernels and their references."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mcore_kernels._vocab_parallel import group_rank_and_size
from mcore_kernels.errors import (
    KernelDeviceError,
    KernelDtypeError,
    KernelShapeError,
    KernelValueError,
)

__all__ = [
    "FLOAT_DTYPES",
    "check_tensor",
    "check_same_device",
    "check_dtype",
    "check_eps",
    "check_rms_norm_args",
    "check_token_logprobs_args",
    "check_target_range",
    "check_paged_attention_args",
    "PAGED_ATTENTION_DTYPES",
    "check_paged_mla_attention_args",
    "check_rotary_kv_write_args",
    "flat_cache_slots",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Floating dtypes accepted by the kernels (float64 runs on the torch reference only)."""


def check_tensor(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a tensor, else raise a typed error naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise KernelDtypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise :class:`KernelDeviceError` unless every non-None tensor shares one device."""
    present = {name: t for name, t in tensors.items() if t is not None}
    devices = {name: t.device for name, t in present.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise KernelDeviceError(f"tensor arguments must share one device, got {listing}")


def check_dtype(
    name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> None:
    """Raise :class:`KernelDtypeError` naming ``name`` unless ``tensor.dtype`` is ``allowed``.

    Args:
        name: the argument's name, for the message.
        tensor: the argument.
        allowed: the accepted dtypes.

    Raises:
        KernelDtypeError: the dtype is not accepted.
    """
    if tensor.dtype not in allowed:
        raise KernelDtypeError(
            f"{name}.dtype={tensor.dtype} is not supported; expected one of {allowed}"
        )


def check_eps(eps: object) -> None:
    """Raise :class:`KernelValueError` unless ``eps`` is a finite number ``>= 0``.

    Args:
        eps: the variance epsilon of an RMSNorm.

    Raises:
        KernelValueError: ``eps`` is not a number, negative or not finite.
    """
    if (
        isinstance(eps, bool)
        or not isinstance(eps, (int, float))
        or not math.isfinite(eps)
        or eps < 0
    ):
        raise KernelValueError(f"eps={eps!r} must be a finite number >= 0")


def check_rms_norm_args(x: object, weight: object, eps: object, residual: object) -> None:
    """Validate the arguments of ``rms_norm``.

    Args:
        x: input, ``[..., hidden]``.
        weight: scale, ``[hidden]``.
        eps: variance epsilon, a finite float ``>= 0``.
        residual: None or a tensor of the shape and dtype of ``x``.

    Raises:
        KernelDtypeError: a tensor argument is not a tensor or has an unsupported dtype.
        KernelShapeError: shapes do not line up.
        KernelDeviceError: tensors live on different devices.
        KernelValueError: ``eps`` is negative or not finite.
    """
    x = check_tensor("x", x)
    weight = check_tensor("weight", weight)
    check_dtype("x", x)
    check_dtype("weight", weight)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)} must have a non-empty last (hidden) dimension"
        )
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise KernelShapeError(
            f"weight.shape={tuple(weight.shape)} does not match x.shape={tuple(x.shape)}; "
            f"expected ({x.shape[-1]},)"
        )
    check_eps(eps)
    if residual is not None:
        residual = check_tensor("residual", residual)
        if residual.shape != x.shape:
            raise KernelShapeError(
                f"residual.shape={tuple(residual.shape)} must equal x.shape={tuple(x.shape)}"
            )
        if residual.dtype != x.dtype:
            raise KernelDtypeError(f"residual.dtype={residual.dtype} must equal x.dtype={x.dtype}")
    check_same_device(x=x, weight=weight, residual=residual)


def check_token_logprobs_args(
    logits: object,
    targets: object,
    temperature: object,
    ignore_index: object,
    group: dist.ProcessGroup | None = None,
    check_targets: bool = True,
) -> None:
    """Validate the arguments of ``token_logprobs``.

    Args:
        logits: ``[..., V]`` floating logits (a vocabulary shard under tensor parallelism).
        targets: integer tensor of shape ``logits.shape[:-1]``.
        temperature: finite float ``> 0``.
        ignore_index: integer marking rows to skip.
        group: the vocabulary-parallel group: the full vocabulary is ``logits.shape[-1]``
            times its size.
        check_targets: check the target ids against the vocabulary (a host sync on CUDA); the
            check is skipped while a CUDA graph is being captured.

    Raises:
        KernelDtypeError: wrong tensor types or dtypes.
        KernelShapeError: ``targets`` does not match the leading dimensions of ``logits``.
        KernelDeviceError: ``logits`` and ``targets`` live on different devices.
        KernelValueError: ``temperature`` is not a finite positive number, ``ignore_index`` is
            not an integer, or a target lies outside ``[0, vocab_size)`` without being
            ``ignore_index``.
    """
    logits = check_tensor("logits", logits)
    targets = check_tensor("targets", targets)
    check_dtype("logits", logits)
    if targets.dtype not in (torch.int64, torch.int32):
        raise KernelDtypeError(
            f"targets.dtype={targets.dtype} is not supported; expected torch.int64 or torch.int32"
        )
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise KernelShapeError(
            f"logits.shape={tuple(logits.shape)} must have a non-empty last (vocab) dimension"
        )
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise KernelShapeError(
            f"targets.shape={tuple(targets.shape)} must equal logits.shape[:-1]={tuple(logits.shape[:-1])}"
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise KernelValueError(f"temperature={temperature!r} must be a positive finite number")
    if not math.isfinite(temperature) or temperature <= 0:
        raise KernelValueError(f"temperature={temperature!r} must be a positive finite number")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise KernelValueError(f"ignore_index={ignore_index!r} must be an int")
    check_same_device(logits=logits, targets=targets)
    if check_targets:
        check_target_range(targets, logits.shape[-1] * group_rank_and_size(group)[1], ignore_index)


def check_target_range(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise if a target lies outside ``[0, vocab_size)`` without being ``ignore_index``.

    Reads one flag on the host (a sync on CUDA); skipped while a CUDA graph is being captured.

    Args:
        targets: integer token ids.
        vocab_size: size of the full vocabulary.
        ignore_index: id marking rows to skip.

    Raises:
        KernelValueError: a target is out of range.
    """
    capturing = targets.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing or targets.numel() == 0:
        return
    # One host sync: a silent out-of-range gather would return garbage log-probs.
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    if bool(bad.any()):
        first = int(targets[bad].flatten()[0])
        raise KernelValueError(
            f"targets holds {first}, outside [0, {vocab_size}) and not ignore_index={ignore_index}"
        )


PAGED_ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes of the queries and the KV cache accepted by ``paged_attention``."""


def check_paged_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Validate the arguments of ``paged_attention``.

    Args:
        q: ``[T, Hq, D]`` queries.
        k_cache: ``[num_blocks, block_size, Hkv, D]`` keys.
        v_cache: values shaped like ``k_cache``.
        block_tables: ``[T, max_blocks]`` integer block table.
        context_lens: ``[T]`` integer context lengths.

    Raises:
        KernelShapeError: shapes do not match this layout.
        KernelDtypeError: a dtype is unsupported.
    """
    if q.dim() != 3:
        raise KernelShapeError(f"q has shape {tuple(q.shape)}; expected [T, Hq, D]")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise KernelShapeError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            "[num_blocks, block_size, Hkv, D]"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise KernelShapeError(
            f"k_cache head dim {k_cache.shape[3]} differs from q head dim {head_dim}"
        )
    if num_q_heads % num_kv_heads != 0:
        raise KernelShapeError(
            f"q has {num_q_heads} heads, not a multiple of the {num_kv_heads} KV heads"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_tokens:
        raise KernelShapeError(
            f"block_tables has shape {tuple(block_tables.shape)}; expected [{num_tokens}, max_blocks]"
        )
    if context_lens.shape != (num_tokens,):
        raise KernelShapeError(
            f"context_lens has shape {tuple(context_lens.shape)}; expected ({num_tokens},)"
        )
    if q.dtype not in PAGED_ATTENTION_DTYPES or k_cache.dtype not in PAGED_ATTENTION_DTYPES:
        raise KernelDtypeError(
            f"q dtype {q.dtype} / cache dtype {k_cache.dtype}; expected float32, float16 or bfloat16"
        )
    if block_tables.dtype not in (torch.int32, torch.int64) or context_lens.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise KernelDtypeError(
            f"block_tables dtype {block_tables.dtype} / context_lens dtype {context_lens.dtype}; "
            "expected int32 or int64"
        )


def check_paged_mla_attention_args(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Validate the arguments of :func:`paged_mla_attention`.

    Args:
        q_latent: ``[T, H, R]``.
        q_rope: ``[T, H, P]``.
        latent_cache: ``[num_blocks, block_size, R + P]``.
        block_tables: ``[T, max_blocks]``.
        context_lens: ``[T]``.

    Raises:
        KernelShapeError: If the shapes do not match this layout.
        KernelDtypeError: If a dtype is unsupported.
    """
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise KernelShapeError(
            f"q_latent {tuple(q_latent.shape)} and q_rope {tuple(q_rope.shape)}: expected "
            "[T, H, R] and [T, H, P]"
        )
    num_tokens, _, rank = q_latent.shape
    width = rank + q_rope.shape[2]
    if latent_cache.dim() != 3 or latent_cache.shape[2] != width:
        raise KernelShapeError(
            f"latent_cache has shape {tuple(latent_cache.shape)}; expected [num_blocks, "
            f"block_size, {width}] (R={rank} + P={q_rope.shape[2]})"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_tokens:
        raise KernelShapeError(
            f"block_tables has shape {tuple(block_tables.shape)}; expected "
            f"[{num_tokens}, max_blocks]"
        )
    if context_lens.shape != (num_tokens,):
        raise KernelShapeError(
            f"context_lens has shape {tuple(context_lens.shape)}; expected ({num_tokens},)"
        )
    for name, tensor in (("q_latent", q_latent), ("q_rope", q_rope), ("cache", latent_cache)):
        if tensor.dtype not in PAGED_ATTENTION_DTYPES:
            raise KernelDtypeError(
                f"{name} dtype {tensor.dtype}; expected float32, float16 or bfloat16"
            )
    for name, tensor in (("block_tables", block_tables), ("context_lens", context_lens)):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise KernelDtypeError(f"{name} dtype {tensor.dtype}; expected int32 or int64")


def check_rotary_kv_write_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Validate the arguments of ``rotary_kv_write``.

    Args:
        q: ``[T, Hq, D]`` new queries.
        k: ``[T, Hkv, D]`` new keys.
        v: ``[T, Hkv, D]`` new values.
        cos: float32 ``[T, D // 2]`` RoPE cosines.
        sin: float32 ``[T, D // 2]`` RoPE sines.
        k_cache: ``[num_blocks, block_size, Hkv, D]`` key cache.
        v_cache: value cache shaped like ``k_cache``.
        slot_mapping: ``[T]`` integer cache slot of each token.

    Raises:
        KernelShapeError: shapes do not match this layout.
        KernelDtypeError: a dtype is unsupported.
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0]:
        raise KernelShapeError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; expected [T, Hq, D] "
            "and two [T, Hkv, D]"
        )
    num_tokens, _, head_dim = q.shape
    if head_dim % 2 or k.shape[2] != head_dim:
        raise KernelShapeError(
            f"head dims q {head_dim}, k {k.shape[2]}; expected equal and even head dims"
        )
    half = (num_tokens, head_dim // 2)
    if tuple(cos.shape) != half or tuple(sin.shape) != half:
        raise KernelShapeError(
            f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}; expected [T, D // 2] = {half}"
        )
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise KernelDtypeError(f"cos {cos.dtype}, sin {sin.dtype}; expected torch.float32")
    if q.dtype != k.dtype or q.dtype != v.dtype or not q.dtype.is_floating_point:
        raise KernelDtypeError(
            f"q {q.dtype}, k {k.dtype}, v {v.dtype}; expected one floating-point dtype"
        )
    expected_cache = (k.shape[1], head_dim)
    if (
        k_cache.dim() != 4
        or k_cache.shape != v_cache.shape
        or tuple(k_cache.shape[2:]) != expected_cache
    ):
        raise KernelShapeError(
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}; expected two "
            f"[num_blocks, block_size, {expected_cache[0]}, {expected_cache[1]}]"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise KernelShapeError(
            f"slot_mapping has shape {tuple(slot_mapping.shape)}; expected [{num_tokens}]"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise KernelDtypeError(f"slot_mapping has dtype {slot_mapping.dtype}; expected int64")


def flat_cache_slots(cache: torch.Tensor, name: str) -> torch.Tensor:
    """View one layer's cache ``[num_blocks, block_size, Hkv, D]`` as ``[slots, Hkv, D]``.

    Args:
        cache: the layer's key or value cache.
        name: its argument name, for the error.

    Returns:
        The view.

    Raises:
        KernelShapeError: the layout admits no such view.
    """
    try:
        return cache.view(-1, *cache.shape[2:])
    except RuntimeError as error:
        raise KernelShapeError(
            f"{name} with strides {cache.stride()} cannot be viewed as [slots, Hkv, D]; "
            "expected a contiguous layer of the cache"
        ) from error
