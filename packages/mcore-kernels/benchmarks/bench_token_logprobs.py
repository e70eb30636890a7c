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
    input_sets,
    interleaved_graph_us,
    load_liger,
    markdown_table,
    peak_extra_bytes,
    quick,
    write_results,
)

from mcore_kernels import token_logprobs

ROUNDS = 15
"""Rounds of the interleaved graph timing (the median is reported)."""


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
    # Every peer in one interleaved loop of graph replays (see ``interleaved_graph_us``).
    captured = {
        name: (lambda fn=fn, name=name: [partial(fn, operand(name, z)) for z in copies])
        for name, fn in forward.items()
        # Its host synchronisation cannot be captured in a graph.
        if name != "mcore-checked"
    }
    timed = interleaved_graph_us(captured, rounds=ROUNDS)
    result["fwd_gpu_us"] = {}
    result["fwd_spread_us"] = {}
    for name, t in timed.items():
        if t["us"] is None:
            # A peer that synchronises with the host (Liger's cross entropy reads a count back)
            # cannot be captured: its eager-mode time stands in, GPU-bound at these sizes.
            print(f"{name}: not captured ({t['error'][:80]}), wall time used", flush=True)
            result["fwd_gpu_us"][name] = 1e3 * result["fwd_ms"][name]
            result.setdefault("wall_time_for", []).append(name)
        else:
            result["fwd_gpu_us"][name] = t["us"]
            result["fwd_spread_us"][name] = [t["min"], t["max"]]
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
    # ``autograd.grad`` calls over the logits copies per implementation, and the floor: a
    # device-to-device copy of the bytes any forward + backward must move (read the logits in
    # the forward, read them again and write their gradient in the backward: 3 x the logits'
    # bytes, i.e. a copy of 1.5 x the logits), all replayed in one interleaved loop. torch /
    # floor is then the largest ratio against torch that any implementation can reach here.
    grad_fns = {"mcore": token_logprobs, "torch": torch_logprobs}
    leaves = {name: [z.detach().requires_grad_() for z in copies] for name in grad_fns}
    floor_elements = 3 * logits.numel() // 2
    floor_src = [torch.empty(floor_elements, device="cuda", dtype=logits.dtype) for _ in copies]
    floor_dst = [torch.empty_like(t) for t in floor_src]
    train_makers: dict[str, Callable[[], list[Callable[[], Any]]]] = {
        name: lambda fn=fn, name=name: [
            partial(lambda z, fn=fn: torch.autograd.grad(fn(z, targets).sum(), z)[0], z)
            for z in leaves[name]
        ]
        for name, fn in grad_fns.items()
    }
    train_makers["floor:copy_"] = lambda: [
        partial(dst.copy_, src) for dst, src in zip(floor_dst, floor_src, strict=True)
    ]
    train_makers["floor:neg_out"] = lambda: [
        partial(torch.neg, src, out=dst) for dst, src in zip(floor_dst, floor_src, strict=True)
    ]
    torch.cuda.empty_cache()
    timed = interleaved_graph_us(train_makers, rounds=ROUNDS, min_calls=4)
    result["train_gpu_us"] = {name: timed[name]["us"] for name in grad_fns}
    result["train_spread_us"] = {
        name: [t.get("min"), t.get("max")] for name, t in timed.items() if t["us"] is not None
    }
    for name, t in timed.items():
        if t["us"] is None:
            print(f"{name}: forward + backward not timed: {t['error']}", flush=True)
    result["train_floor_kernels_us"] = {
        name.removeprefix("floor:"): timed[name]["us"] for name in timed if "floor:" in name
    }
    result["train_floor_us"] = min(
        (v for v in result["train_floor_kernels_us"].values() if v), default=None
    )
    train_makers.clear()
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
    # The floor of any forward + backward, measured in the same loop: a copy of the bytes it
    # must move. torch / floor is the largest ratio against torch that any implementation can
    # reach on this device.
    train_header = ["rows x vocab", "floor us", "mcore us", "mcore x floor", "torch us"]
    train_header += ["vs torch", "torch / floor", "mcore wall ms", "torch wall ms", "vs torch wall"]
    train_header += ["liger wall ms", "vs liger wall"] if has_liger else []
    train_header += ["mcore extra MB", "torch extra MB"]
    train_rows = []
    for e in results:
        floor = e["train_floor_us"]
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
        "sync). us = GPU time per call (one CUDA graph of back-to-back calls over enough "
        "logits copies that they come from memory per implementation, all replayed in "
        f"{ROUNDS} interleaved rounds, median round); wall = eager-mode "
        "``triton.testing.do_bench`` time, host launch cost included. Ratios are peer GPU time "
        "/ mcore GPU time; a peer that cannot be captured in a graph (a host synchronisation) "
        "is timed by its wall time instead (listed under ``wall_time_for`` in the JSON).\n\n"
        + markdown_table(header, rows)
        + "\nForward + backward of the summed log-probs. us = GPU time (a CUDA graph of "
        "back-to-back ``torch.autograd.grad`` calls over the logits copies, timed in the same "
        "interleaved loop as the floor); wall = eager-mode ``do_bench`` time, host included "
        "(Liger's cross entropy synchronises with the host and is only timed this way). Floor "
        "= a measured device-to-device copy of the bytes any forward + backward must move "
        "(read the logits in the forward, read them again and write their gradient in the "
        "backward: 3 x the logits' bytes, the faster of ``copy_`` and ``torch.neg(out=)`` of "
        "1.5 x the logits), so torch / floor caps the ratio against torch of any "
        "implementation on this device.\n\n" + markdown_table(train_header, train_rows)
    )
    write_results(args.out, "token_logprobs", payload, table)


if __name__ == "__main__":
    main()
