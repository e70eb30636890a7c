"""Save and load of a ~1B-parameter model with its AdamW state: mcore-ckpt against its peers.

Peers, measured in the same run on the same disk: ``torch.save``/``torch.load`` of the whole
state dict (followed by ``fsync``, so that every method ends with the data durable), plain
``torch.distributed.checkpoint`` (DCP) with its default planner and file-system writer, and
``dd`` writing and reading as many bytes (the disk's sequential bandwidth, the ceiling).

Loads start from a cold page cache where the kernel allows it: every written file is flushed and
then dropped from the cache with ``posix_fadvise(DONTNEED)``.

Writes ``checkpoint.json`` (device, shapes, times, bandwidths, ratios) and ``checkpoint.md`` (a
Markdown table) into ``--out``::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-ckpt/benchmarks/bench_checkpoint.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import mcore_ckpt

GB = 1e9


def build_state(params: float, device: torch.device, hidden: int) -> tuple[dict, int]:
    """A Llama-shaped model in bf16 and its AdamW state (fp32 main params and two moments)."""
    vocab, intermediate = 32000, 4 * hidden
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    shapes = {"embedding.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attention.qkv.weight": (3 * hidden, hidden),
            p + "attention.proj.weight": (hidden, hidden),
            p + "mlp.fc1.weight": (2 * intermediate, hidden),
            p + "mlp.fc2.weight": (hidden, intermediate),
            p + "input_norm.weight": (hidden,),
            p + "post_norm.weight": (hidden,),
        }
    generator = torch.Generator(device=device).manual_seed(0)
    model, param_state = {}, {}
    for name, shape in shapes.items():
        main = torch.randn(shape, generator=generator, device=device)
        model[name] = main.to(torch.bfloat16)
        param_state[name] = {
            "main_param": main,
            "exp_avg": torch.randn(shape, generator=generator, device=device),
            "exp_avg_sq": torch.rand(shape, generator=generator, device=device),
        }
    state = {"model": model, "optimizer": {"step": 1000, "param_state": param_state}}
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    return state, nbytes


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def _zeros_like(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _zeros_like(v) for k, v in tree.items()}
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else None


def _same(a: Any, b: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drop_page_cache(path: Path) -> None:
    """Flushes and evicts every file under ``path`` from the page cache (best effort)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    value = fn()
    _sync(device)
    return time.perf_counter() - start, value


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.unlink(missing_ok=True) if path.is_file() else None
    return path


def bench_mcore(state, device, scratch: Path, io_threads: int) -> dict:
    root = _fresh(scratch / f"mcore_t{io_threads}")
    save_s, _ = _timed(lambda: mcore_ckpt.save(root, state, io_threads=io_threads), device)
    drop_page_cache(root)
    target = _zeros_like(state)
    load_s, _ = _timed(lambda: mcore_ckpt.load(root, target), device)
    ok = _same(target, state)
    shutil.rmtree(root)
    return {"save_s": save_s, "load_s": load_s, "verified": ok}


def bench_mcore_async(state, device, scratch: Path) -> dict:
    root = _fresh(scratch / "mcore_async")
    out = {}
    for attempt in ("first", "reused_buffers"):
        blocking_s, handle = _timed(
            lambda: mcore_ckpt.save(root, state, async_save=True, keep_last=1), device
        )
        total_s, _ = _timed(handle.wait, device)
        out[f"{attempt}_blocking_s"] = blocking_s
        out[f"{attempt}_total_s"] = blocking_s + total_s
    shutil.rmtree(root)
    mcore_ckpt.release_staging_buffers(root)
    return out


def bench_torch_save(state, device, scratch: Path) -> dict:
    path = _fresh(scratch / "torch_save.pt")

    def save() -> None:
        with open(path, "wb") as stream:
            torch.save(state, stream)
            stream.flush()
            os.fsync(stream.fileno())

    save_s, _ = _timed(save, device)
    drop_page_cache(path)
    load_s, loaded = _timed(
        lambda: torch.load(path, map_location=device, weights_only=True), device
    )
    ok = _same(loaded, state)
    del loaded
    path.unlink()
    return {"save_s": save_s, "load_s": load_s, "verified": ok}


def bench_dcp(state, device, scratch: Path) -> dict:
    root = _fresh(scratch / "dcp")
    save_s, _ = _timed(lambda: dcp.save(state, checkpoint_id=str(root)), device)
    drop_page_cache(root)
    target = _zeros_like(state)
    load_s, _ = _timed(lambda: dcp.load(target, checkpoint_id=str(root)), device)
    ok = _same(target, state)
    shutil.rmtree(root)
    return {"save_s": save_s, "load_s": load_s, "verified": ok}


