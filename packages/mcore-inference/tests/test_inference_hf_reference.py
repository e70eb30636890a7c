"""Against Hugging Face: greedy decoding equals transformers ``generate`` on the same weights;
the ``mcore-inference generate`` CLI and string stop words with a real ``tokenizer.json``."""

import json

import pytest
import torch

from mcore_inference import FinishReason, InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.cli import main
from mcore_models import GPTConfig, GPTModel

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

VOCAB = 300


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2.5-shaped checkpoint with a word-level tokenizer.json, written to disk."""
    directory = tmp_path_factory.mktemp("qwen_tiny")
    config = GPTConfig.from_name(
        "qwen2.5-0.5b",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=VOCAB,
        dtype="float32",
        seed=5,
    )
    model = GPTModel(config).eval()
    model.to_hf(directory)
    words = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory, model


def test_greedy_equals_transformers_generate(checkpoint):
    directory, model = checkpoint
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    prompts = [[5, 17, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [250]]
    config = InferenceConfig(
        max_batch_size=4,
        max_sequence_length=64,
        block_size=4,
        max_tokens_per_step=16,
        prefill_chunk_size=4,
    )
    with InferenceEngine(model, config) as engine:
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, result in zip(prompts, results):
        expected = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
        )[0, len(prompt) :].tolist()
        assert result.tokens == expected


def test_string_stop_word_with_a_tokenizer(checkpoint):
    directory, model = checkpoint
    config = InferenceConfig(
        max_batch_size=2, max_sequence_length=64, block_size=4, tokenizer_path=str(directory)
    )
    prompt = [3, 9, 27]
    with InferenceEngine(model, config) as engine:
        (free,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
        words = free.text.split(" ")
        stop = f"{words[2]} {words[3]}"
        (stopped,) = engine.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_words=(stop,))
        )
    first = next(i for i in range(len(words) - 1) if f"{words[i]} {words[i + 1]}" == stop)
    assert stopped.finish_reason == FinishReason.STOP_WORD
    assert stopped.tokens == free.tokens[: first + 2]
    assert stopped.text.endswith(stop)


def test_cli_generate_prints_the_engine_result(checkpoint, capsys):
    directory, model = checkpoint
    status = main(
        [
            "generate",
            "--model",
            str(directory),
            "--prompt",
            "w3 w9 w27",
            "w100",
            "--sampling.max-tokens",
            "6",
            "--sampling.temperature",
            "0",
            "--device",
            "cpu",
            "--json",
        ]
    )
    assert status == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [record["prompt"] for record in records] == ["w3 w9 w27", "w100"]
    config = InferenceConfig(max_batch_size=2, max_sequence_length=64)
    with InferenceEngine(model, config) as engine:
        expected = engine.generate(
            [[3, 9, 27], [100]], SamplingParams(temperature=0.0, max_tokens=6)
        )
    eos = json.loads((directory / "config.json").read_text()).get("eos_token_id")
    for record, result in zip(records, expected):
        tokens = result.tokens
        if eos is not None and eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        assert record["tokens"] == tokens
        assert record["text"] == " ".join(f"w{t}" for t in tokens)
        assert record["status"] == "FINISHED"
        assert len(tokens) > 0


def test_cli_options_are_the_configs_with_their_defaults():
    tyro = pytest.importorskip("tyro")
    from mcore_inference.cli import GenerateArgs

    args = tyro.cli(GenerateArgs, args=["--model", "m", "--prompt", "a b", "c"])
    assert args.prompt == ("a b", "c")
    assert args.engine == InferenceConfig()
    assert args.sampling == SamplingParams()
    changed = tyro.cli(
        GenerateArgs,
        args=["--model", "m", "--prompt", "a", "--sampling.top-k", "5", "--engine.block-size", "8"],
    )
    assert changed.sampling.top_k == 5 and changed.engine.block_size == 8


def _cli_on_ranks(argv: list[str]) -> str:
    import contextlib
    import io

    torch.set_num_threads(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    return f"{status}\n{out.getvalue()}"


def test_cli_generate_over_tensor_parallel_ranks_prints_the_single_process_result(checkpoint):
    from mcore_parallel.testing import run_distributed

    directory, _ = checkpoint
    argv = ["generate", "--model", str(directory), "--prompt", "w3 w9 w27", "w100", "w7 w7"]
    argv += ["--sampling.max-tokens", "5", "--sampling.temperature", "0", "--json"]
    outputs = run_distributed(_cli_on_ranks, 2, [*argv, "--tp", "2"], timeout=180)
    single = _cli_on_ranks([*argv, "--device", "cpu"])
    assert outputs[0] == single and single.startswith("0\n") and len(single.splitlines()) == 4
    assert outputs[1] == "0\n"  # rank 0 prints
