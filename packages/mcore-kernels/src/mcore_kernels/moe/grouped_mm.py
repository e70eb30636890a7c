"""Persistent Triton grouped GEMMs (Hopper, TMA) with ``torch._grouped_mm``'s grouping.

Two products cover the six GEMMs of a SwiGLU expert MLP's forward + backward, the experts'
rows sorted by expert and ``offsets[e]`` the end row of expert ``e`` (int32, on the device):

- :func:`m_grouped_mm`: ``out[rows of e] = a[rows of e] @ w[e]`` (or ``@ w[e].T``): the
  forward and input-gradient GEMMs;
- :func:`k_grouped_mm`: ``out[e] = g[rows of e].T @ x[rows of e]``: the weight gradients.

The row-tile schedule is built on the device (:func:`tile_schedule`), so no group size
reaches the host.
:func:`m_grouped_mm_reference` and :func:`k_grouped_mm_reference` are the torch references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_kernels._triton_utils import jit, tl
from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.moe._launch import cdiv, launch, next_power_of_2
from mcore_kernels.moe.reference import k_grouped_mm_reference, m_grouped_mm_reference

__all__ = [
    "PersistentTiles",
    "k_grouped_mm",
    "k_grouped_mm_reference",
    "m_grouped_mm",
    "m_grouped_mm_reference",
    "tile_schedule",
]


@jit
def tile_schedule_kernel(
    ends_ptr,
    sched_ptr,
    num_experts,
    max_tiles,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Row tile ``t`` of the schedule: ``sched[t] = expert``, ``sched[max_tiles + t] = first
    row``, ``sched[2 max_tiles + t] = end row`` (expert ``num_experts`` past the last tile);
    ``sched[3 max_tiles]`` = number of tiles."""
    ids = tl.arange(0, E_PAD)
    valid = ids < num_experts
    ends = tl.load(ends_ptr + ids, mask=valid, other=0).to(tl.int32)
    starts = tl.load(ends_ptr + ids - 1, mask=valid & (ids > 0), other=0).to(tl.int32)
    tiles = tl.where(valid, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, axis=0)
    first = cum - tiles
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(sched_ptr + 3 * max_tiles, tl.sum(tiles, axis=0))
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    # Expert of tile t: the number of experts whose tiles all end at or before t.
    expert = tl.sum((cum[None, :] <= t[:, None]).to(tl.int32), axis=1)
    hit = ids[None, :] == expert[:, None]
    tile_first = tl.sum(tl.where(hit, first[None, :], 0), axis=1)
    start = tl.sum(tl.where(hit, starts[None, :], 0), axis=1)
    end = tl.sum(tl.where(hit, ends[None, :], 0), axis=1)
    ok = t < max_tiles
    tl.store(sched_ptr + t, expert, mask=ok)
    tl.store(sched_ptr + max_tiles + t, start + (t - tile_first) * BLOCK_M, mask=ok)
    tl.store(sched_ptr + 2 * max_tiles + t, end, mask=ok)


