"""``mcore-inference serve`` as a real process on a free port, driven by the official ``openai``
client (and httpx for raw HTTP): answers equal ``InferenceEngine.generate`` on the same
checkpoint; concurrency, disconnects, back-pressure, bad requests, metrics and SIGTERM.

One server runs for the whole module (starting one costs the torch import); the SIGTERM test
stops it and runs last.
"""

import asyncio
import contextlib
import json
import os
import signal
import time

import httpx
import openai
import pytest
import torch
from _serve_helpers import reference, start, varied_checkpoint
from prometheus_client.parser import text_string_to_metric_families

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.hf_tokenizer import HFTokenizer
from mcore_models import GPTModel

MODEL = "tiny"
MAX_BATCH = 8
MAX_WAITING = 48
CONTEXT = 2048


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    # Tiny matmuls only lose to thread start-up and spinning on a shared 2-core machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2 checkpoint whose weights are large enough for varied greedy text."""
    return varied_checkpoint(tmp_path_factory.mktemp("serve_ckpt"), seed=0)


def _launch(checkpoint, log, *options):
    """Start ``mcore-inference serve`` in a new session; its process, URL and startup lines."""
    return start(checkpoint, log, "--max-waiting-requests", str(MAX_WAITING), *options, model=MODEL)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """The server process (engine in a child process), its base URL and its startup lines."""
    log = tmp_path_factory.mktemp("serve_log") / "stderr.txt"
    process, url, lines = _launch(checkpoint, log)
    yield process, url, lines
    if process.poll() is None:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return HFTokenizer(checkpoint)


@pytest.fixture(scope="module")
def engine(checkpoint):
    """The reference: the same checkpoint in an engine of this process."""
    model = GPTModel.from_hf(checkpoint).eval()
    config = InferenceConfig(max_batch_size=64, max_sequence_length=CONTEXT)
    with InferenceEngine(model, config) as engine:
        yield engine


def _greedy(tokenizer, max_tokens, **fields):
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        stop_token_ids=tokenizer.eos_token_ids,
        **fields,
    )


def _metrics(url):
    """Samples of /metrics by name, labels other than the model's as a sorted tuple."""
    text = httpx.get(f"{url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels) if labels else sample.name] = sample.value
    return samples


def _wait_for(url, condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = _metrics(url)
        if condition(samples):
            return samples
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}; last metrics: {samples}")


def _engine_pid(lines):
    summary = next(line for line in lines if "parameters" in line)
    return int(summary.split("engine in process ")[1].split()[0])


def test_startup_prints_the_address_and_the_model_summary(server):
    process, url, lines = server
    summary = next(line for line in lines if "parameters" in line)
    assert "Qwen2ForCausalLM" in summary and "2 layers" in summary and "vocab 160" in summary
    assert _engine_pid(lines) != process.pid  # the engine runs in a child process
    assert url.startswith("http://127.0.0.1:")
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_greedy_completions_equal_engine_generate(client, engine, tokenizer):
    texts = ["What is 3 + 4?", "Compute 12 * 7.", "The answer is"]
    prompts = [tokenizer.encode(t) for t in texts]
    expected = reference(engine, tokenizer, prompts, _greedy(tokenizer, 12, return_logprobs=True))
    for text, prompt, (ref_text, ref_finish, ref) in zip(texts, prompts, expected):
        answer = client.completions.create(
            model=MODEL, prompt=text, max_tokens=12, temperature=0, logprobs=0
        )
        choice = answer.choices[0]
        assert choice.text == ref_text
        assert choice.finish_reason == ref_finish
        assert answer.usage.prompt_tokens == len(prompt)
        assert answer.usage.completion_tokens == len(ref.tokens)
        assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert "".join(choice.logprobs.tokens) == tokenizer.decode(
            ref.tokens, skip_special_tokens=False
        )
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt,  # token ids this time
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref_text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref_finish
        assert chunks[-1].usage.completion_tokens == len(ref.tokens)


def test_greedy_chat_completions_equal_engine_generate(client, engine, tokenizer):
    conversations = [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Solve 9 - 4."},
        ],
    ]
    prompts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
        for c in conversations
    ]
    expected = reference(engine, tokenizer, prompts, _greedy(tokenizer, 10, return_logprobs=True))
    for messages, prompt, (ref_text, ref_finish, ref) in zip(conversations, prompts, expected):
        answer = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True
        )
        choice = answer.choices[0]
        assert choice.message.role == "assistant"
        assert choice.message.content == ref_text
        assert choice.finish_reason == ref_finish
        assert answer.usage.prompt_tokens == len(prompt)
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(ref.logprobs, abs=1e-4)
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref_text
        assert chunks[-1].choices[0].finish_reason == ref_finish


