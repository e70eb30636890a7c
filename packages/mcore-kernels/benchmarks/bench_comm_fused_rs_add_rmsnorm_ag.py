"""Benchmark ``fused_rs_add_rmsnorm_ag`` against the unfused NCCL sequences, under CUDA graphs.

Run with one process per GPU, NVLink multicast off::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node=2 \\
        packages/mcore-kernels/benchmarks/bench_comm_fused_rs_add_rmsnorm_ag.py --out results/

Each variant is captured as a CUDA graph of ``--calls`` back-to-back calls and replayed; the
time per call is the median over replays of the slowest rank's replay time divided by the
number of calls. Peers in the same run:

- ``nccl_rs_ag``: NCCL reduce_scatter, residual add + RMSNorm (mcore_kernels.rms_norm),
  NCCL all_gather (the sequence the fused op replaces, and its fallback);
- ``nccl_allreduce``: NCCL all_reduce, then residual add + RMSNorm on every rank (what a
  tensor-parallel layer without sequence parallelism does);
- ``symm_one_shot``, ``symm_two_shot``: the fused kernels with a forced strategy;
- ``fused``: the public function (strategy chosen by token count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

TOKENS = (1, 8, 32, 128, 512)
HIDDEN = (4096, 8192)
EPS = 1e-6


def _time_graph(fn: Callable[[], object], calls: int, replays: int) -> float:
    """Median microseconds per call of ``fn`` captured ``calls`` times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        elapsed = torch.tensor([start.elapsed_time(end) * 1000.0 / calls], device="cuda")
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(float(elapsed))
    del graph
    return statistics.median(samples)


def _agreement_text(agreement: dict[str, object]) -> str:
    if agreement["bitwise_equal_to_nccl"]:
        return "bitwise equal"
    return (
        f"max diff {agreement['normed_max_abs_diff_vs_nccl']:.3g} (normed), "
        f"{agreement['residual_max_abs_diff_vs_nccl']:.3g} (residual)"
    )


def main() -> None:
    """Parse arguments, measure every variant and shape, write JSON and Markdown on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    parser.add_argument("--calls", type=int, default=20, help="calls captured per graph")
    parser.add_argument("--replays", type=int, default=20, help="timed replays per variant")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    from mcore_kernels import rms_norm
    from mcore_kernels.comm import fused_rs_add_rmsnorm_ag, rs_add_rmsnorm_ag_collectives
    from mcore_kernels.comm.symmetric import get_workspace, symmetric_rs_add_rmsnorm_ag

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for hidden in HIDDEN:
        for tokens in TOKENS:
            generator = torch.Generator(device="cuda").manual_seed(rank)
            partial = torch.randn(tokens, hidden, device="cuda", generator=generator).bfloat16()
            # The residual stream and the weight are the same on every rank, as in a model.
            shared = torch.Generator(device="cuda").manual_seed(1234)
            residual = torch.randn(tokens, hidden, device="cuda", generator=shared).bfloat16()
            weight = (torch.rand(hidden, device="cuda", generator=shared) + 0.5).bfloat16()
            workspace = get_workspace(None, partial)
            assert not isinstance(workspace, str), workspace
            reduced = torch.empty_like(partial)

            def allreduce_then_norm(
                partial: torch.Tensor = partial,
                residual: torch.Tensor = residual,
                weight: torch.Tensor = weight,
                reduced: torch.Tensor = reduced,
            ) -> object:
                reduced.copy_(partial)
                dist.all_reduce(reduced)
                return rms_norm(reduced, weight, EPS, residual=residual)

            variants: dict[str, Callable[[], object]] = {
                "nccl_rs_ag": lambda p=partial, r=residual, w=weight: rs_add_rmsnorm_ag_collectives(
                    p, r, w, EPS, None
                ),
                "nccl_allreduce": allreduce_then_norm,
                "symm_one_shot": lambda p=partial, r=residual, w=weight, ws=workspace: (
                    symmetric_rs_add_rmsnorm_ag(p, r, w, EPS, ws, strategy="one_shot")
                ),
                "symm_two_shot": lambda p=partial, r=residual, w=weight, ws=workspace: (
                    symmetric_rs_add_rmsnorm_ag(p, r, w, EPS, ws, strategy="two_shot")
                ),
                "fused": lambda p=partial, r=residual, w=weight: fused_rs_add_rmsnorm_ag(
                    p, r, w, EPS, None
                ),
            }
            fused_out = fused_rs_add_rmsnorm_ag(partial, residual, weight, EPS, None)
            nccl_out = rs_add_rmsnorm_ag_collectives(partial, residual, weight, EPS, None)
            agreement = {
                "normed_max_abs_diff_vs_nccl": float(
                    (fused_out[0].float() - nccl_out[0].float()).abs().max()
                ),
                "residual_max_abs_diff_vs_nccl": float(
                    (fused_out[1].float() - nccl_out[1].float()).abs().max()
                ),
                "bitwise_equal_to_nccl": bool(
                    torch.equal(fused_out[0], nccl_out[0])
                    and torch.equal(fused_out[1], nccl_out[1])
                ),
            }
            times = {
                name: _time_graph(fn, args.calls, args.replays) for name, fn in variants.items()
            }
            row = {
                "tokens": tokens,
                "hidden": hidden,
                "us": times,
                "agreement": agreement,
                "speedup_vs_nccl_rs_ag": times["nccl_rs_ag"] / times["fused"],
                "speedup_vs_nccl_allreduce": times["nccl_allreduce"] / times["fused"],
            }
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        device = torch.cuda.get_device_name()
        report = {
            "device": device,
            "world_size": world,
            "dtype": "bfloat16",
            "torch": torch.__version__,
            "method": f"CUDA graph of {args.calls} calls, median of {args.replays} replays, "
            "slowest rank",
            "rows": rows,
        }
        stem = f"comm_fused_rs_add_rmsnorm_ag_tp{world}"
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2))
        lines = [
            f"{device} x{world}, bf16, {report['method']}; times in microseconds per call.",
            "",
            "| hidden | tokens | nccl rs+norm+ag | nccl allreduce+norm | one-shot | two-shot "
            "| fused (auto) | vs rs+ag | vs allreduce | output vs NCCL |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row in rows:
            t = row["us"]
            lines.append(
                f"| {row['hidden']} | {row['tokens']} | {t['nccl_rs_ag']:.1f} | "
                f"{t['nccl_allreduce']:.1f} | {t['symm_one_shot']:.1f} | "
                f"{t['symm_two_shot']:.1f} | {t['fused']:.1f} | "
                f"{row['speedup_vs_nccl_rs_ag']:.2f}x | {row['speedup_vs_nccl_allreduce']:.2f}x | "
                f"{_agreement_text(row['agreement'])} |"
            )
        (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