@jit
def m_grouped_kernel(
    a_desc,
    b_desc,
    c_ptr,
    sched_ptr,
    max_tiles,
    N,
    K,
    stride_cm,
    ends_ptr,
    B_NK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    EXPERT_COLUMNS: tl.constexpr,
):
    """``C[rows of e] = A[rows of e] @ B[e]``.

    ``a_desc`` views ``A`` ``[M, K]``; ``b_desc`` views the weights as ``[E * N, K]`` with
    ``B_NK`` (``B[e]`` stored transposed, the ``nn.Linear`` layout) or ``[E * K, N]``.
    Program ``p`` takes jobs ``p, p + NUM_PROGRAMS, ...`` of ``tiles * cdiv(N, BLOCK_N)``,
    the column tiles of one row tile consecutive (they share the row tile through L2).
    ``FLATTEN``: the job and reduction loops become one pipelined loop, so the next tile's
    first loads overlap the current tile's epilogue. ``EXPERT_COLUMNS``: the jobs of one
    expert are taken column tile by column tile, its row tiles consecutive, so that the
    programs that read one column strip of the expert's weights run side by side and the strip
    streams from memory once for all of them (``ends_ptr``: the experts' end rows).
    """
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = tl.load(sched_ptr + 3 * max_tiles) * num_n
    dtype = c_ptr.dtype.element_ty
    for job in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=FLATTEN):
        expert, row_start, row_end, n0 = _m_job(
            job, sched_ptr, ends_ptr, max_tiles, num_n, BLOCK_M, BLOCK_N, EXPERT_COLUMNS
        )
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            k0 = kk * BLOCK_K
            a = a_desc.load([row_start, k0])
            if B_NK:
                b = b_desc.load([expert * N + n0, k0])
                acc = tl.dot(a, b.T, acc)
            else:
                b = b_desc.load([expert * K + k0, n0])
                acc = tl.dot(a, b, acc)
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = (rows < row_end)[:, None] & (cols < N)[None, :]
        ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(ptrs, acc.to(dtype), mask=mask)


@jit
def _m_job(
    job,
    sched_ptr,
    ends_ptr,
    max_tiles,
    num_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EXPERT_COLUMNS: tl.constexpr,
):
    """Expert, first row, end row (the expert's) and first column of row-grouped job ``job``."""
    tile = job // num_n
    pid_n = job % num_n
    expert = tl.load(sched_ptr + tile)
    row_start = tl.load(sched_ptr + max_tiles + tile)
    row_end = tl.load(sched_ptr + 2 * max_tiles + tile)
    if EXPERT_COLUMNS:
        # The expert's jobs are the block [first_tile * num_n, (first_tile + tiles) * num_n):
        # renumber the block column-major (row tiles of one column tile consecutive).
        e_start = tl.load(ends_ptr + tl.maximum(expert - 1, 0), mask=expert > 0, other=0)
        tiles = tl.cdiv(row_end - e_start, BLOCK_M)
        first_tile = tile - (row_start - e_start) // BLOCK_M
        local = job - first_tile * num_n
        pid_n = local // tiles
        row_start = e_start + (local % tiles) * BLOCK_M
    return expert, row_start, row_end, pid_n * BLOCK_N