def test_n_seeded_samples_equal_engine_generate_with_seed_plus_index(client, engine, tokenizer):
    prompt = tokenizer.encode("Let's think step by step.")
    params = [
        SamplingParams(
            temperature=0.9,
            top_p=0.95,
            top_k=40,
            seed=11 + i,
            max_tokens=10,
            stop_token_ids=tokenizer.eos_token_ids,
        )
        for i in range(3)
    ]
    expected = reference(engine, tokenizer, [prompt] * 3, params)
    answer = client.completions.create(
        model=MODEL,
        prompt=prompt,
        n=3,
        seed=11,
        temperature=0.9,
        top_p=0.95,
        max_tokens=10,
        extra_body={"top_k": 40},
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in answer.choices] == [text for text, _, _ in expected]
    assert len({c.text for c in answer.choices}) > 1  # the seeds differ, so do the samples
    assert answer.usage.completion_tokens == sum(len(r.tokens) for _, _, r in expected)


def test_stop_string_ends_the_text_before_it(client, engine, tokenizer):
    prompt = tokenizer.encode("What is 5 + 8?")
    ((free_text, _, free),) = reference(
        engine, tokenizer, [prompt], SamplingParams(temperature=0.0, max_tokens=24)
    )
    # A two-character stop string whose first occurrence is well inside the text.
    start = next(
        i for i in range(4, len(free_text) - 2) if free_text.find(free_text[i : i + 2]) == i
    )
    stop = free_text[start : start + 2]
    for stream in (False, True):
        answer = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stop=[stop, "never-generated"],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        choices = [c.choices[0] for c in answer] if stream else answer.choices
        assert "".join(c.text for c in choices) == free_text[:start]
        assert choices[-1].finish_reason == "stop"
        if not stream:  # tokens are counted up to the one that completes the stop string
            used = next(k for k in range(1, 25) if stop in tokenizer.decode(free.tokens[:k]))
            assert answer.usage.completion_tokens == used


def test_fifty_concurrent_clients_all_finish(server, engine, tokenizer):
    url = server[1]
    texts = [f"What is {i} + {2 * i}?" for i in range(50)]
    expected = reference(
        engine, tokenizer, [tokenizer.encode(t) for t in texts], _greedy(tokenizer, 6)
    )

    async def one(client, i):
        if i % 2:
            answer = await client.completions.create(
                model=MODEL, prompt=texts[i], max_tokens=6, temperature=0
            )
            return answer.choices[0].text, answer.choices[0].finish_reason
        stream = await client.completions.create(
            model=MODEL, prompt=texts[i], max_tokens=6, temperature=0, stream=True
        )
        chunks = [chunk.choices[0] async for chunk in stream]
        return "".join(c.text for c in chunks), chunks[-1].finish_reason

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    answers = asyncio.run(run_all())
    assert answers == [(text, finish) for text, finish, _ in expected]
    samples = _wait_for(url, lambda s: s["mcore_inference_requests_running"] == 0, "idle engine")
    assert samples["mcore_inference_kv_cache_blocks_used"] == 0


