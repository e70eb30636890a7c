"""``mcore-inference serve`` as a real process on a free port, driven by the official ``openai``
client (and httpx for raw HTTP), with the engine in one child process (``--tp 1``) and split over
two gloo ranks (``--tp 2``): answers equal a single-rank ``InferenceEngine.generate`` on the same
checkpoint token for token; concurrency, disconnects (the blocks freed on every rank),
back-pressure, bad requests, metrics and SIGTERM (no engine process left).

One server of each size runs for the whole module (starting one costs the torch import in every
process); the SIGTERM test stops it and runs last. The tests of the HTTP front end alone (bad
requests, a full queue) run against the ``--tp 1`` server only. ``--tp`` failures are in
``test_inference_serve_tensor_parallel_failures.py``, the ranks' control protocol without HTTP in
``test_inference_serve_engine_ranks.py``.
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
from _serve_helpers import (
    CONTEXT,
    MAX_BATCH,
    MODEL,
    aborted,
    alive,
    cpu_seconds,
    greedy,
    launch,
    long_stream_body,
    metrics,
    rank_blocks,
    reference,
    stop,
    wait_for,
)

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.hf_tokenizer import HFTokenizer
from mcore_models import GPTModel

MAX_WAITING = 48

single_rank = pytest.mark.parametrize("server", [1], indirect=True, ids=["tp1"])
"""For the tests of what the HTTP front end does alone, the same for every ``--tp``."""


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request, serve_checkpoint, tmp_path_factory):
    """The server with ``--tp`` of the parameter (its engine in child processes)."""
    log = tmp_path_factory.mktemp(f"serve_tp{request.param}") / "stderr.txt"
    options = ("--tp", str(request.param), "--max-waiting-requests", str(MAX_WAITING))
    server = launch(serve_checkpoint, log, *options)
    yield server
    stop(server.process)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(serve_checkpoint):
    return HFTokenizer(serve_checkpoint)


@pytest.fixture(scope="module")
def engine(serve_checkpoint):
    """The reference: the same checkpoint in a single-rank engine of this process."""
    model = GPTModel.from_hf(serve_checkpoint).eval()
    config = InferenceConfig(max_batch_size=64, max_sequence_length=CONTEXT)
    with InferenceEngine(model, config) as engine:
        yield engine


def test_startup_prints_the_address_and_the_model_summary(server, serve_checkpoint):
    tp, summary = len(server.pids), server.summary
    assert "Qwen2ForCausalLM" in summary and "2 layers" in summary and "vocab 160" in summary
    assert "4 heads (2 KV)" in summary and f"on {'+'.join(['cpu'] * tp)}, tp {tp};" in summary
    # The count is the whole model's, not rank 0's slices.
    whole = sum(p.numel() for p in GPTModel.from_hf(serve_checkpoint).parameters())
    assert f"{whole / 1e6:.2f}M parameters" in summary
    # The engine runs in child processes, one per rank.
    assert server.process.pid not in server.pids and all(alive(pid) for pid in server.pids)
    assert server.url.startswith("http://127.0.0.1:")
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_greedy_completions_equal_engine_generate(client, engine, tokenizer):
    texts = ["What is 3 + 4?", "Compute 12 * 7.", "The answer is"]
    prompts = [tokenizer.encode(t) for t in texts]
    expected = reference(engine, tokenizer, prompts, greedy(tokenizer, 12, return_logprobs=True))
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
    expected = reference(engine, tokenizer, prompts, greedy(tokenizer, 10, return_logprobs=True))
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


def test_fifty_concurrent_clients_arriving_mid_step_all_finish(server, engine, tokenizer):
    """Fifty clients, half of them streaming: 25 at once (more than a batch: they queue), then
    25 one by one, joining and leaving the batch while the engine steps. With ``--tp 2`` every
    rank must add them in the same order between the same steps, or the answers (and the ranks)
    diverge."""
    texts = [f"What is {i} + {2 * i}?" for i in range(50)]
    lengths = [3 + (i * 5) % 11 for i in range(50)]
    prompts = [tokenizer.encode(t) for t in texts]
    params = [greedy(tokenizer, n) for n in lengths]
    expected = [(text, finish) for text, finish, _ in reference(engine, tokenizer, prompts, params)]

    async def one(client, i):
        await asyncio.sleep(0.02 * max(0, i - 24))
        if i % 2:
            answer = await client.completions.create(
                model=MODEL, prompt=texts[i], max_tokens=lengths[i], temperature=0
            )
            return answer.choices[0].text, answer.choices[0].finish_reason
        stream = await client.completions.create(
            model=MODEL, prompt=texts[i], max_tokens=lengths[i], temperature=0, stream=True
        )
        chunks = [chunk.choices[0] async for chunk in stream]
        return "".join(c.text for c in chunks), chunks[-1].finish_reason

    async def run_all():
        base_url = f"{server.url}/v1"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    assert asyncio.run(run_all()) == expected
    tp = len(server.pids)
    samples = wait_for(server.url, lambda s: rank_blocks(s, tp) == [0] * tp, "every rank idle")
    assert samples["mcore_inference_requests_running"] == 0
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


@single_rank
@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_request_gets_400_naming_the_field(server, path, body, param):
    response = httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param.split(".")[0].split("[")[0] in error["message"]


@single_rank
def test_openai_client_raises_bad_request_error_and_unknown_model_is_404(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other", prompt="hi")
    assert info.value.body["param"] == "model"
    response = httpx.post(f"{server.url}/v1/completions", content=b"{not json")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_disconnect_mid_stream_aborts_and_frees_the_blocks_on_every_rank(server):
    url, tp = server.url, len(server.pids)
    before = metrics(url)
    body = long_stream_body(2)
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        # NOTE: keep the line iterator alive: dropping it closes httpx's stream (a disconnect).
        lines = response.iter_lines()
        first = next(lines)
        assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
        # Every rank holds blocks for the two running choices (the second choice can be
        # admitted an engine step after the first: wait for both).
        wait_for(
            url,
            lambda s: min(rank_blocks(s, tp)) > 0 and s["mcore_inference_requests_running"] == 2,
            "both choices running, blocks held on every rank",
            timeout=20,
        )
    # The connection is closed: the server aborts both choices and their blocks come back.
    samples = wait_for(url, lambda s: rank_blocks(s, tp) == [0] * tp, "the blocks freed everywhere")
    assert samples["mcore_inference_kv_cache_blocks_used"] == 0
    assert samples["mcore_inference_requests_running"] == 0
    assert aborted(samples) == aborted(before) + 2
    generated = samples["mcore_inference_generation_tokens_total"]
    assert generated - before["mcore_inference_generation_tokens_total"] < 2 * body["max_tokens"]


def test_disconnect_while_waiting_for_a_plain_answer_aborts_it(server):
    body = dict(long_stream_body(), stream=False)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=0.5))
    samples = wait_for(
        server.url,
        lambda s: s["mcore_inference_kv_cache_blocks_used"] == 0,
        "the blocks to be freed",
    )
    assert samples["mcore_inference_requests_waiting"] == 0


@single_rank
def test_full_queue_answers_503_with_a_clear_body(server):
    url = server.url
    waiting = MAX_WAITING - 8
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=long_stream_body(MAX_BATCH + waiting)
    ) as response:
        assert response.status_code == 200
        wait_for(
            url,
            lambda s: (
                s["mcore_inference_requests_running"] == MAX_BATCH
                and s["mcore_inference_requests_waiting"] == waiting
            ),
            "a full batch and a queue",
        )
        over = httpx.post(f"{url}/v1/completions", json=dict(long_stream_body(9), stream=False))
        assert over.status_code == 503
        assert over.headers["retry-after"] == "1"
        error = over.json()["error"]
        assert error["type"] == "server_overloaded"
        assert f"max_waiting_requests={MAX_WAITING}" in error["message"]
        # What still fits is queued (behind the long requests, first come first served).
        with httpx.stream("POST", f"{url}/v1/completions", json=long_stream_body(8)) as fits:
            assert fits.status_code == 200
            wait_for(
                url, lambda s: s["mcore_inference_requests_waiting"] == MAX_WAITING, "a full queue"
            )
    wait_for(
        url,
        lambda s: (
            s["mcore_inference_kv_cache_blocks_used"] == 0
            and s["mcore_inference_requests_waiting"] == 0
        ),
        "an idle engine after the disconnect",
    )


@pytest.mark.parametrize("server", [2], indirect=True, ids=["tp2"])
def test_idle_ranks_do_not_spin(server):
    before = [cpu_seconds(pid) for pid in server.pids]
    time.sleep(2.0)
    used = [cpu_seconds(pid) - start for pid, start in zip(server.pids, before)]
    assert max(used) < 0.25, f"CPU seconds of idle ranks over 2 s: {used}"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_engine_on_a_thread_serves_the_same_completions(
    serve_checkpoint, engine, tokenizer, tmp_path
):
    server = launch(serve_checkpoint, tmp_path / "stderr.txt", "--no-engine-process")
    try:
        assert "engine on a thread of the server" in server.summary
        assert server.pids == [server.process.pid]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        prompt = tokenizer.encode("The answer is")
        ((ref_text, ref_finish, _),) = reference(engine, tokenizer, [prompt], greedy(tokenizer, 12))
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == ref_text
        assert chunks[-1].choices[0].finish_reason == ref_finish
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
    finally:
        stop(server.process)


def test_sigterm_stops_the_server_and_every_engine_process(server):
    process, url = server.process, server.url
    assert all(alive(pid) for pid in server.pids)
    with httpx.stream("POST", f"{url}/v1/completions", json=long_stream_body()) as response:
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
    for pid in server.pids:  # ... every engine process included (not even a zombie)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
