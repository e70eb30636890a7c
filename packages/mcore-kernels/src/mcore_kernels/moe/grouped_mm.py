"""Persistent Triton grouped GEMMs (Hopper, TMA) with ``torch._grouped_mm``'s grouping.

Two products cover the six GEMMs of a SwiGLU expert MLP's forward + backward, the experts'
rows sorted by expert and ``offsets[e]`` the end row of expert ``e`` (int32, on the device):

- :func:`m_grouped_mm`: ``out[rows of e] = a[rows of e] @ w[e]`` (or ``@ w[e].T``): the
  forward and input-gradient GEMMs;
- :func:`k_grouped_mm`: ``out[e] = g[rows of e].T @ x[rows of e]``: the weight gradients.

The row-tile schedule is built on the device (:func:`tile_schedule`), so no group size
reaches the host. Kernels in :mod:`mcore_kernels.moe._grouped_gemm_persistent`.
:func:`m_grouped_mm_reference` and :func:`k_grouped_mm_reference` are the torch references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.moe._launch import cdiv, launch, next_power_of_2

__all__ = [
    "PersistentTiles",
    "k_grouped_mm",
    "k_grouped_mm_reference",
    "m_grouped_mm",
    "m_grouped_mm_reference",
    "tile_schedule",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class PersistentTiles:
    """Tile shape and launch options of one persistent grouped GEMM."""

    block_m: int = 128
    """Rows per tile (the reduction chunk of :func:`k_grouped_mm`)."""
    block_n: int = 128
    """Output columns per tile (output rows of :func:`k_grouped_mm`)."""
    block_k: int = 64
    """Reduction step (output columns of :func:`k_grouped_mm`)."""
    num_warps: int = 8
    """Warps per program."""
    num_stages: int = 4
    """Software-pipelining depth of the operand loads."""
    flatten: bool = False
    """Flatten the job and reduction loops into one pipelined loop (:func:`m_grouped_mm`)."""
    expert_columns: bool = False
    """Take each expert's row-grouped jobs column tile by column tile, its row tiles
    consecutive (:func:`m_grouped_mm`): the programs that read one column strip of the
    expert's weights run side by side, so the strip streams from memory once for all of them."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise KernelShapeError(f"{name}={value} must be a power of two >= 16")
        if self.num_warps not in (4, 8):
            raise KernelValueError(f"num_warps={self.num_warps} must be 4 or 8")
        if self.num_stages < 1:
            raise KernelValueError(f"num_stages={self.num_stages} must be >= 1")


_NUM_SMS: dict[int, int] = {}


def _programs(device: torch.device, tiles: PersistentTiles, jobs: int) -> int:
    """Programs of a persistent grid: one per multiprocessor (4 off the GPU)."""
    if device.type != "cuda":
        sms = 4
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _NUM_SMS:
            _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
        sms = _NUM_SMS[index]
    return max(1, min(sms, jobs))


def tile_schedule(offsets: torch.Tensor, num_rows: int, block_m: int) -> torch.Tensor:
    """Row tiles of every expert, built on the device.

    Args:
        offsets: ``[E]`` int32 end row of each expert (cumulative counts).
        num_rows: Rows of the row matrix (``offsets[-1]`` at most).
        block_m: Rows per tile.

    Returns:
        int32 ``[3 * T + 1]`` with ``T = cdiv(num_rows, block_m) + E`` (an upper bound of the
        tile count): the expert, first row and end row of each tile, then the tile count.
    """
    from mcore_kernels.moe._grouped_gemm_persistent import tile_schedule_kernel

    experts = offsets.shape[0]
    max_tiles = cdiv(num_rows, block_m) + experts
    sched = torch.empty(3 * max_tiles + 1, dtype=torch.int32, device=offsets.device)
    block_t = 64
    launch(
        tile_schedule_kernel,
        (cdiv(max_tiles, block_t),),
        (offsets, sched, experts, max_tiles),
        dict(BLOCK_M=block_m, E_PAD=max(16, next_power_of_2(experts)), BLOCK_T=block_t),
        device=offsets.device,
    )
    return sched


