"""Peak host memory per rank of GPTModel.from_hf: unsharded vs tp=2 x pp=2 (sliced reads).

Writes a random-weight Hugging Face checkpoint of a >= 1B model (Llama-3.2-1B shape by default,
bf16, sharded safetensors with an index: the shape of real downloads) tensor by tensor, then
loads it (a) whole in one process and (b) at tp=2 x pp=2 on 4 gloo ranks on the CPU, and
reports every rank's peak resident set size (``ru_maxrss``) above its RSS before loading,
next to the bytes of the shard it holds and the bytes it read from the checkpoint.
Target: each sharded rank <= 0.6x the unsharded load.

    python packages/mcore-models/benchmarks/bench_hf_load_memory.py \\
        --out packages/mcore-models/benchmarks/results/cpu/hf_load_memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from mcore_models import GPTConfig, GPTModel
from mcore_models.gpt.hf import config_to_hf, hf_name
from mcore_models.hf_io import SafetensorsReader
from mcore_parallel import initialize
from mcore_parallel.testing import run_distributed


def _rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _AnonPeak:
    """Samples RssAnon (memory not backed by files: tensors, not the mmapped checkpoint)."""

    def __init__(self) -> None:
        self.peak = _rss_mib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_mib("RssAnon"))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss_mib("RssAnon"))


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_checkpoint(config: GPTConfig, directory: Path, shard_bytes: int = 1 << 30) -> int:
    """Write a random checkpoint one tensor at a time; returns its size in bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    meta = GPTModel(config, device="meta")
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    files: list[str] = []
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            files.append(name)
            for key in shard:
                weight_map[key] = name
            shard, size = {}, 0

    for name, param in meta.named_parameters():
        tensor = torch.empty(param.shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
        nbytes = tensor.numel() * 2
        if size + nbytes > shard_bytes:
            flush()
        shard[hf_name(name)] = tensor
        size += nbytes
        total += nbytes
    flush()
    renamed = {}
    for index, name in enumerate(files, start=1):
        final = f"model-{index:05d}-of-{len(files):05d}.safetensors"
        (directory / name).rename(directory / final)
        renamed[name] = final
    index_map = {key: renamed[value] for key, value in weight_map.items()}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index_map})
    )
    (directory / "config.json").write_text(json.dumps(config_to_hf(config)))
    return total


def _load(directory: str, tp: int, pp: int) -> dict:
    torch.set_num_threads(1)
    state = initialize(tp=tp, pp=pp) if tp * pp > 1 else None
    gc.collect()
    before = _rss_mib()
    anon_before = _rss_mib("RssAnon")
    sampler = _AnonPeak()
    reader = SafetensorsReader(directory)
    start = time.perf_counter()
    model = GPTModel.from_hf(directory, state=state, dtype=torch.bfloat16, device="cpu")
    seconds = time.perf_counter() - start
    anon_peak = sampler.stop()
    assert isinstance(model, GPTModel)
    del reader
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "rank": 0 if state is None else state.rank,
        "tp_rank": 0 if state is None else state.tp_rank,
        "pp_rank": 0 if state is None else state.pp_rank,
        "rss_before_mib": round(before, 1),
        "peak_rss_mib": round(_peak_mib(), 1),
        "peak_above_start_mib": round(_peak_mib() - before, 1),
        "anon_peak_above_start_mib": round(anon_peak - anon_before, 1),
        "held_mib": round(held / 2**20, 1),
        "load_seconds": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = GPTConfig.from_name(args.preset, dtype="bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "ckpt"
        checkpoint_bytes = write_checkpoint(config, directory)
        whole = run_distributed(_load, 1, str(directory), 1, 1, timeout=1800)[0]
        sharded = run_distributed(_load, 4, str(directory), 2, 2, timeout=1800)
    worst = max(rank["peak_above_start_mib"] for rank in sharded)
    result = {
        "benchmark": "hf_load_memory",
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "preset": args.preset,
        "parameters": config.num_parameters(),
        "checkpoint_mib": round(checkpoint_bytes / 2**20, 1),
        "unsharded": whole,
        "tp2_pp2": sharded,
        "worst_rank_ratio": round(worst / whole["peak_above_start_mib"], 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# from_hf peak host memory, {args.preset} ({config.num_parameters() / 1e9:.2f}B, bf16,"
        f" {result['checkpoint_mib']:.0f} MiB checkpoint), {result['device']}",
        "",
        "Peak RSS counts the pages of the memory-mapped checkpoint a rank touched (file-backed, "
        "reclaimable); anonymous RSS is the memory the rank allocated (its tensors).",
        "",
        "| layout | rank (tp, pp) | peak RSS above start (MiB) | peak anonymous RSS (MiB) | "
        "shard held (MiB) | RSS ratio to unsharded | load s |",
        "|---|---|---|---|---|---|---|",
        f"| unsharded | 0 | {whole['peak_above_start_mib']} | "
        f"{whole['anon_peak_above_start_mib']} | {whole['held_mib']} | 1.00 | "
        f"{whole['load_seconds']} |",
    ]
    for rank in sharded:
        ratio = rank["peak_above_start_mib"] / whole["peak_above_start_mib"]
        lines.append(
            f"| tp=2 pp=2 | {rank['rank']} ({rank['tp_rank']}, {rank['pp_rank']}) | "
            f"{rank['peak_above_start_mib']} | {rank['anon_peak_above_start_mib']} | "
            f"{rank['held_mib']} | {ratio:.2f} | {rank['load_seconds']} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
