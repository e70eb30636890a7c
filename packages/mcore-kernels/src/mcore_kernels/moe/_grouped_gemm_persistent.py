"""Persistent Triton grouped GEMMs for Hopper (launchers in :mod:`mcore_kernels.moe.grouped_mm`).

Rows ``ends[e - 1]:ends[e]`` of the row matrix belong to expert ``e`` (from row 0 for the
first). Three kernels:

- :func:`tile_schedule_kernel` lists every row tile of every expert (expert, first row, end
  row) and the number of tiles, on the device: the group sizes never reach the host.
- :func:`m_grouped_kernel`: ``C[rows of e] = A[rows of e] @ B[e]`` (the forward and the
  input-gradient GEMMs). A fixed grid of programs (one per multiprocessor) walks the
  ``(row tile, column tile)`` jobs of the schedule; operand tiles arrive through TMA tensor
  descriptors, so ``tl.dot`` lowers to wgmma with both operands in shared memory. A row tile
  may read rows of the next expert (a TMA load cannot stop at a group end): those rows are
  never stored.
- :func:`k_grouped_kernel`: ``OUT[e] = G[rows of e].T @ X[rows of e]`` (the weight gradients,
  zero for an expert without rows), persistent over the ``(expert, output tile)`` jobs and
  reducing over the rows of the expert; both operands of the last, partial row chunk are
  masked, so that the next rows (another expert's, or rows no expert owns, which may hold
  anything) add nothing.

Every output element is written by one program, without atomics: results are bitwise
reproducible run to run.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "k_grouped_kernel",
    "m_grouped_kernel",
    "tile_schedule_kernel",
]


@triton.jit
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


@triton.jit
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


@triton.jit
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


@triton.jit
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


@triton.jit
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
