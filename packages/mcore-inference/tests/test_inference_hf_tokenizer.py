"""HFTokenizer against transformers on a tiny local checkpoint: chat-template rendering,
encode/decode, special tokens and eos/pad ids; the checkpoint itself loads in both stacks."""

import json

import pytest
import torch

from mcore_inference.errors import TokenizerUnavailableError
from mcore_inference.hf_tokenizer import HFTokenizer
from mcore_inference.testing import SPECIAL_TOKENS, write_tiny_hf_checkpoint, write_tiny_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "What is 12 + 30? The answer is \\boxed{42}.",
    "  leading and  double  spaces\n\nnew lines\tand tabs ",
    "Let's think step by step: 7*6-1=41",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 9 - 4?"},
    ],
    [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "and 2+2?"},
    ],
]

# The shape of real templates: a default system turn, loop controls, namespace, tojson,
# raise_exception and whitespace control; rendered by both stacks for the comparison.
RICH_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = 'You are helpful.' %}"
    "{% set rest = messages %}{% endif %}"
    "<|im_start|>system\n{{ system }}<|im_end|>\n"
    "{% set ns = namespace(turns=0) %}"
    "{% for message in rest %}\n"
    "  {% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
    "  {% if loop.index > 8 %}{% break %}{% endif %}\n"
    "  {% set ns.turns = ns.turns + 1 %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if meta is defined %}{{ meta | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{{ '' if ns.turns else eos_token }}"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), seed=3)


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(
    checkpoint, hf_tokenizer, messages, add_generation_prompt
):
    tokenizer = HFTokenizer(checkpoint)
    expected = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == (
        expected
    )
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    assert ids == hf_tokenizer.encode(expected, add_special_tokens=False)


def test_render_prompt_with_a_system_prompt_equals_transformers(checkpoint, hf_tokenizer):
    tokenizer = HFTokenizer(checkpoint)
    messages = [
        {"role": "system", "content": "Put the answer in \\boxed{}."},
        {"role": "user", "content": "What is 3*4?"},
    ]
    expected = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.render_prompt("What is 3*4?", system_prompt="Put the answer in \\boxed{}.")
    assert prompt == expected
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.encode_prompt(
        "What is 3*4?", system_prompt="Put the answer in \\boxed{}."
    ) == (
        hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def test_a_template_with_controls_and_filters_renders_like_transformers(tmp_path):
    directory = write_tiny_tokenizer(tmp_path, chat_template=RICH_TEMPLATE)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    tokenizer = HFTokenizer(directory)
    for messages in CONVERSATIONS:
        for extra in ({}, {"meta": {"note": "ünïcode", "n": [1, 2]}}):
            expected = hf.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **extra
            )
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra) == (
                expected
            )
    with pytest.raises(TokenizerUnavailableError, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(checkpoint, hf_tokenizer, text):
    tokenizer = HFTokenizer(checkpoint)
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_special_tokens_decode_like_transformers(checkpoint, hf_tokenizer):
    tokenizer = HFTokenizer(checkpoint)
    ids = tokenizer.encode_prompt("What is 2+3?") + tokenizer.encode("5") + [tokenizer.eos_id]
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("5<|im_end|>")


def test_eos_pad_and_vocabulary_come_from_the_checkpoint(checkpoint, hf_tokenizer):
    tokenizer = HFTokenizer(checkpoint)
    generation = transformers.GenerationConfig.from_pretrained(checkpoint)
    assert tokenizer.eos_id == hf_tokenizer.eos_token_id == SPECIAL_TOKENS.index("<|im_end|>")
    assert set(tokenizer.eos_token_ids) == {hf_tokenizer.eos_token_id, *generation.eos_token_id}
    assert tokenizer.pad_id == hf_tokenizer.pad_token_id
    assert tokenizer.vocab_size == len(hf_tokenizer)
    # Ids of a padded model vocabulary beyond the tokenizer's are dropped, not an error.
    assert tokenizer.decode([*tokenizer.encode("7"), tokenizer.vocab_size + 5]) == "7"


def test_eos_falls_back_to_the_generation_config(tmp_path):
    directory = write_tiny_tokenizer(tmp_path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["eos_token"], config["pad_token"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tokenizer = HFTokenizer(directory)
    assert tokenizer.eos_token_ids == (2, 0)
    assert tokenizer.pad_id == 2  # no pad anywhere: the eos pads


def test_chat_template_file_takes_precedence(tmp_path):
    directory = write_tiny_tokenizer(tmp_path)
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tokenizer = HFTokenizer(directory)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_missing_files_and_templates_raise_clear_errors(tmp_path):
    with pytest.raises(TokenizerUnavailableError, match=r"holds no tokenizer\.json"):
        HFTokenizer(tmp_path)
    directory = write_tiny_tokenizer(tmp_path / "plain", chat_template=None)
    tokenizer = HFTokenizer(directory)
    with pytest.raises(TokenizerUnavailableError, match="has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    # Without a template a prompt is the system prompt and the text.
    assert tokenizer.render_prompt("2+2=", system_prompt="Add.") == "Add.\n\n2+2="


def test_tiny_checkpoint_loads_in_transformers_and_mcore_with_the_same_logits(checkpoint):
    from mcore_models import GPTModel

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = GPTModel.from_hf(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([HFTokenizer(checkpoint).encode_prompt("What is 2+3?")])
    with torch.no_grad():
        expected = hf_model(ids).logits
        actual = model(ids)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
