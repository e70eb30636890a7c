"""Sweep the launch parameters of the mcore-kernels Triton kernels on one GPU.

Times the raw kernels (no autograd) for a few block sizes, warp counts, pipelining depths and\nbackward grid sizes,
so that the defaults in ``_rms_norm_triton.py`` and ``_token_logprobs_triton.py`` can be chosen
from measurements. Writes ``launch_configs.json`` and ``launch_configs.md``.

Usage: ``python3 packages/mcore-kernels/benchmarks/tune_launch_configs.py --out DIR``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
from _common import bench_ms, device_info, markdown_table, write_results

from mcore_kernels import _rms_norm_triton as rms
from mcore_kernels import _token_logprobs_triton as lp

DEVICE = "cuda"


def sweep_rms_forward(rows: int, hidden: int) -> list[dict]:
    x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(hidden, device=DEVICE, dtype=torch.bfloat16)
    y, h = torch.empty_like(x), torch.empty_like(x)
    rstd = torch.empty(rows, device=DEVICE, dtype=torch.float32)
    out = []
    for block in sorted({min(triton.next_power_of_2(hidden), b) for b in (4096, 8192)}):
        for warps in (4, 8, 16, 32):
            ms = bench_ms(
                lambda block=block, warps=warps: rms._rms_norm_fwd_kernel[(rows,)](
                    x,
                    r,
                    w,
                    y,
                    h,
                    rstd,
                    hidden,
                    hidden,
                    hidden,
                    1e-6,
                    HAS_RESIDUAL=True,
                    BLOCK=block,
                    SINGLE_BLOCK=hidden <= block,
                    num_warps=warps,
                )
            )
            out.append(
                {
                    "kernel": "rms_fwd",
                    "shape": f"{rows}x{hidden}",
                    "block": block,
                    "warps": warps,
                    "ms": ms,
                }
            )
    return out


def sweep_rms_backward(rows: int, hidden: int) -> list[dict]:
    h = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16)
    dy, dh = torch.randn_like(h), torch.randn_like(h)
    w = torch.randn(hidden, device=DEVICE, dtype=torch.bfloat16)
    rstd = torch.rand(rows, device=DEVICE, dtype=torch.float32)
    dx = torch.empty_like(h)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block = min(triton.next_power_of_2(hidden), rms.MAX_BLOCK)
    warp_choices = (8, 16) if block >= 8192 else (4, 8)
    out = []
    for per_sm in (1, 2, 4, 8):
        programs = min(rows, sms * per_sm)
        rows_per_program = triton.cdiv(rows, programs)
        programs = triton.cdiv(rows, rows_per_program)
        partial = torch.empty(programs, hidden, device=DEVICE, dtype=torch.float32)
        for warps in warp_choices:
            for stages in (1, 2, 3):

                def launch(
                    warps=warps,
                    stages=stages,
                    programs=programs,
                    rows_per_program=rows_per_program,
                    partial=partial,
                ):
                    rms._rms_norm_bwd_kernel[(programs,)](
                        dy,
                        dh,
                        h,
                        w,
                        rstd,
                        dx,
                        partial,
                        hidden,
                        rows,
                        rows_per_program,
                        hidden,
                        HAS_DHIDDEN_OUT=True,
                        BLOCK=block,
                        SINGLE_BLOCK=hidden <= block,
                        NUM_STAGES=stages,
                        num_warps=warps,
                    )
                    return partial.sum(0)

                out.append(
                    {
                        "kernel": "rms_bwd",
                        "shape": f"{rows}x{hidden}",
                        "programs_per_sm": per_sm,
                        "warps": warps,
                        "stages": stages,
                        "ms": bench_ms(launch),
                    }
                )
    return out


def sweep_logprobs(rows: int, vocab: int) -> list[dict]:
    logits = torch.randn(rows, vocab, device=DEVICE, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device=DEVICE)
    stats = [torch.empty(rows, device=DEVICE) for _ in range(5)]
    out = []
    for block in (4096, 8192):
        for warps in (4, 8):
            for stages in (1, 2, 3):
                for entropy in (False, True):
                    ms = bench_ms(
                        lambda block=block, warps=warps, entropy=entropy, stages=stages: (
                            lp._token_logprobs_fwd_kernel[(rows,)](
                                logits,
                                targets,
                                *stats,
                                vocab,
                                vocab,
                                0,
                                -100,
                                1.0,
                                WITH_ENTROPY=entropy,
                                FULL_VOCAB=True,
                                BLOCK_V=block,
                                NUM_STAGES=stages,
                                num_warps=warps,
                            )
                        )
                    )
                    out.append(
                        {
                            "kernel": "lp_fwd",
                            "shape": f"{rows}x{vocab}",
                            "block": block,
                            "warps": warps,
                            "stages": stages,
                            "entropy": entropy,
                            "ms": ms,
                        }
                    )
    return out


def run_sweeps(rms_shapes, logprobs_shape) -> list[dict]:
    results = []
    for rows, hidden in rms_shapes:
        results += sweep_rms_forward(rows, hidden)
        results += sweep_rms_backward(rows, hidden)
    return results + sweep_logprobs(*logprobs_shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = run_sweeps([(8192, 8192), (16384, 2048)], (8192, 151936))
    payload = {**device_info(), "results": results}
    keys = ["kernel", "shape", "block", "warps", "programs_per_sm", "stages", "entropy", "ms"]
    table = markdown_table(keys, [[r.get(k) for k in keys] for r in results])
    write_results(args.out, "launch_configs", payload, table)


if __name__ == "__main__":
    main()
