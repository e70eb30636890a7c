"""``summary.md``: what a run was, how it ended and where its checkpoints are."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mcore_rl.config import GRPOConfig

__all__ = ["write_summary"]

_HEADLINE = (
    ("reward/mean", "mean reward"),
    ("reward/accuracy", "accuracy (reward 1)"),
    ("response/length", "response length"),
    ("kl", "KL to reference"),
    ("entropy", "entropy"),
    ("reward/failures", "failed reward samples"),
)


def _last(records: Sequence[dict[str, Any]], key: str) -> Any:
    return next((r[key] for r in reversed(records) if key in r), None)


def write_summary(
    path: str | Path,
    *,
    config: GRPOConfig,
    records: Sequence[dict[str, Any]],
    reached_target: bool,
    hf_checkpoints: Sequence[Path],
    seconds: float,
) -> Path:
    """Writes the Markdown summary of a run.

    Args:
        path: The file (``<run_dir>/summary.md``).
        config: The run config.
        records: Per-step metrics.
        reached_target: Whether the target reward was reached.
        hf_checkpoints: Exported Hugging Face checkpoint directories.
        seconds: Wall time of this invocation.

    Returns:
        The path written.
    """
    path = Path(path)
    run_dir = path.parent
    source = config.model.hf_path or f"{config.model.name} (from scratch)"
    prompts = config.data.path or f"task {config.task.name}"
    lines = [
        "# GRPO run",
        "",
        f"- policy: `{source}`; prompts: `{prompts}`",
        f"- steps: {len(records)}; this invocation: {seconds:.0f} s",
        f"- target reward {config.run.target_reward}: "
        f"{'reached' if reached_target else 'not reached'}",
        "",
        "## Final metrics",
        "",
        "| metric | first step | last step |",
        "|---|---|---|",
    ]
    for key, label in _HEADLINE:
        if records and key in records[-1]:
            lines.append(
                f"| {label} | {records[0].get(key, float('nan')):.4f} | {records[-1][key]:.4f} |"
            )
    for key, label in (
        ("eval/pass@1", "held-out pass@1 (greedy)"),
        ("eval/reward", "held-out mean reward"),
    ):
        value = _last(records, key)
        if value is not None:
            first = next(r[key] for r in records if key in r)
            lines.append(f"| {label} | {first:.4f} | {value:.4f} |")
    skipped = _last(records, "data/skipped_prompts")
    if skipped:
        lines += ["", f"{int(skipped)} prompts longer than the context were skipped."]
    lines += [
        "",
        "## Outputs",
        "",
        "- `metrics.jsonl`: one line per step; `metrics.png`: the curves; `config.json`: the config",
        f"- `checkpoints/`: resumable checkpoints (`mcore-rl grpo --run.run-dir {run_dir} "
        "--run.resume`)",
    ]
    if hf_checkpoints:
        latest = hf_checkpoints[-1]
        lines += [
            "- Hugging Face checkpoints: "
            + ", ".join(f"`{Path(p).relative_to(run_dir)}`" for p in hf_checkpoints),
            "",
            "Load the latest one:",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'model = AutoModelForCausalLM.from_pretrained("{latest}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{latest}")',
            "```",
            "",
            "```bash",
            f'mcore-inference generate --model {latest} --prompt "..."',
            "```",
        ]
    lines += ["", "## Config", "", "```json", json.dumps(config.to_dict(), indent=2), "```", ""]
    path.write_text("\n".join(lines))
    return path
