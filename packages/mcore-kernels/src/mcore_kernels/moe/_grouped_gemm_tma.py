"""Triton grouped GEMMs whose operand tiles arrive through TMA tensor descriptors (Hopper+).

Same row-group convention as :mod:`mcore_kernels.moe._grouped_gemm_triton` (rows
``starts[e]:ends[e]`` belong to expert ``e``), but the A and B tiles are loaded by the bulk
tensor copy engine from host-built descriptors instead of pointer arithmetic, and a
persistent grid walks the tiles. A row tile may read rows of the next expert (TMA loads
cannot stop at a group end); those rows are never stored (row-tile kernel) or are zeroed
before the product (weight-gradient kernel), so every output element is still written by one
program with the rows of its own expert, without atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["tma_rows_kernel", "tma_weight_grad_kernel"]


@triton.jit
def _tile_of(starts_ptr, ends_ptr, tile, num_experts, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    ids = tl.arange(0, E_PAD)
    valid = ids < num_experts
    ends = tl.load(ends_ptr + ids, mask=valid, other=0).to(tl.int32)
    starts = tl.load(starts_ptr + ids, mask=valid, other=0).to(tl.int32)
    tiles = tl.where(valid, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, axis=0)
    expert = tl.sum((cum <= tile).to(tl.int32), axis=0)
    hit = ids == expert
    first_tile = tl.sum(tl.where(hit, cum - tiles, 0), axis=0)
    start = tl.sum(tl.where(hit, starts, 0), axis=0)
    end = tl.sum(tl.where(hit, ends, 0), axis=0)
    total = tl.sum(tiles, axis=0)
    return expert, start + (tile - first_tile) * BLOCK_M, end, total


@triton.jit
def tma_rows_kernel(
    a_desc,
    b_desc,
    c_ptr,
    aux_ptr,
    w_ptr,
    dw_ptr,
    starts_ptr,
    ends_ptr,
    num_experts,
    max_tiles,
    N,
    K,
    stride_cm,
    B_KMAJOR: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_PAD: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """``C[rows of e] = A[rows of e] @ B[e]``; ``B_KMAJOR``: ``b_desc`` views ``[E * N', K]``
    (``nn.Linear`` layout), else ``[E * K, N]``. Persistent: program ``p`` takes tiles ``p,
    p + NUM_PROGRAMS, ...`` of the ``max_tiles * cdiv(N, BLOCK_N)`` upper bound.

    ``EPILOGUE``:

    - 0: store ``C``.
    - 1 (SwiGLU forward; ``B_KMAJOR``, ``B[e]`` has ``2 N`` rows, gate then up): store the
      gate/up product into ``aux`` (``[M, 2N]``) and ``(w *) silu(gate) * up`` into ``C``.
    - 2 (SwiGLU backward): the product is the gradient of the (weighted) activation; read the
      gate/up product from ``aux``, store its gradient into ``C`` (``[M, 2N]``) and, with
      ``HAS_W``, this column tile's share of each row weight's gradient into
      ``dw[row, pid_n]``.
    """
    num_n = tl.cdiv(N, BLOCK_N)
    dtype = c_ptr.dtype.element_ty
    for job in range(tl.program_id(0), max_tiles * num_n, NUM_PROGRAMS):
        tile = job // num_n
        pid_n = job % num_n
        expert, row_start, row_end, total = _tile_of(
            starts_ptr, ends_ptr, tile, num_experts, BLOCK_M, E_PAD
        )
        if tile < total:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if EPILOGUE == 1:
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([row_start, k0])
                if EPILOGUE == 1:
                    b = b_desc.load([expert * 2 * N + pid_n * BLOCK_N, k0])
                    acc = tl.dot(a, b.T, acc)
                    b_up = b_desc.load([expert * 2 * N + N + pid_n * BLOCK_N, k0])
                    acc_up = tl.dot(a, b_up.T, acc_up)
                elif B_KMAJOR:
                    b = b_desc.load([expert * N + pid_n * BLOCK_N, k0])
                    acc = tl.dot(a, b.T, acc)
                else:
                    b = b_desc.load([expert * K + k0, pid_n * BLOCK_N])
                    acc = tl.dot(a, b, acc)
            rows = row_start + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < row_end
            mask = row_ok[:, None] & (cols < N)[None, :]
            out_rows = rows.to(tl.int64)[:, None]
            if EPILOGUE == 0:
                tl.store(c_ptr + out_rows * stride_cm + cols[None, :], acc.to(dtype), mask=mask)
            elif EPILOGUE == 1:
                gate = acc.to(dtype)
                up = acc_up.to(dtype)
                aux = aux_ptr + out_rows * (2 * N) + cols[None, :]
                tl.store(aux, gate, mask=mask)
                tl.store(aux + N, up, mask=mask)
                g = gate.to(tl.float32)
                act = g / (1.0 + tl.exp(-g)) * up.to(tl.float32)
                if HAS_W:
                    weight = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
                    act = act * weight[:, None]
                tl.store(c_ptr + out_rows * stride_cm + cols[None, :], act.to(dtype), mask=mask)
            else:
                aux = aux_ptr + out_rows * (2 * N) + cols[None, :]
                g = tl.load(aux, mask=mask, other=0.0).to(tl.float32)
                u = tl.load(aux + N, mask=mask, other=0.0).to(tl.float32)
                d = acc.to(dtype).to(tl.float32)
                sig = 1.0 / (1.0 + tl.exp(-g))
                silu = g * sig
                if HAS_W:
                    weight = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
                    part = tl.sum(d * silu * u, axis=1)
                    tl.store(dw_ptr + rows.to(tl.int64) * num_n + pid_n, part, mask=row_ok)
                    d = d * weight[:, None]
                d_gate = d * u * sig * (1.0 + g * (1.0 - sig))
                out = c_ptr + out_rows * (2 * N) + cols[None, :]
                tl.store(out, d_gate.to(dtype), mask=mask)
                tl.store(out + N, (d * silu).to(dtype), mask=mask)


@triton.jit
def tma_weight_grad_kernel(
    g_desc,
    x_desc,
    out_ptr,
    starts_ptr,
    ends_ptr,
    num_experts,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """``out[e] = G[rows of e].T @ X[rows of e]`` (``[N, K]`` per expert, zero without rows);
    persistent over the ``E * cdiv(N, BLOCK_N) * cdiv(K, BLOCK_K)`` output tiles."""
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    per_expert = num_n * num_k
    dtype = out_ptr.dtype.element_ty
    base = tl.arange(0, BLOCK_M)
    for job in range(tl.program_id(0), num_experts * per_expert, NUM_PROGRAMS):
        expert = job // per_expert
        rest = job % per_expert
        pid_n = rest // num_k
        pid_k = rest % num_k
        start = tl.load(starts_ptr + expert).to(tl.int32)
        end = tl.load(ends_ptr + expert).to(tl.int32)
        full_end = start + ((end - start) // BLOCK_M) * BLOCK_M
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for m0 in range(start, full_end, BLOCK_M):
            g = g_desc.load([m0, pid_n * BLOCK_N])
            x = x_desc.load([m0, pid_k * BLOCK_K])
            acc = tl.dot(g.T, x, acc)
        if full_end < end:
            g = g_desc.load([full_end, pid_n * BLOCK_N])
            x = x_desc.load([full_end, pid_k * BLOCK_K])
            x = tl.where((full_end + base < end)[:, None], x, tl.zeros_like(x))
            acc = tl.dot(g.T, x, acc)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        out = out_ptr + expert.to(tl.int64) * N * K + ns[:, None] * K + ks[None, :]
        tl.store(out, acc.to(dtype), mask=(ns < N)[:, None] & (ks < K)[None, :])


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """Programs of a persistent grid: the GPU's multiprocessors (4 for the interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def tma_rows(
    a: torch.Tensor,
    weight: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    kmajor: bool,
    bm: int,
    bn: int,
    bk: int,
    warps: int,
    stages: int,
    epilogue: int = 0,
    aux: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out[rows of e] = a[rows of e] @ (weight[e].T if kmajor else weight[e])`` with the
    epilogues of :func:`tma_rows_kernel`.

    Returns ``(out, second)``: ``second`` is the gate/up product (epilogue 1), the ``[M,
    cdiv(N, bn)]`` float32 row-weight gradient partials (epilogue 2 with weights) or None.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    experts = weight.shape[0]
    if kmajor:
        n, k = weight.shape[1], weight.shape[2]
        b_desc = TensorDescriptor.from_tensor(weight.reshape(experts * n, k), [bn, bk])
        if epilogue == 1:
            n //= 2
    else:
        k, n = weight.shape[1], weight.shape[2]
        b_desc = TensorDescriptor.from_tensor(weight.reshape(experts * k, n), [bk, bn])
    rows = a.shape[0]
    num_n = triton.cdiv(n, bn)
    second = None
    if epilogue == 2:
        out = a.new_empty(rows, 2 * n)
        if row_weights is not None:
            second = torch.empty(rows, num_n, dtype=torch.float32, device=a.device)
    else:
        out = a.new_empty(rows, n)
        if epilogue == 1:
            second = a.new_empty(rows, 2 * n)
    if rows == 0 or n == 0:
        return out, second
    if k == 0:
        raise ValueError("the TMA grouped GEMM needs a reduction dimension > 0")
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    max_tiles = triton.cdiv(rows, bm) + experts
    programs = min(_num_sms(a.device), max_tiles * num_n)
    aux_arg = second if epilogue == 1 else aux
    tma_rows_kernel[(programs,)](
        a_desc,
        b_desc,
        out,
        aux_arg if aux_arg is not None else out,
        row_weights if row_weights is not None else out,
        second if (epilogue == 2 and second is not None) else out,
        starts,
        ends,
        experts,
        max_tiles,
        n,
        k,
        out.stride(0),
        B_KMAJOR=kmajor,
        EPILOGUE=epilogue,
        HAS_W=row_weights is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        E_PAD=max(256, triton.next_power_of_2(experts)),
        NUM_PROGRAMS=programs,
        num_warps=warps,
        num_stages=stages,
    )
    return out, second


def tma_weight_grad(
    g: torch.Tensor,
    x: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    bm: int,
    bn: int,
    bk: int,
    warps: int,
    stages: int,
) -> torch.Tensor:
    """``out[e] = g[rows of e].T @ x[rows of e]`` as ``[E, N, K]``: ``bm`` x ``bn`` output
    tiles, ``bk`` rows per reduction step (zero for an expert without rows)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    experts = starts.shape[0]
    n, k = g.shape[1], x.shape[1]
    if g.shape[0] == 0:
        return g.new_zeros(experts, n, k)
    out = g.new_empty(experts, n, k)
    if out.numel() == 0:
        return out
    g_desc = TensorDescriptor.from_tensor(g, [bk, bm])
    x_desc = TensorDescriptor.from_tensor(x, [bk, bn])
    jobs = experts * triton.cdiv(n, bm) * triton.cdiv(k, bn)
    programs = min(_num_sms(g.device), jobs)
    tma_weight_grad_kernel[(programs,)](
        g_desc,
        x_desc,
        out,
        starts,
        ends,
        experts,
        n,
        k,
        BLOCK_M=bk,
        BLOCK_N=bm,
        BLOCK_K=bn,
        NUM_PROGRAMS=programs,
        num_warps=warps,
        num_stages=stages,
    )
    return out