@jit
def _weight_job(job, per_expert, num_k, ends_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Expert, first output row and column, and the expert's first and end row, of output
    tile ``job`` of a weight gradient (``per_expert`` tiles per expert, ``num_k`` per row)."""
    expert = job // per_expert
    rest = job % per_expert
    n0 = (rest // num_k) * BLOCK_N
    k0 = (rest % num_k) * BLOCK_K
    end = tl.load(ends_ptr + expert)
    start = tl.where(expert > 0, tl.load(ends_ptr + tl.maximum(expert - 1, 0)), 0)
    return expert, n0, k0, start, end


@jit
def k_grouped_kernel(
    g_desc,
    x_desc,
    out_desc,
    out_ptr,
    ends_ptr,
    num_experts,
    N,
    K,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    TMA_STORE: tl.constexpr,
    ALIGNED: tl.constexpr,
    JOB_BLOCK: tl.constexpr,
):
    """``OUT[e] = G[rows of e].T @ X[rows of e]``: ``[N, K]`` per expert (``G`` ``[M, N]``,
    ``X`` ``[M, K]``), zero for an expert without rows.

    Persistent over the ``E * cdiv(N, BLOCK_N) * cdiv(K, BLOCK_K)`` output tiles; each reduces
    over its expert's rows in chunks of ``BLOCK_R``. ``TMA_STORE``: the tile is stored through
    ``out_desc`` (``[E * N, K]``; needs ``N % BLOCK_N == 0``), else with masked stores.
    ``ALIGNED`` (with ``TMA_STORE``): every expert's row count is a multiple of ``BLOCK_R``,
    and the chunks run unmasked in one pipelined loop over all of the program's tiles.
    """
    num_k = tl.cdiv(K, BLOCK_K)
    per_expert = tl.cdiv(N, BLOCK_N) * num_k
    if ALIGNED:
        # Every expert's row count is a multiple of BLOCK_R (equal capacity slots, or rows
        # padded per expert): no chunk is partial, no operand is masked and both stay in shared
        # memory from TMA to wgmma. The row chunks of all of this program's tiles run as one
        # flat loop (each job's chunk count read on the device first), so the loads of a tile's
        # first chunks are in flight while the previous tile is still in its last tl.dot and
        # its store: the pipeline never drains between tiles. An expert without rows takes one
        # step and stores zeros.
        pid = tl.program_id(0)
        total_jobs = num_experts * per_expert
        my_jobs = tl.cdiv(total_jobs - pid, NUM_PROGRAMS)
        # Steps of this program: the chunks of each of its jobs (at least one per job).
        zero = pid * 0
        steps = zero
        for j0 in range(0, my_jobs, JOB_BLOCK):
            i = j0 + tl.arange(0, JOB_BLOCK)
            valid = i < my_jobs
            e = (pid + i * NUM_PROGRAMS) // per_expert
            e_end = tl.load(ends_ptr + e, mask=valid, other=0)
            e_start = tl.load(ends_ptr + e - 1, mask=valid & (e > 0), other=0)
            chunks = tl.maximum((e_end - e_start) // BLOCK_R, 1)
            steps += tl.sum(tl.where(valid, chunks, 0), axis=0)
        # Loop-carried scalars start as int32 tensors (their type must not change in the loop).
        job = pid - NUM_PROGRAMS
        chunk = zero - 1
        num_chunks = zero
        expert = zero
        start = zero
        end = zero
        n0 = zero
        k0 = zero
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for _ in range(0, steps):
            chunk = tl.where(chunk == num_chunks - 1, 0, chunk + 1)
            if chunk == 0:
                job += NUM_PROGRAMS
                expert, n0, k0, start, end = _weight_job(
                    job, per_expert, num_k, ends_ptr, BLOCK_N, BLOCK_K
                )
                num_chunks = tl.maximum((end - start) // BLOCK_R, 1)
            m0 = start + chunk * BLOCK_R
            g = g_desc.load([m0, n0])
            x = x_desc.load([m0, k0])
            acc = tl.dot(g.T, x, acc)
            if chunk == num_chunks - 1:
                acc = tl.where(end > start, acc, tl.zeros_like(acc))
                out_desc.store([expert * N + n0, k0], acc.to(g.dtype))
                acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        dtype = out_ptr.dtype.element_ty
        r = tl.arange(0, BLOCK_R)
        for job in tl.range(tl.program_id(0), num_experts * per_expert, NUM_PROGRAMS):
            expert, n0, k0, start, end = _weight_job(
                job, per_expert, num_k, ends_ptr, BLOCK_N, BLOCK_K
            )
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            full_end = start + ((end - start) // BLOCK_R) * BLOCK_R
            for m0 in range(start, full_end, BLOCK_R):
                g = g_desc.load([m0, n0])
                x = x_desc.load([m0, k0])
                acc = tl.dot(g.T, x, acc)
            if full_end < end:
                keep = (full_end + r < end)[:, None]
                g = g_desc.load([full_end, n0])
                x = x_desc.load([full_end, k0])
                g = tl.where(keep, g, tl.zeros_like(g))
                x = tl.where(keep, x, tl.zeros_like(x))
                acc = tl.dot(g.T, x, acc)
            if TMA_STORE:
                out_desc.store([expert * N + n0, k0], acc.to(dtype))
            else:
                ns = n0 + tl.arange(0, BLOCK_N)
                ks = k0 + tl.arange(0, BLOCK_K)
                ptrs = out_ptr + expert.to(tl.int64) * N * K + ns[:, None] * K + ks[None, :]
                tl.store(ptrs, acc.to(dtype), mask=(ns < N)[:, None] & (ks < K)[None, :])


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