def bench_dd(nbytes: int, scratch: Path) -> dict:
    path = _fresh(scratch / "dd.bin")
    block = 64 << 20
    count = -(-nbytes // block)
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    write_s = time.perf_counter() - start
    drop_page_cache(path)
    start = time.perf_counter()
    subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", f"bs={block}"], check=True, capture_output=True
    )
    read_s = time.perf_counter() - start
    path.unlink()
    return {"bytes": count * block, "save_s": write_s, "load_s": read_s, "verified": "-"}


def _best(samples: list[dict]) -> dict:
    best = dict(samples[0])
    for key in best:
        if key.endswith("_s"):
            best[key] = min(s[key] for s in samples)
    if best.get("verified") != "-":
        best["verified"] = all(s["verified"] for s in samples)
    return best


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    scratch = Path(args.dir).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    state, nbytes = build_state(args.params, device, args.hidden)
    params = sum(t.numel() for t in state["model"].values())
    results: dict[str, dict] = {}
    for _ in range(args.repeats):
        samples = {"dd": bench_dd(nbytes, scratch)}
        samples["torch.save/load"] = bench_torch_save(state, device, scratch)
        samples["torch DCP"] = bench_dcp(state, device, scratch)
        for threads in args.io_threads:
            samples[f"mcore-ckpt io_threads={threads}"] = bench_mcore(
                state, device, scratch, threads
            )
        for name, sample in samples.items():
            results.setdefault(name, []).append(sample)  # type: ignore[arg-type]
    best = {name: _best(samples) for name, samples in results.items()}  # type: ignore[arg-type]
    dd = best["dd"]
    for name, row in best.items():
        size = dd["bytes"] if name == "dd" else nbytes
        row["save_GBps"] = size / row["save_s"] / GB
        row["load_GBps"] = size / row["load_s"] / GB
        row["save_vs_dd"] = row["save_GBps"] / best["dd"]["save_GBps"]
        row["load_vs_dd"] = row["load_GBps"] / best["dd"]["load_GBps"]
        row["save_vs_dcp"] = best["torch DCP"]["save_s"] / row["save_s"]
        row["load_vs_dcp"] = best["torch DCP"]["load_s"] / row["load_s"]
    asynchronous = bench_mcore_async(state, device, scratch)
    return {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "mcore_ckpt": mcore_ckpt.__version__,
        "python": platform.python_version(),
        "scratch_dir": str(scratch),
        "params": params,
        "state_bytes": nbytes,
        "tensors": len(_tensors(state)),
        "hidden": args.hidden,
        "repeats": args.repeats,
        "best": best,
        "samples": results,
        "async": asynchronous,
    }


def markdown(report: dict) -> str:
    lines = [
        f"Save + load of {report['params'] / 1e9:.3g}B parameters in bf16 with fp32 AdamW state "
        f"({report['state_bytes'] / GB:.1f} GB, {report['tensors']} tensors) on "
        f"{report['device']}, torch {report['torch']}; best of {report['repeats']}; loads from a "
        "cold page cache.",
        "",
        "| method | save s | save GB/s | save vs dd | save vs DCP | load s | load GB/s | load vs dd | load vs DCP | verified |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in report["best"].items():
        lines.append(
            f"| {name} | {row['save_s']:.2f} | {row['save_GBps']:.2f} | {row['save_vs_dd']:.2f} "
            f"| {row['save_vs_dcp']:.2f} | {row['load_s']:.2f} | {row['load_GBps']:.2f} "
            f"| {row['load_vs_dd']:.2f} | {row['load_vs_dcp']:.2f} | {row.get('verified', '-')} |"
        )
    a = report["async"]
    lines += [
        "",
        f"mcore-ckpt async save: blocks the caller {a['first_blocking_s']:.2f} s the first time "
        f"(pinned buffers allocated), {a['reused_buffers_blocking_s']:.2f} s with reused buffers; "
        f"committed after {a['first_total_s']:.2f} s / {a['reused_buffers_total_s']:.2f} s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and writes its JSON and Markdown results.

    Args:
        argv: Command-line arguments; ``sys.argv[1:]`` when None.

    Returns:
        The exit status.
    """
    # Single-process DCP is intended here; it warns about it on every call.
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for checkpoint.json/.md")
    parser.add_argument(
        "--dir", default=".ckpt-bench-scratch", help="scratch dir on the disk to measure"
    )
    parser.add_argument("--params", type=float, default=1.0e9, help="approximate model parameters")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--io-threads", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args(argv)
    try:
        report = run(args)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint.json").write_text(json.dumps(report, indent=1))
    (out / "checkpoint.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