def _check(name: str, tensor: torch.Tensor, dim: int) -> None:
    if tensor.dim() != dim:
        raise KernelShapeError(f"{name}.shape={tuple(tensor.shape)} must have {dim} dimensions")
    if tensor.dtype not in (torch.bfloat16, torch.float16):
        raise KernelDtypeError(f"{name}.dtype={tensor.dtype} must be bfloat16 or float16")


def _tma_ready(tensor: torch.Tensor) -> torch.Tensor:
    """A 2-D view whose last dimension is contiguous and whose row stride is 16-byte aligned."""
    if tensor.stride(-1) != 1 or (tensor.stride(0) * tensor.element_size()) % 16:
        tensor = tensor.contiguous()
    return tensor


def m_grouped_mm(
    a: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    *,
    transpose_weight: bool,
    tiles: PersistentTiles,
    schedule: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-grouped GEMM: ``out[rows of e] = a[rows of e] @ (w[e].T if transpose_weight else
    w[e])``.

    Args:
        a: ``[M, K]`` rows sorted by expert.
        weight: ``[E, N, K]`` with ``transpose_weight`` (``nn.Linear`` layout), else
            ``[E, K, N]``.
        offsets: ``[E]`` int32 end row of each expert.
        transpose_weight: Whether ``weight`` holds ``w[e].T``.
        tiles: Tile shape.
        schedule: :func:`tile_schedule` of ``offsets`` with ``tiles.block_m`` (built when None).

    Returns:
        ``[M, N]`` (rows past ``offsets[-1]`` unwritten).

    Raises:
        KernelShapeError: If the shapes do not match, N is not a multiple of 16 or K of 8
            (and of ``tiles.block_k`` without ``transpose_weight``).
        KernelDtypeError: If a dtype is not 16-bit or the dtypes differ.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mcore_kernels.moe._grouped_gemm_persistent import m_grouped_kernel

    _check("a", a, 2)
    _check("weight", weight, 3)
    if a.dtype != weight.dtype:
        raise KernelDtypeError(f"a.dtype={a.dtype} and weight.dtype={weight.dtype} must match")
    experts = weight.shape[0]
    n, k = (weight.shape[1], weight.shape[2]) if transpose_weight else weight.shape[1:][::-1]
    if a.shape[1] != k or offsets.shape != (experts,) or k % 8 or n % 16:
        raise KernelShapeError(
            f"a.shape={tuple(a.shape)}, weight.shape={tuple(weight.shape)} "
            f"(transpose_weight={transpose_weight}), offsets.shape={tuple(offsets.shape)}: "
            "expected [M, K], [E, N, K] or [E, K, N], [E], with N a multiple of 16 and K of 8"
        )
    if not transpose_weight and k % tiles.block_k:
        raise KernelShapeError(f"K={k} must be a multiple of block_k={tiles.block_k}")
    rows = a.shape[0]
    out = a.new_empty(rows, n)
    if rows == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    a = _tma_ready(a)
    weight = weight.contiguous()
    if schedule is None:
        schedule = tile_schedule(offsets, rows, tiles.block_m)
    max_tiles = (schedule.shape[0] - 1) // 3
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    if transpose_weight:
        b_desc = TensorDescriptor.from_tensor(weight.view(experts * n, k), [bn, bk])
    else:
        b_desc = TensorDescriptor.from_tensor(weight.view(experts * k, n), [bk, bn])
    programs = _programs(a.device, tiles, max_tiles * cdiv(n, bn))
    launch(
        m_grouped_kernel,
        (programs,),
        (a_desc, b_desc, out, schedule, max_tiles, n, k, out.stride(0), offsets),
        dict(
            B_NK=transpose_weight,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            NUM_PROGRAMS=programs,
            FLATTEN=tiles.flatten,
            EXPERT_COLUMNS=tiles.expert_columns,
        ),
        device=a.device,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def k_grouped_mm(
    g: torch.Tensor,
    x: torch.Tensor,
    offsets: torch.Tensor,
    *,
    tiles: PersistentTiles,
    aligned: bool = False,
) -> torch.Tensor:
    """Reduction-grouped GEMM: ``out[e] = g[rows of e].T @ x[rows of e]`` (weight gradients).

    Args:
        g: ``[M, N]`` rows sorted by expert.
        x: ``[M, K]``.
        offsets: ``[E]`` int32 end row of each expert.
        tiles: Tile shape (``block_m`` is the reduction chunk).
        aligned: The caller guarantees that every expert's row count is a multiple of
            ``tiles.block_m`` (equal capacity slots, or rows padded per expert; not checked,
            which would sync the host): the row chunks of all tiles then run as one pipelined
            loop without masks (the ``ALIGNED`` mode of the kernel). Needs N to be a multiple
            of ``tiles.block_n`` (else the masked loop runs).

    Returns:
        ``[E, N, K]``, zero for an expert without rows.

    Raises:
        KernelShapeError: If the shapes do not match or a dimension is not a multiple of 8.
        KernelDtypeError: If a dtype is not 16-bit or the dtypes differ.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mcore_kernels.moe._grouped_gemm_persistent import k_grouped_kernel

    _check("g", g, 2)
    _check("x", x, 2)
    if g.dtype != x.dtype:
        raise KernelDtypeError(f"g.dtype={g.dtype} and x.dtype={x.dtype} must match")
    experts = offsets.shape[0]
    (rows, n), k = g.shape, x.shape[1]
    if x.shape[0] != rows or offsets.dim() != 1 or n % 8 or k % 8:
        raise KernelShapeError(
            f"g.shape={tuple(g.shape)}, x.shape={tuple(x.shape)}, "
            f"offsets.shape={tuple(offsets.shape)}: expected [M, N], [M, K], [E] with N and K "
            "multiples of 8"
        )
    out = g.new_empty(experts, n, k)
    if experts == 0 or n == 0 or k == 0:
        return out
    if rows == 0:
        return out.zero_()
    g, x = _tma_ready(g), _tma_ready(x)
    br, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    g_desc = TensorDescriptor.from_tensor(g, [br, bn])
    x_desc = TensorDescriptor.from_tensor(x, [br, bk])
    tma_store = n % bn == 0
    out_desc = TensorDescriptor.from_tensor(out.view(experts * n, k), [bn, bk])
    jobs = experts * cdiv(n, bn) * cdiv(k, bk)
    programs = _programs(g.device, tiles, jobs)
    launch(
        k_grouped_kernel,
        (programs,),
        (g_desc, x_desc, out_desc, out, offsets, experts, n, k),
        dict(
            BLOCK_R=br,
            BLOCK_N=bn,
            BLOCK_K=bk,
            NUM_PROGRAMS=programs,
            TMA_STORE=tma_store,
            ALIGNED=aligned and tma_store,
            JOB_BLOCK=1024,
        ),
        device=g.device,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def m_grouped_mm_reference(
    a: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, transpose_weight: bool
) -> torch.Tensor:
    """Torch reference of :func:`m_grouped_mm` (one expert at a time, float32 accumulation;
    syncs the host; rows past ``offsets[-1]`` are zero).

    Args:
        a: ``[M, K]``.
        weight: ``[E, N, K]`` or ``[E, K, N]``.
        offsets: ``[E]`` end row of each expert.
        transpose_weight: Whether ``weight`` holds ``w[e].T``.

    Returns:
        ``[M, N]`` in the dtype of ``a``.
    """
    n = weight.shape[1] if transpose_weight else weight.shape[2]
    out = torch.zeros(a.shape[0], n, dtype=a.dtype, device=a.device)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        w = weight[expert].float()
        w = w.t() if transpose_weight else w
        out[start:end] = (a[start:end].float() @ w).to(a.dtype)
        start = end
    return out


def k_grouped_mm_reference(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`k_grouped_mm` (float32 accumulation; syncs the host).

    Args:
        g: ``[M, N]``.
        x: ``[M, K]``.
        offsets: ``[E]`` end row of each expert.

    Returns:
        ``[E, N, K]`` in the dtype of ``g``.
    """
    out = []
    start = 0
    for end in offsets.tolist():
        out.append((g[start:end].float().t() @ x[start:end].float()).to(g.dtype))
        start = end
    return torch.stack(out)
