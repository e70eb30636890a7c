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
from pathlib import Path
from typing import Any

import torch
from _common import (
    bench_ms,
    copy_bandwidth_tbs,
    device_info,
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
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 4
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    forward = {
        "mcore": lambda: token_logprobs(logits, targets),
        "mcore-checked": lambda: token_logprobs(logits, targets, check_targets=True),
        "mcore+entropy": lambda: token_logprobs(logits, targets, return_entropy=True),
        "torch": lambda: torch_logprobs(logits, targets),
        "torch+entropy": lambda: torch_logprobs_entropy(logits, targets),
    }
    if liger_ops is not None:
        forward["liger"] = lambda: liger_ops.LigerCrossEntropyFunction.apply(
            logits, targets, None, -100, 0.0, 0.0, "none"
        )
        # Liger's no-grad per-token log-prob kernel (GRPO): logits [B, L + 1, V], last row unused.
        from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

        padded = torch.empty(1, rows + 1, vocab, device="cuda", dtype=torch.bfloat16)
        padded[0, :rows] = logits
        ids = targets.unsqueeze(0)
        forward["liger-logp"] = lambda: fused_selective_log_softmax(padded, ids, 1.0)
    result: dict[str, Any] = {
        "rows": rows,
        "vocab": vocab,
        "dtype": "bfloat16",
        "logits_bytes": logits.numel() * 2,
    }
    result["fwd_ms"] = {name: bench_ms(fn) for name, fn in forward.items()}
    result["fwd_extra_bytes"] = {name: peak_extra_bytes(fn) for name, fn in forward.items()}

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
    result["train_ms"] = {name: bench_ms(fn) for name, fn in train.items()}
    result["train_extra_bytes"] = {name: peak_extra_bytes(fn) for name, fn in train.items()}
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
    for rows, vocab in shapes():
        entry = measure(rows, vocab, liger_ops)
        entry["read_once_ms"] = entry["logits_bytes"] / (copy_tbs * 1e12) * 1e3
        mcore = entry["fwd_ms"]["mcore"]
        entry["speedup_fwd"] = {
            k: v / mcore for k, v in entry["fwd_ms"].items() if not k.startswith("mcore")
        }
        entry["speedup_fwd_entropy"] = (
            entry["fwd_ms"]["torch+entropy"] / entry["fwd_ms"]["mcore+entropy"]
        )
        entry["speedup_train"] = {
            k: v / entry["train_ms"]["mcore"] for k, v in entry["train_ms"].items() if k != "mcore"
        }
        entry["fraction_of_read_once"] = entry["read_once_ms"] / mcore
        results.append(entry)
        print(entry, flush=True)
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
        "read-once ms",
        "mcore ms",
        "checked ms",
        "% of read-once",
        "torch ms",
        "vs torch",
    ]
    header += ["liger CE ms", "vs liger CE", "liger logp ms", "vs liger logp"] if has_liger else []
    header += [
        "mcore+H ms",
        "torch+H ms",
        "vs torch (H)",
        "mcore extra MB",
        "torch extra MB",
        "extra % logits",
    ]
    rows = []
    for e in results:
        gib = 1e6
        row = [
            f"{e['rows']}x{e['vocab']}",
            e["read_once_ms"],
            e["fwd_ms"]["mcore"],
            e["fwd_ms"]["mcore-checked"],
            100 * e["fraction_of_read_once"],
            e["fwd_ms"]["torch"],
            e["speedup_fwd"]["torch"],
        ]
        if has_liger:
            row += [e["fwd_ms"]["liger"], e["speedup_fwd"]["liger"]]
            row += [e["fwd_ms"]["liger-logp"], e["speedup_fwd"]["liger-logp"]]
        row += [
            e["fwd_ms"]["mcore+entropy"],
            e["fwd_ms"]["torch+entropy"],
            e["speedup_fwd_entropy"],
            e["fwd_extra_bytes"]["mcore+entropy"] / gib,
            e["fwd_extra_bytes"]["torch+entropy"] / gib,
            100 * e["fwd_extra_bytes"]["mcore+entropy"] / e["logits_bytes"],
        ]
        rows.append(row)
    train_header = ["rows x vocab", "mcore fwd+bwd ms", "torch fwd+bwd ms", "vs torch"]
    train_header += ["liger fwd+bwd ms", "vs liger"] if has_liger else []
    train_header += ["mcore extra MB", "torch extra MB"]
    train_rows = []
    for e in results:
        row = [
            f"{e['rows']}x{e['vocab']}",
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
        "sync). Ratios are peer time / mcore time.\n\n"
        + markdown_table(header, rows)
        + "\nForward + backward of the summed log-probs:\n\n"
        + markdown_table(train_header, train_rows)
    )
    write_results(args.out, "token_logprobs", payload, table)


if __name__ == "__main__":
    main()
