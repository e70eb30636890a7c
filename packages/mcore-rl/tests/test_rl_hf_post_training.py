"""Post-training a Hugging Face checkpoint on the CPU: a tiny local Qwen2 with its tokenizer and
chat template learns a generated JSONL math set (20 steps, reward goes up), is evaluated on a
held-out split, and exported as a checkpoint that transformers and ``mcore-inference generate``
load and decode greedily like the engine."""

import json
import random

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.cli import main as inference_main
from mcore_inference.testing import write_tiny_hf_checkpoint
from mcore_models import GPTModel
from mcore_rl.cli import main
from mcore_rl.config import GRPOConfig
from mcore_rl.distributed import init_worker_state
from mcore_rl.run import run_grpo
from mcore_rl.worker import GRPOWorker

transformers = pytest.importorskip("transformers")

SYSTEM_PROMPT = "Answer with the number."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), seed=0)


@pytest.fixture(scope="module")
def math_jsonl(tmp_path_factory):
    """Single-digit sums in GSM8K's format (reasoning, then ``#### answer``)."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    with path.open("w") as handle:
        for _ in range(120):
            a, b = rng.randint(0, 4), rng.randint(0, 4)
            record = {"question": f"{a}+{b}=", "answer": f"{a}+{b} = {a + b}\n#### {a + b}"}
            handle.write(json.dumps(record) + "\n")
    return path


def _config(checkpoint, math_jsonl, run_dir, **run):
    return GRPOConfig.from_dict(
        {
            "model": {"hf_path": str(checkpoint)},
            "data": {
                "path": str(math_jsonl),
                "prompt_field": "question",
                "system_prompt": SYSTEM_PROMPT,
                "eval_size": 16,
            },
            "reward": {"functions": ["math", "format"]},
            "rollout": {
                "num_prompts": 8,
                "group_size": 8,
                "max_new_tokens": 3,
                "reward_requires_stop": False,
            },
            "optimizer": {"lr": 3e-3},
            "eval": {"every": 10},
            "run": {
                "device": "cpu",
                "num_steps": 20,
                "target_reward": None,
                "progress": False,
                "checkpoint_every": 0,
                "hf_checkpoint_every": 10,
                "run_dir": str(run_dir),
                "seed": 0,
                **run,
            },
        }
    )


@pytest.fixture(scope="module")
def trained(checkpoint, math_jsonl, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    return run_grpo(_config(checkpoint, math_jsonl, run_dir)), run_dir


def test_prompts_are_rendered_with_the_checkpoint_chat_template(checkpoint, math_jsonl, tmp_path):
    config = _config(checkpoint, math_jsonl, tmp_path)
    worker = GRPOWorker(config, init_worker_state(config))
    try:
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "3+4="},
        ]
        expected = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert worker.tokenizer.encode_prompt("3+4=") == expected
        assert worker.tokenizer.eos_token_ids[0] == hf_tokenizer.eos_token_id
        # The policy holds the checkpoint's weights.
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
        ids = torch.tensor([expected])
        with torch.no_grad():
            torch.testing.assert_close(
                worker.model.module(ids), hf_model(ids).logits, rtol=1e-4, atol=1e-5
            )
    finally:
        worker.close()
        torch.distributed.destroy_process_group()


def test_twenty_steps_raise_the_mean_reward(trained):
    result, run_dir = trained
    rewards = [r["reward/mean"] for r in result.records]
    assert len(rewards) == 20
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.05, rewards
    assert all(r["reward/failures"] == 0 for r in result.records)
    evaluated = [r for r in result.records if "eval/pass@1" in r]
    assert [r["step"] for r in evaluated] == [9, 19]
    assert all(r["eval/prompts"] == 16 for r in evaluated)
    assert "data/skipped_prompts" in result.records[0]
    summary = (run_dir / "summary.md").read_text()
    assert "hf/step-000020" in summary and "held-out pass@1" in summary


def test_exports_every_ten_steps_with_the_tokenizer_files(trained, checkpoint):
    result, _ = trained
    assert [p.name for p in result.hf_checkpoints] == ["step-000010", "step-000020"]
    for directory in result.hf_checkpoints:
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (directory / name).is_file(), name
        assert (directory / "tokenizer.json").read_bytes() == (
            checkpoint / "tokenizer.json"
        ).read_bytes()


def test_export_loads_in_transformers_and_generates_like_the_engine(trained, capsys):
    result, _ = trained
    directory = result.hf_checkpoints[-1]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = GPTModel.from_hf(directory, dtype=torch.float32).eval()
    prompts = [
        hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        for q in ("1+2=", "4+4=", "0+3=")
    ]  # fmt: skip
    config = InferenceConfig(max_batch_size=3, max_sequence_length=64)
    with InferenceEngine(model, config) as engine:
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    for prompt, generated in zip(prompts, results):
        expected = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
        )[0, len(prompt) :].tolist()
        assert generated.tokens == expected
    # mcore-inference generate reads the exported directory as it is (tokenizer included).
    assert inference_main(["generate", "--model", str(directory), "--prompt", "1+2=",
                           "--sampling.max-tokens", "4", "--sampling.temperature", "0",
                           "--device", "cpu", "--json"]) == 0  # fmt: skip
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["status"] == "FINISHED" and isinstance(record["text"], str)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"path": "{tmp}/missing.jsonl"}, "does not exist"),
        ({"prompt_field": "prompt"}, "has no field 'prompt'"),
        ({"max_prompt_tokens": 2}, "longer than the context allows"),
    ],
)
def test_bad_dataset_inputs_are_one_line_errors(
    checkpoint, math_jsonl, tmp_path, capsys, data, message
):
    fields = {"--data.path": str(math_jsonl), "--data.prompt-field": "question"}
    fields.update(
        {f"--data.{k.replace('_', '-')}": str(v).format(tmp=tmp_path) for k, v in data.items()}
    )
    args = ["grpo", "--model.hf-path", str(checkpoint), "--run.device", "cpu",
            "--run.run-dir", str(tmp_path / "run")]  # fmt: skip
    for key, value in fields.items():
        args += [key, value]
    assert main(args) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and message in error and "Traceback" not in error