BAD_REQUESTS = [
    ("completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": CONTEXT}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": 3}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "seed": -1}, "seed"),
    ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"prompt": [1, 2, 100000]}, "prompt"),
    ("completions", {"prompt": "x", "logprobs": 3}, "logprobs"),
    ("completions", {"prompt": "x", "best_of": 4}, "best_of"),
    ("completions", {"prompt": "x", "frobnicate": True}, "frobnicate"),
    ("completions", {}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].type",
    ),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": "x"}, "top_k"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, "tools"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_request_gets_400_naming_the_field(server, path, body, param):
    response = httpx.post(f"{server[1]}/v1/{path}", json={"model": MODEL, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param.split(".")[0].split("[")[0] in error["message"]


def test_openai_client_raises_bad_request_error_and_unknown_model_is_404(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other", prompt="hi")
    assert info.value.body["param"] == "model"
    response = httpx.post(f"{server[1]}/v1/completions", content=b"{not json")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def _long_stream_body(n=1):
    return {
        "model": MODEL,
        "prompt": "Compute",
        "max_tokens": 1500,
        "n": n,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }


def test_disconnect_mid_stream_aborts_and_frees_the_blocks(server):
    url = server[1]
    before = _metrics(url)
    aborted_before = before.get(
        ("mcore_inference_request_finished_total", (("finish_reason", "abort"),)), 0
    )
    with httpx.stream("POST", f"{url}/v1/completions", json=_long_stream_body()) as response:
        assert response.status_code == 200
        # NOTE: keep the line iterator alive: dropping it closes httpx's stream (a disconnect).
        lines = response.iter_lines()
        first = next(lines)
        assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
        busy = _metrics(url)
        assert busy["mcore_inference_requests_running"] == 1
        assert busy["mcore_inference_kv_cache_blocks_used"] > 0
    # The connection is closed: the server aborts the request and its blocks come back.
    samples = _wait_for(
        url, lambda s: s["mcore_inference_kv_cache_blocks_used"] == 0, "the blocks to be freed"
    )
    assert samples["mcore_inference_requests_running"] == 0
    aborted = samples[("mcore_inference_request_finished_total", (("finish_reason", "abort"),))]
    assert aborted == aborted_before + 1
    generated = samples["mcore_inference_generation_tokens_total"]
    assert generated - before["mcore_inference_generation_tokens_total"] < 1500


def test_disconnect_while_waiting_for_a_plain_answer_aborts_it(server):
    url = server[1]
    body = dict(_long_stream_body(), stream=False)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=0.5))
    samples = _wait_for(
        url, lambda s: s["mcore_inference_kv_cache_blocks_used"] == 0, "the blocks to be freed"
    )
    assert samples["mcore_inference_requests_waiting"] == 0


def test_full_queue_answers_503_with_a_clear_body(server):
    url = server[1]
    waiting = MAX_WAITING - 8
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=_long_stream_body(MAX_BATCH + waiting)
    ) as response:
        assert response.status_code == 200
        _wait_for(
            url,
            lambda s: (
                s["mcore_inference_requests_running"] == MAX_BATCH
                and s["mcore_inference_requests_waiting"] == waiting
            ),
            "a full batch and a queue",
        )
        over = httpx.post(f"{url}/v1/completions", json=dict(_long_stream_body(9), stream=False))
        assert over.status_code == 503
        assert over.headers["retry-after"] == "1"
        error = over.json()["error"]
        assert error["type"] == "server_overloaded"
        assert f"max_waiting_requests={MAX_WAITING}" in error["message"]
        # What still fits is queued (behind the long requests, first come first served).
        with httpx.stream("POST", f"{url}/v1/completions", json=_long_stream_body(8)) as fits:
            assert fits.status_code == 200
            _wait_for(
                url, lambda s: s["mcore_inference_requests_waiting"] == MAX_WAITING, "a full queue"
            )
    _wait_for(
        url,
        lambda s: (
            s["mcore_inference_kv_cache_blocks_used"] == 0
            and s["mcore_inference_requests_waiting"] == 0
        ),
        "an idle engine after the disconnect",
    )


def test_engine_on_a_thread_serves_the_same_completions(checkpoint, engine, tokenizer, tmp_path):
    process, url, lines = _launch(checkpoint, tmp_path / "stderr.txt", "--no-engine-process")
    try:
        assert "engine on a thread of the server" in " ".join(lines)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        prompt = tokenizer.encode("The answer is")
        ((ref_text, ref_finish, _),) = reference(
            engine, tokenizer, [prompt], _greedy(tokenizer, 12)
        )
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == ref_text
        assert chunks[-1].choices[0].finish_reason == ref_finish
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_stops_the_server_cleanly(server):
    process, url, lines = server
    engine = _engine_pid(lines)
    os.kill(engine, 0)  # the engine process runs
    with httpx.stream("POST", f"{url}/v1/completions", json=_long_stream_body()) as response:
        lines = response.iter_lines()
        next(lines)
        process.send_signal(signal.SIGTERM)
        # The in-flight stream gets --timeout-graceful-shutdown (2 s) to finish, then it is cut.
        with contextlib.suppress(httpx.RemoteProtocolError):
            for _ in lines:
                pass
    assert process.wait(timeout=60) == 0
    assert "mcore-inference serve: stopped" in process.stdout.read()
    with pytest.raises(ProcessLookupError):  # nothing is left of its process group ...
        os.killpg(process.pid, 0)
    with pytest.raises(ProcessLookupError):  # ... the engine process included
        os.kill(engine, 0)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
