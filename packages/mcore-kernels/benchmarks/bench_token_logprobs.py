"""Benchmark token log-probs (and entropy) of bf16 logits against its peers on one GPU.

Peers measured in the same run: ``torch.log_softmax(logits.float(), -1).gather(...)`` (with the
entropy from the same log-softmax) and Liger-Kernel's cross entropy (``reduction="none"``, the
negated log-prob) when installed. Reported: time, peak memory allocated beyond the inputs, and
the time one read of the logits takes at the device-to-device copy bandwidth measured in the same
run (the floor of any kernel that must read them).

Usage: ``python3 packages/mcore-kernels/benchmarks/bench_token_logprobs.py --out DIR``
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _common import (
    bench_ms,
    copy_bandwidth_tbs,
    cuda_generator,
    device_info,
    graph_us,
    input_sets,
    load_liger,
    markdown_table,
    peak_extra_bytes,
    quick,
    write_results,
)

from mcore_kernels import token_logprobs


def torch_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def torch_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor):
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def shapes() -> list[tuple[int, int]]:
    if quick():
        return [(1024, 50257), (8192, 151936)]
    return [(1024, 50257), (1024, 151936), (8192, 50257), (8192, 151936)]


def measure(rows: int, vocab: int, liger_ops) -> dict[str, Any]:
    gen = cuda_generator(rows + vocab)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=gen) * 4
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    forward: dict[str, Callable[[torch.Tensor], Any]] = {
        "mcore": lambda z: token_logprobs(z, targets),
        "mcore-checked": lambda z: token_logprobs(z, targets, check_targets=True),
        "mcore+entropy": lambda z: token_logprobs(z, targets, return_entropy=True),
        "torch": lambda z: torch_logprobs(z, targets),
        "torch+entropy": lambda z: torch_logprobs_entropy(z, targets),
    }
    if liger_ops is not None:
        forward["liger"] = lambda z: liger_ops.LigerCrossEntropyFunction.apply(
            z, targets, None, -100, 0.0, 0.0, "none"
        )
        # Liger's no-grad per-token log-prob kernel (GRPO): logits [B, L + 1, V], last row unused.
        from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

        ids = targets.unsqueeze(0)
        forward["liger-logp"] = lambda z: fused_selective_log_softmax(z, ids, 1.0)
    result: dict[str, Any] = {
        "rows": rows,
        "vocab": vocab,
        "dtype": "bfloat16",
        "logits_bytes": logits.numel() * 2,
    }
    # Each call gets its input the way the peer wants it: [rows, V] or Liger's [1, rows + 1, V].
    padded = torch.empty(1, rows + 1, vocab, device="cuda", dtype=torch.bfloat16)
    padded[0, :rows] = logits
    copies = [logits] + [logits.clone() for _ in range(input_sets(logits.numel() * 2) - 1)]

    def operand(name: str, z: torch.Tensor) -> torch.Tensor:
        return padded if name == "liger-logp" else z

    result["fwd_ms"] = {
        name: bench_ms(partial(fn, operand(name, logits))) for name, fn in forward.items()
    }
    result["fwd_gpu_us"] = {}
    for name, fn in forward.items():
        if name == "mcore-checked":
            continue  # its host synchronisation cannot be captured in a graph
        calls = [partial(fn, operand(name, z)) for z in copies]
        try:
            result["fwd_gpu_us"][name] = graph_us(lambda calls=calls: calls)
        except Exception as exc:
            # A peer that synchronises with the host (Liger's cross entropy reads a count back)
            # cannot be captured: its eager-mode time stands in, GPU-bound at these sizes.
            print(f"{name}: not captured ({type(exc).__name__}), wall time used", flush=True)
            result["fwd_gpu_us"][name] = 1e3 * result["fwd_ms"][name]
            result.setdefault("wall_time_for", []).append(name)
    result["fwd_extra_bytes"] = {
        name: peak_extra_bytes(partial(fn, operand(name, logits))) for name, fn in forward.items()
    }

    # Forward + backward of the summed log-probs on a leaf copy of the logits.
    leaf = logits.clone().requires_grad_()

    def mcore_train():
        leaf.grad = None
        token_logprobs(leaf, targets).sum().backward()

    def torch_train():
        leaf.grad = None
        torch_logprobs(leaf, targets).sum().backward()

    train = {"mcore": mcore_train, "torch": torch_train}
    if liger_ops is not None:
        # Liger overwrites its input with the gradient during the forward, so it gets its own
        # copy; after the first call that copy holds gradients, which costs the same work.
        scratch = logits.clone().requires_grad_()

        def liger_train():
            scratch.grad = None
            loss = liger_ops.LigerCrossEntropyFunction.apply(
                scratch, targets, None, -100, 0.0, 0.0, "sum"
            )[0]
            loss.backward()

        train["liger"] = liger_train
    # GPU time of forward + backward (no host work): a graph of back-to-back
    # ``autograd.grad`` calls over the logits copies, for every peer that can be captured.
    result["train_gpu_us"] = {}
    grad_fns = {"mcore": token_logprobs, "torch": torch_logprobs}
    for name, fn in grad_fns.items():
        leaves = [z.detach().requires_grad_() for z in copies]
        calls = [
            partial(lambda z, fn=fn: torch.autograd.grad(fn(z, targets).sum(), z)[0], z)
            for z in leaves
        ]
        torch.cuda.empty_cache()
        try:
            result["train_gpu_us"][name] = graph_us(lambda calls=calls: calls, min_calls=4)
        except torch.OutOfMemoryError:
            print(f"{name}: out of memory in the graph-timed forward + backward", flush=True)
            result["train_gpu_us"][name] = float("nan")
        del calls, leaves
    # The backward's floor measured: the faster of two copies of the logits (read and write
    # the same bytes; inside a graph a large ``copy_`` is a memcpy slower than an elementwise
    # kernel).
    copy_out = [torch.empty_like(z) for z in copies]
    copy_kernels = {
        "copy_": [partial(dst.copy_, z) for dst, z in zip(copy_out, copies, strict=True)],
        "neg_out": [
            partial(torch.neg, z, out=dst) for dst, z in zip(copy_out, copies, strict=True)
        ],
    }
    result["copy_logits_kernels_us"] = {
        name: graph_us(lambda calls=calls: calls, min_calls=4)
        for name, calls in copy_kernels.items()
    }
    result["copy_logits_us"] = min(result["copy_logits_kernels_us"].values())
    del copy_out, copy_kernels
    # The torch peer materialises several logits-sized tensors: at the largest shapes it can
    # run out of memory, which is reported (NaN) rather than ending the run.
    torch.cuda.empty_cache()
    result["train_ms"], result["train_extra_bytes"] = {}, {}
    for name, fn in train.items():
        try:
            result["train_ms"][name] = bench_ms(fn)
            result["train_extra_bytes"][name] = peak_extra_bytes(fn)
        except torch.OutOfMemoryError:
            print(f"{name}: out of memory in the forward + backward timing", flush=True)
            result["train_ms"][name] = result["train_extra_bytes"][name] = float("nan")
            leaf.grad = None
            torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for token_logprobs.json and .md"
    )
    args = parser.parse_args()
    liger_ops, liger_missing = load_liger()
    copy_tbs = copy_bandwidth_tbs()
    results = []
    started = time.perf_counter()
    for rows, vocab in shapes():
        entry = measure(rows, vocab, liger_ops)
        entry["read_once_ms"] = entry["logits_bytes"] / (copy_tbs * 1e12) * 1e3
        gpu = entry["fwd_gpu_us"]
        mcore = gpu["mcore"] / 1e3
        entry["speedup_fwd"] = {
            k: v / gpu["mcore"] for k, v in gpu.items() if not k.startswith("mcore")
        }
        entry["speedup_fwd_entropy"] = gpu["torch+entropy"] / gpu["mcore+entropy"]
        entry["speedup_train"] = {
            k: v / entry["train_ms"]["mcore"] for k, v in entry["train_ms"].items() if k != "mcore"
        }
        entry["fraction_of_read_once"] = entry["read_once_ms"] / mcore
        results.append(entry)
        print(f"[{time.perf_counter() - started:.1f} s]", entry, flush=True)
    launchers = importlib.import_module("mcore_kernels.token_logprobs")
    payload = {
        **device_info(),
        "benchmark": "token log-probs of bf16 logits",
        "cached_launch": launchers._FORWARD._fast and launchers._BACKWARD._fast,
        "copy_tbs": copy_tbs,
        "liger": liger_missing or "liger-kernel available",
        "results": results,
    }
    has_liger = liger_ops is not None
    header = [
        "rows x vocab",
        "read-once us",
        "mcore us",
        "% of read-once",
        "mcore wall us",
        "checked wall us",
        "torch us",
        "vs torch",
    ]
    header += ["liger CE us", "vs liger CE", "liger logp us", "vs liger logp"] if has_liger else []
    header += [
        "mcore+H us",
        "torch+H us",
        "vs torch (H)",
        "mcore extra MB",
        "torch extra MB",
        "extra % logits",
    ]
    rows = []
    for e in results:
        gib = 1e6
        gpu = e["fwd_gpu_us"]
        row = [
            f"{e['rows']}x{e['vocab']}",
            1e3 * e["read_once_ms"],
            gpu["mcore"],
            100 * e["fraction_of_read_once"],
            1e3 * e["fwd_ms"]["mcore"],
            1e3 * e["fwd_ms"]["mcore-checked"],
            gpu["torch"],
            e["speedup_fwd"]["torch"],
        ]
        if has_liger:
            row += [gpu["liger"], e["speedup_fwd"]["liger"]]
            row += [gpu["liger-logp"], e["speedup_fwd"]["liger-logp"]]
        row += [
            gpu["mcore+entropy"],
            gpu["torch+entropy"],
            e["speedup_fwd_entropy"],
            e["fwd_extra_bytes"]["mcore+entropy"] / gib,
            e["fwd_extra_bytes"]["torch+entropy"] / gib,
            100 * e["fwd_extra_bytes"]["mcore+entropy"] / e["logits_bytes"],
        ]
        rows.append(row)
    # The floor of any forward + backward: read the logits (forward: one read at the copy
    # bandwidth), then read them again and write their gradient (backward: a copy of the same
    # bytes, measured). torch / floor is the largest ratio against torch that any
    # implementation can reach on this device.
    train_header = ["rows x vocab", "floor us", "mcore us", "mcore x floor", "torch us"]
    train_header += ["vs torch", "torch / floor", "mcore wall ms", "torch wall ms", "vs torch wall"]
    train_header += ["liger wall ms", "vs liger wall"] if has_liger else []
    train_header += ["mcore extra MB", "torch extra MB"]
    train_rows = []
    for e in results:
        floor = 1e3 * e["read_once_ms"] + e["copy_logits_us"]
        e["train_floor_us"] = floor
        gpu = e["train_gpu_us"]
        row = [
            f"{e['rows']}x{e['vocab']}",
            floor,
            gpu["mcore"],
            floor / gpu["mcore"],
            gpu["torch"],
            gpu["torch"] / gpu["mcore"],
            gpu["torch"] / floor,
            e["train_ms"]["mcore"],
            e["train_ms"]["torch"],
            e["speedup_train"]["torch"],
        ]
        row += [e["train_ms"]["liger"], e["speedup_train"]["liger"]] if has_liger else []
        row += [e["train_extra_bytes"]["mcore"] / 1e6, e["train_extra_bytes"]["torch"] / 1e6]
        train_rows.append(row)
    table = (
        f"Token log-probs of bf16 logits on {payload['device']} (torch {payload['torch']}, triton "
        f"{payload['triton']}); device-to-device copy {copy_tbs:.2f} TB/s. Forward; H = with entropy; "
        "extra = peak memory allocated beyond the inputs (outputs included); mcore = the default "
        "call (no host sync); checked = ``check_targets=True`` (the opt-in range check, one host "
        "sync). us = GPU time per call (median replay of a CUDA graph of back-to-back calls "
        "over enough logits copies that they come from memory); wall = eager-mode "
        "``triton.testing.do_bench`` time, host launch cost included. Ratios are peer GPU time "
        "/ mcore GPU time; a peer that cannot be captured in a graph (a host synchronisation) "
        "is timed by its wall time instead (listed under ``wall_time_for`` in the JSON).\n\n"
        + markdown_table(header, rows)
        + "\nForward + backward of the summed log-probs. us = GPU time (a CUDA graph of "
        "back-to-back ``torch.autograd.grad`` calls over the logits copies); wall = eager-mode "
        "``do_bench`` time, host included (Liger's cross entropy synchronises with the host and "
        "is only timed this way). Floor = one read of the logits at the copy bandwidth "
        "(forward) plus a measured device-to-device copy of the logits (backward: read them "
        "again, write the gradient): any implementation that takes the upstream gradient in "
        "the backward must move these bytes, so torch / floor caps the ratio against torch "
        "on this device.\n\n" + markdown_table(train_header, train_rows)
    )
    write_results(args.out, "token_logprobs", payload, table)


if __name__ == "__main__":
    main()
