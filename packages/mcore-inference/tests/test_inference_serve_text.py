"""Streamed text of ``mcore_inference.serve.text`` against decoding the whole sequence at once,
with real ``tokenizers`` tokenizers: byte-level BPE (characters split over several tokens) and
Metaspace (a word's leading space depends on what precedes it)."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mcore_inference.serve.text import IncrementalDetokenizer, TextStream

CORPUS = [
    "Grüße aus Köln: 3 € für ein Brötchen",
    "naïve café déjà vu — ça va?",
    "日本語のテキストと emoji 🎉🚀 mixed in",
    "The answer is 42. What is 6 * 7?",
]


def _byte_level():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def _metaspace():
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request):
    return _byte_level() if request.param == "byte_level" else _metaspace()


def _decoder(tokenizer):
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def _cases(tokenizer, count=40, seed=0):
    """(prompt ids, output ids) pairs cut from the corpus at random token positions."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        ids = tokenizer.encode(rng.choice(CORPUS)).ids
        cut = rng.randint(1, len(ids) - 1)
        cases.append((ids[:cut], ids[cut:]))
    return cases


def _completion(decode, prompt, output):
    """The text past what the prompt alone decodes to (a prompt that ends in half a character
    shares only the part before it)."""
    full, alone = decode(prompt + output), decode(prompt)
    shared = next((i for i, (a, b) in enumerate(zip(full, alone)) if a != b), len(alone))
    return full[shared:]


def test_streamed_text_equals_the_suffix_of_the_whole_decode(tokenizer):
    decode = _decoder(tokenizer)
    for prompt, output in _cases(tokenizer):
        detokenizer = IncrementalDetokenizer(decode, prompt)
        pieces = [detokenizer.push(token) for token in output]
        pieces.append(detokenizer.flush())
        # The completion is the text past what the prompt alone decodes to (a prompt that ends
        # in half a character shares only the part before it).
        assert "".join(pieces) == _completion(decode, prompt, output)
        assert not any("\ufffd" in piece for piece in pieces)


def test_a_character_split_over_tokens_is_held_until_complete():
    tokenizer = _byte_level()
    decode = _decoder(tokenizer)
    # A 4-byte emoji that byte-level BPE spells with several tokens.
    ids = tokenizer.encode("🎉").ids
    assert len(ids) > 1 and "\ufffd" in decode(ids[:1])
    detokenizer = IncrementalDetokenizer(decode)
    pieces = [detokenizer.push(token) for token in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🎉"


def _stream(tokenizer, prompt, output, stop):
    stream = TextStream(_decoder(tokenizer), prompt, stop)
    pieces, used = [], None
    for k, token in enumerate(output):
        pieces.append(stream.push(token))
        if stream.stopped:
            used = k + 1
            break
    pieces.append(stream.finish())
    return "".join(pieces), used


def test_stop_strings_cut_the_text_before_the_first_one(tokenizer):
    decode = _decoder(tokenizer)
    rng = random.Random(1)
    for prompt, output in _cases(tokenizer, seed=2):
        whole = _completion(decode, prompt, output)
        if len(whole) < 4:
            continue
        start = rng.randrange(len(whole) - 2)
        stops = [whole[start : start + rng.randint(1, 3)], "never there"]
        text, used = _stream(tokenizer, prompt, output, stops)
        first = min(i for i in (whole.find(s) for s in stops) if i >= 0)
        assert text == whole[:first]
        # It stops at the first token after which the text holds a stop string; text is only
        # released once it ends in a whole character.
        prefixes = (_completion(decode, prompt, output[:k]) for k in range(1, len(output) + 1))
        expected = 1 + next(
            k
            for k, text in enumerate(prefixes)
            if not text.endswith("\ufffd") and any(s in text for s in stops)
        )
        assert used == expected


def test_text_that_may_begin_a_stop_string_is_held_back_then_released():
    tokenizer = _byte_level()
    ids = tokenizer.encode("The answer is 42. What").ids
    stream = TextStream(_decoder(tokenizer), (), ["42!"])
    emitted = "".join(stream.push(token) for token in ids)
    # "42" could have grown into "42!" until "." came; no text is lost at the end.
    assert emitted + stream.finish() == "The answer is 42. What"
    assert not stream.stopped
    held = TextStream(_decoder(tokenizer), (), ["is 4"])
    assert "".join(held.push(t) for t in tokenizer.encode("The answer is").ids) == "The answer "
    assert held.finish() == "is"
