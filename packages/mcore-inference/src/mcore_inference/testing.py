"""Tiny Hugging Face checkpoints for tests: a random Qwen2 or Llama, a tokenizer, a chat template.

The machines that run the tests have no internet, so a test that needs "a Hugging Face model
directory" builds one here: transformers writes a random tiny model with ``save_pretrained``
and the ``tokenizers`` package trains a small BPE tokenizer whose files (``tokenizer.json``,
``tokenizer_config.json`` with a ChatML chat template, ``generation_config.json``) have the
layout of a real instruct checkpoint. Code that reads such a directory therefore works
unchanged on a downloaded model. Needs ``transformers`` and ``tokenizers`` (extra ``testing``).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CHAT_TEMPLATE",
    "PRETOKENIZE_REGEX",
    "SPECIAL_TOKENS",
    "build_tiny_tokenizer",
    "random_prompts",
    "write_tiny_tokenizer",
    "write_tiny_hf_checkpoint",
]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Special tokens of the tiny tokenizer, ids 0 to 2: document end (also padding), ChatML turn
start and end (the end is the eos of a reply), as in Qwen2.5 instruct checkpoints."""

PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenizer split: words, single digits, punctuation runs, whitespace."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
"""ChatML, the template shape of Qwen2.5 instruct models (without their default system turn)."""


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = [
        "system",
        "user",
        "assistant",
        "What is",
        "The answer is",
        "Answer:",
        "Solve",
        "Compute",
        "You are a helpful assistant.",
        "\\boxed{",
        "Let's think step by step.",
    ]
    lines = list(words) * 20
    for _ in range(400):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        result = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"What is {a} {op} {b}? The answer is {result}.")
    return lines


def build_tiny_tokenizer(vocab_size: int = 160, *, seed: int = 0) -> Any:
    """Trains a small byte-level BPE tokenizer built like Qwen2's.

    The pipeline is Qwen2's (NFC, the :data:`PRETOKENIZE_REGEX` split that keeps every digit
    a token, byte-level BPE, byte-level decoding), so transformers' ``Qwen2Tokenizer`` rebuilt
    from the same vocabulary and merges encodes identically. To keep the vocabulary small the
    byte alphabet holds only printable ASCII (other characters are dropped when encoded);
    merges learnt from a small arithmetic/chat corpus make common words single tokens. Ids 0-2
    are :data:`SPECIAL_TOKENS`.

    Args:
        vocab_size: Size of the vocabulary (the ~100 printable ASCII bytes, the special tokens
            and the merges).
        seed: Seed of the training corpus.

    Returns:
        A ``tokenizers.Tokenizer``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"), byte_level]
    )
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = sorted({byte_level.pre_tokenize_str(ch)[0][0] for ch in string.printable})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    return tokenizer


def write_tiny_tokenizer(
    directory: str | Path, *, vocab_size: int = 160, chat_template: str | None = CHAT_TEMPLATE
) -> Path:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` of :func:`build_tiny_tokenizer`.

    Args:
        directory: Output directory (created if missing).
        vocab_size: Vocabulary size of the tokenizer.
        chat_template: The jinja2 chat template stored in ``tokenizer_config.json``; None
            writes none.

    Returns:
        The directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(vocab_size)
    tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def write_tiny_hf_checkpoint(
    directory: str | Path,
    *,
    arch: Literal["qwen2", "llama"] = "qwen2",
    hidden_size: int = 32,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 64,
    vocab_size: int = 160,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    chat_template: str | None = CHAT_TEMPLATE,
    seed: int = 0,
) -> Path:
    """Writes a random tiny Qwen2 or Llama with transformers, plus its tokenizer files.

    The directory holds ``config.json``, ``model.safetensors``, ``generation_config.json``
    (eos ids ``<|im_end|>`` and ``<|endoftext|>``, pad ``<|endoftext|>``), ``tokenizer.json``
    and ``tokenizer_config.json``: the layout of a Qwen2.5 instruct checkpoint.

    Args:
        directory: Output directory (created if missing).
        arch: ``qwen2`` (QKV bias) or ``llama``.
        hidden_size: Hidden size.
        num_layers: Decoder layers.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads.
        intermediate_size: MLP width.
        vocab_size: Vocabulary of the tokenizer and the model.
        max_position_embeddings: Longest sequence of the model config.
        tie_word_embeddings: Whether the output layer shares the embedding.
        chat_template: Chat template of ``tokenizer_config.json`` (None: none).
        seed: Seed of the random weights.

    Returns:
        The directory.

    Raises:
        ValueError: If ``arch`` is not ``qwen2`` or ``llama``.
    """
    import torch
    import transformers

    if arch not in ("qwen2", "llama"):
        raise ValueError(f"arch={arch!r} is unknown, expected 'qwen2' or 'llama'")
    directory = write_tiny_tokenizer(directory, vocab_size=vocab_size, chat_template=chat_template)
    endoftext, im_end = SPECIAL_TOKENS.index("<|endoftext|>"), SPECIAL_TOKENS.index("<|im_end|>")
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": endoftext,
        "eos_token_id": im_end,
        "pad_token_id": endoftext,
        "rms_norm_eps": 1e-6,
    }
    if arch == "qwen2":
        config: Any = transformers.Qwen2Config(**common)
        model_class: Any = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext
    )
    model.save_pretrained(directory)
    return directory


def random_prompts(
    count: int, *, seed: int = 0, max_len: int = 40, vocab_size: int = 512
) -> list[list[int]]:
    """Return ``count`` random prompts of 1 to ``max_len - 1`` token ids, reproducible by seed.

    Args:
        count: Number of prompts.
        seed: Seed of the CPU generator that draws the lengths and the tokens.
        max_len: Exclusive upper bound of the prompt lengths.
        vocab_size: Exclusive upper bound of the token ids.

    Returns:
        The prompts, each a list of token ids.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (count,), generator=generator).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]
