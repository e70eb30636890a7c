"""Fully sharded data parallelism on torch FSDP2 (``fully_shard``) with default device meshes.

torch moved ``fully_shard`` from ``torch.distributed._composable.fsdp`` to
``torch.distributed.fsdp`` (2.6) and grew ``set_gradient_divide_factor`` later; both are looked
up defensively so the wrapper runs on every torch >= 2.6. Only the stable DeviceMesh calls
(``init_device_mesh`` with dimension names, slicing by name, ``get_group``) are used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel.errors import ParallelConfigError, ParallelStateError, ParallelTypeError

__all__ = ["build_fsdp_mesh", "fully_shard_model", "fully_shard_optimizer", "is_fsdp_param"]

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _fsdp_api() -> tuple[Any, Any]:
    # Imported on first use: torch.distributed.fsdp costs seconds to import, which every
    # spawned test rank and every DDP-only user would otherwise pay.
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # pragma: no cover - torch 2.4/2.5 layout
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            MixedPrecisionPolicy,
            fully_shard,
        )
    return fully_shard, MixedPrecisionPolicy


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def build_fsdp_mesh(*, replicate_size: int = 1, device_type: str | None = None) -> DeviceMesh:
    """Builds the default FSDP mesh over the world: 1-D ``("fsdp",)`` or 2-D HSDP.

    With ``replicate_size > 1`` the mesh is ``(replicate_size, world // replicate_size)`` with
    dimension names ``("replicate", "fsdp")``: parameters are sharded within each row of
    consecutive ranks and replicated across rows (hybrid sharding).

    Args:
        replicate_size: Number of replicas (1 for plain FSDP).
        device_type: ``"cuda"`` or ``"cpu"``; None follows the backend (NCCL means CUDA).

    Returns:
        The device mesh.

    Raises:
        ParallelStateError: If torch.distributed is not initialised.
        ParallelConfigError: If ``replicate_size`` does not divide the world size.
    """
    if not dist.is_initialized():
        raise ParallelStateError("build_fsdp_mesh() needs torch.distributed initialised")
    world = dist.get_world_size()
    if replicate_size < 1 or world % replicate_size:
        raise ParallelConfigError(
            f"replicate_size={replicate_size} must be >= 1 and divide the world size {world}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    device_type = device_type or _device_type()
    if replicate_size == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
    return init_device_mesh(
        device_type, (replicate_size, world // replicate_size), mesh_dim_names=("replicate", "fsdp")
    )


def _expert_mesh(expert_parallel_size: int, device_type: str) -> DeviceMesh:
    world = dist.get_world_size()
    if expert_parallel_size < 1 or world % expert_parallel_size:
        raise ParallelConfigError(
            f"expert_parallel_size={expert_parallel_size} must be >= 1 and divide the world "
            f"size {world}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    # Rank order tp-cp-ep-dp: expert-parallel ranks are consecutive, so ranks holding the same
    # experts are strided by ep; they form the "expert_fsdp" column of this mesh.
    mesh = init_device_mesh(
        device_type,
        (world // expert_parallel_size, expert_parallel_size),
        mesh_dim_names=("expert_fsdp", "ep"),
    )
    return mesh["expert_fsdp"]


def _default_shard_units(module: nn.Module) -> list[nn.Module]:
    # Each element of a ModuleList (the transformer layers) is its own FSDP unit, so only one
    # layer's full parameters exist at a time.
    return [child for sub in module.modules() if isinstance(sub, nn.ModuleList) for child in sub]


def fully_shard_model(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    *,
    replicate_size: int = 1,
    shard_units: Callable[[nn.Module], list[nn.Module]] | None = None,
    expert_modules: Callable[[nn.Module], list[nn.Module]] | None = None,
    expert_parallel_size: int = 1,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shards ``module`` in place with FSDP2 and returns it.

    Mixed precision by default for low-precision models: when ``param_dtype`` is None and the
    module's floating parameters are bf16 (or fp16), they are upcast to fp32 before sharding,
    so the sharded parameters (what the optimizer updates) are fp32 main parameters, forward
    and backward compute in the original dtype, and gradients are reduced and kept in fp32.
    Memory per parameter with ``N`` ranks: ``4 / N`` (fp32 shard) ``+ 4 / N`` (fp32 gradient
    shard) ``+ 8 / N`` (AdamW moments), plus the transient full bf16 parameters and gradients of
    the unit being computed. Pass ``param_dtype`` explicitly to choose otherwise.

    Expert modules are sharded first over the expert-data-parallel submesh, then the other
    units (by default each element of every ``nn.ModuleList``), then the root. Gradients of
    expert parameters are divided by the full data-parallel size (not the expert-DP size),
    because each expert already summed the contributions of all its expert-parallel peers'
    tokens.

    Args:
        module: The model, its parameters on this rank's device.
        device_mesh: The mesh to shard over; None builds one with :func:`build_fsdp_mesh`.
        replicate_size: With ``device_mesh=None``, replicas of an HSDP mesh (1 is plain FSDP).
        shard_units: Returns the submodules to wrap as separate FSDP units; None wraps the
            elements of every ``nn.ModuleList``.
        expert_modules: Returns the expert submodules (whose parameters differ across the
            expert-parallel ranks); needs ``expert_parallel_size > 1``.
        expert_parallel_size: Number of expert-parallel ranks (consecutive in rank order).
        reshard_after_forward: Free the gathered parameters after forward (re-gather in
            backward).
        param_dtype: Compute dtype of gathered parameters (mixed precision); None keeps theirs,
            except for bf16/fp16 models (see above).
        reduce_dtype: dtype of the gradient reduce-scatter; None uses ``param_dtype`` (fp32 for
            the default mixed precision of bf16/fp16 models).

    Returns:
        The same module, now FSDP-managed (its parameters are DTensors).

    Raises:
        ParallelTypeError: If ``module`` is not an ``nn.Module``.
        ParallelConfigError: If the sizes do not divide the world, experts are given without
            expert parallelism or expert parallelism without experts, or ``replicate_size`` is
            given together with a ``device_mesh``.
        ParallelStateError: If torch.distributed is not initialised.
    """
    if not isinstance(module, nn.Module):
        raise ParallelTypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not dist.is_initialized():
        raise ParallelStateError("fully_shard_model() needs torch.distributed initialised")
    if expert_modules is not None and expert_parallel_size == 1:
        raise ParallelConfigError(
            "expert_modules given with expert_parallel_size=1; experts then shard like any "
            "other module, pass them through shard_units instead"
        )
    if expert_modules is None and expert_parallel_size != 1:
        raise ParallelConfigError(
            f"expert_parallel_size={expert_parallel_size} needs expert_modules (the expert "
            "submodules to shard over the expert-data-parallel submesh)"
        )
    if device_mesh is not None and replicate_size != 1:
        raise ParallelConfigError(
            f"replicate_size={replicate_size} only applies when device_mesh is None; the given "
            "device_mesh already fixes the layout"
        )
    mesh = (
        device_mesh if device_mesh is not None else build_fsdp_mesh(replicate_size=replicate_size)
    )
    if param_dtype is None:
        param_dtype, reduce_dtype = _upcast_low_precision(module, reduce_dtype)
    fully_shard, mixed_precision_policy = _fsdp_api()
    policy = mixed_precision_policy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    options: dict[str, Any] = {"reshard_after_forward": reshard_after_forward, "mp_policy": policy}
    if expert_parallel_size > 1:
        expert_mesh = _expert_mesh(expert_parallel_size, mesh.device_type)
        for expert in (expert_modules or (lambda _: []))(module):
            fully_shard(expert, mesh=expert_mesh, **options)
            # Without this call FSDP2 divides by the expert mesh size, which would overweight
            # expert gradients by ep; refuse rather than train wrong on a torch lacking it.
            set_divide_factor = getattr(expert, "set_gradient_divide_factor", None)
            if set_divide_factor is None:
                raise ParallelConfigError(
                    f"expert_parallel_size={expert_parallel_size} needs "
                    "FSDPModule.set_gradient_divide_factor, missing in torch "
                    f"{torch.__version__}"
                )
            set_divide_factor(float(mesh.size()))
            force_sum = getattr(expert, "set_force_sum_reduction_for_comms", None)
            if dist.get_backend() != "nccl" and force_sum is not None:
                # A custom divide factor makes FSDP2 reduce with PREMUL_SUM, which gloo lacks;
                # SUM then divide gives the same gradients.
                force_sum(True)
    for unit in (shard_units or _default_shard_units)(module):
        fully_shard(unit, mesh=mesh, **options)
    fully_shard(module, mesh=mesh, **options)
    return module


def _upcast_low_precision(
    module: nn.Module, reduce_dtype: torch.dtype | None
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """Upcasts an all-bf16/fp16 module's parameters to fp32; returns the policy's dtypes."""
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(dtypes) != 1 or not dtypes <= {torch.bfloat16, torch.float16}:
        return None, reduce_dtype
    low = dtypes.pop()
    with torch.no_grad():
        for param in module.parameters():
            param.data = param.data.float()
    return low, torch.float32 if reduce_dtype is None else reduce_dtype


def is_fsdp_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is a sharded parameter created by ``fully_shard``.

    Args:
        param: A parameter.

    Returns:
        True for a DTensor parameter.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch < 2.5 layout
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
    return isinstance(param, DTensor)


def fully_shard_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module | None = None
) -> torch.optim.Optimizer:
    """Checks that ``optimizer`` updates the sharded parameters of a fully-sharded model.

    ``fully_shard`` replaces every parameter by a sharded DTensor parameter, so an optimizer
    built before sharding silently updates stale tensors; this catches it. The optimizer state
    then holds only this rank's shards (torch optimizers allocate state like the parameter).
    The optimizer is a plain torch optimizer, so its whole surface stays: ``param_groups``
    (build them with
    :func:`~mcore_parallel.distributed.param_groups.weight_decay_param_groups` for the no-decay
    rule), ``state_dict``/``load_state_dict``, ``zero_grad`` and ``torch.optim.lr_scheduler``.

    Args:
        optimizer: A torch optimizer built from ``model.parameters()`` after sharding.
        model: The sharded model; when given, the optimizer must cover all its trainable
            parameters.

    Returns:
        The optimizer, unchanged.

    Raises:
        ParallelTypeError: If ``optimizer`` is not a torch optimizer.
        ParallelConfigError: If a parameter is not sharded or the optimizer misses some of the
            model's trainable parameters.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ParallelTypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unsharded = [i for i, p in enumerate(params) if not is_fsdp_param(p)]
    if unsharded:
        raise ParallelConfigError(
            f"optimizer parameters {unsharded[:8]} are not FSDP-sharded; build the optimizer "
            "after fully_shard_model() so that it updates the sharded parameters"
        )
    if model is not None:
        ids = {id(p) for p in params}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in ids]
        if missing:
            raise ParallelConfigError(
                f"optimizer misses trainable parameters {missing[:8]} of the model"
            )
    return optimizer
