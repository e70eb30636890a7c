"""``mcore-inference serve --tp 2`` as a real process (two gloo engine ranks on the CPU), driven
by the official ``openai`` client: answers equal a single-rank ``InferenceEngine.generate`` on the
same checkpoint token for token; disconnects free the blocks on every rank; idle ranks do not
spin; SIGTERM leaves no rank. Also the control protocol itself on two ranks (rank 0's loop and
a follower, heartbeats while idle) and ``InferenceEngine.add_requests``. Failures are in
``test_inference_serve_tensor_parallel_failures.py``.

One server runs for the module (starting one costs the torch import in three processes); its
SIGTERM test runs last.
"""

import asyncio
import contextlib
import os
import signal
import time

import httpx
import openai
import pytest
import torch
from _serve_helpers import (
    CONTEXT,
    MODEL,
    alive,
    cpu_seconds,
    launch,
    long_stream_body,
    reference,
    stop,
    varied_checkpoint,
)
from prometheus_client.parser import text_string_to_metric_families

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.hf_tokenizer import HFTokenizer
from mcore_models import GPTModel


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return varied_checkpoint(tmp_path_factory.mktemp("serve_tp_ckpt"))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """The ``--tp 2`` server: process, base URL, rank pids, startup lines."""
    log = tmp_path_factory.mktemp("serve_tp_log") / "stderr.txt"
    launched = launch(checkpoint, log, "--tp", "2")
    yield launched
    stop(launched[0])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return HFTokenizer(checkpoint)


@pytest.fixture(scope="module")
def engine(checkpoint):
    """The reference: the same checkpoint in a single-rank engine of this process."""
    model = GPTModel.from_hf(checkpoint).eval()
    config = InferenceConfig(max_batch_size=64, max_sequence_length=CONTEXT)
    with InferenceEngine(model, config) as engine:
        yield engine


def _greedy(tokenizer, max_tokens, **fields):
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, stop_token_ids=tokenizer.eos_token_ids, **fields
    )


def _metrics(url):
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels) if labels else sample.name] = sample.value
    return samples


def _rank_blocks(samples):
    name = "mcore_inference_rank_kv_cache_blocks_used"
    return [samples[(name, (("rank", str(rank)),))] for rank in range(2)]


def _wait_for(url, condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = _metrics(url)
        if condition(samples):
            return samples
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}; last metrics: {samples}")


class _Pipe:
    """An engine process's message pipe, in this process: what is sent, in order."""

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def _lockstep_rank(directory, prompts, fifo):
    """One rank of a tp=2 engine driven as the server drives it: rank 0 runs the engine
    process's loop (``_serve``) over a command queue, rank 1 follows its control messages
    (the control pipe is a named FIFO here, since ``run_distributed`` starts both ranks)."""
    import queue
    import threading
    from multiprocessing.connection import Connection

    import torch.distributed as dist

    from mcore_inference.serve.engine_ranks import ControlChannel, follow
    from mcore_inference.serve.engine_worker import _serve
    from mcore_parallel import initialize

    torch.set_num_threads(1)
    state = initialize(tp=2)
    rank = dist.get_rank()
    end = os.open(fifo, os.O_WRONLY if rank == 0 else os.O_RDONLY)
    control = ControlChannel(rank, [Connection(end, readable=rank > 0, writable=rank == 0)])
    model = GPTModel.from_hf(directory, state=state).eval()
    config = InferenceConfig(max_batch_size=4, max_sequence_length=64)
    pipe = _Pipe()
    with InferenceEngine(model, config, state=state) as engine:
        if rank > 0:
            follow(engine, control, pipe)
            control.close()
            return pipe.sent
        commands = queue.SimpleQueue()
        greedy = SamplingParams(temperature=0.0, max_tokens=6)
        long = SamplingParams(temperature=0.0, max_tokens=40)
        commands.put(("add", 0, prompts[0], long))

        def arrive_while_running():
            while not any(m[0] == "step" and m[1] for m in pipe.sent):
                time.sleep(0.005)
            for key, prompt in enumerate(prompts[1:], 1):
                commands.put(("add", key, prompt, greedy))
            commands.put(("abort", 0))  # the long one leaves mid-way
            while sum(len(m[3]) for m in pipe.sent if m[0] == "step") < len(prompts) - 1:
                time.sleep(0.005)
            time.sleep(0.3)  # idle: nothing is sent to the follower
            commands.put(None)

        threading.Thread(target=arrive_while_running, daemon=True).start()
        stopped = _serve(engine, commands, pipe, 0.0, control)
    control.close()
    finals = {key: r.tokens for m in pipe.sent if m[0] == "step" for key, _, _, r in m[3] if r}
    return stopped, finals


def test_follower_steps_with_rank_0_through_arrivals_and_an_abort(checkpoint, engine, tmp_path):
    """The control protocol without HTTP: requests arrive and one is aborted while the ranks
    step; rank 0's answers equal a single-rank engine's, the follower ends with no KV block
    held, and both stop when told."""
    from mcore_parallel.testing import run_distributed

    fifo = tmp_path / "control"
    os.mkfifo(fifo)
    prompts = [[3, 4], [5, 6, 7], [9, 10], [11, 12, 13, 14]]
    (stopped, finals), follower = run_distributed(
        _lockstep_rank, 2, str(checkpoint), prompts, str(fifo), timeout=120
    )
    expected = engine.generate(prompts[1:], SamplingParams(temperature=0.0, max_tokens=6))
    assert stopped and finals == {k: r.tokens for k, r in enumerate(expected, 1)}
    assert follower[-1] == ("blocks", 1, 0)  # the follower reported its blocks freed


def test_startup_prints_tp_every_rank_and_the_whole_model(server, checkpoint):
    process, url, pids, lines = server
    summary = next(line for line in lines if "parameters" in line)
    assert "tp 2" in summary and "cpu+cpu" in summary and "4 heads (2 KV)" in summary
    assert len(pids) == 2 and process.pid not in pids and all(alive(pid) for pid in pids)
    # The count is the whole model's, not rank 0's slices.
    whole = sum(p.numel() for p in GPTModel.from_hf(checkpoint).parameters())
    assert f"{whole / 1e6:.2f}M parameters" in summary
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    models = openai.OpenAI(base_url=f"{url}/v1", api_key="-").models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_greedy_completions_equal_single_rank_generate(client, engine, tokenizer):
    texts = ["What is 3 + 4?", "Compute 12 * 7.", "The answer is"]
    prompts = [tokenizer.encode(t) for t in texts]
    expected = reference(engine, tokenizer, prompts, _greedy(tokenizer, 12, return_logprobs=True))
    for text, prompt, (ref_text, ref_finish, ref) in zip(texts, prompts, expected):
        answer = client.completions.create(
            model=MODEL, prompt=text, max_tokens=12, temperature=0, logprobs=0
        )
        choice = answer.choices[0]
        assert choice.text == ref_text and choice.finish_reason == ref_finish
        assert answer.usage.completion_tokens == len(ref.tokens)
        assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        chunks = list(
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == ref_text
        assert chunks[-1].choices[0].finish_reason == ref_finish


def test_greedy_chat_completion_streamed_equals_single_rank_generate(client, engine, tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ((ref_text, ref_finish, _),) = reference(engine, tokenizer, [prompt], _greedy(tokenizer, 10))
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref_text
    assert chunks[-1].choices[0].finish_reason == ref_finish


def test_seeded_samples_equal_single_rank_generate(client, engine, tokenizer):
    prompt = tokenizer.encode("Let's think step by step.")
    params = [
        SamplingParams(
            temperature=0.9,
            top_p=0.95,
            top_k=40,
            seed=21 + i,
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
        seed=21,
        temperature=0.9,
        top_p=0.95,
        max_tokens=10,
        extra_body={"top_k": 40},
    )
    assert [c.text for c in answer.choices] == [text for text, _, _ in expected]
    assert len({c.text for c in answer.choices}) > 1


def test_concurrent_clients_arriving_mid_step_equal_single_rank_generate(server, engine, tokenizer):
    """Requests join and leave the batch while the ranks step: every rank must add them in
    the same order between the same steps, or the answers (and the ranks) diverge."""
    url = server[1]
    texts = [f"What is {i} + {3 * i}?" for i in range(16)]
    lengths = [3 + (i * 5) % 11 for i in range(16)]
    prompts = [tokenizer.encode(t) for t in texts]
    expected = [
        reference(engine, tokenizer, [p], _greedy(tokenizer, n))[0][:2]
        for p, n in zip(prompts, lengths)
    ]

    async def one(client, i):
        await asyncio.sleep(0.02 * i)
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
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    assert asyncio.run(run_all()) == expected
    samples = _wait_for(url, lambda s: _rank_blocks(s) == [0, 0], "every rank idle")
    assert samples["mcore_inference_requests_running"] == 0


def test_disconnect_mid_stream_frees_the_blocks_on_every_rank(server):
    url = server[1]
    with httpx.stream("POST", f"{url}/v1/completions", json=long_stream_body(2)) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(lines)
        # Both ranks hold the same blocks for the two running requests (the second choice can
        # be admitted an engine step after the first: wait for both).
        _wait_for(
            url,
            lambda s: min(_rank_blocks(s)) > 0 and s["mcore_inference_requests_running"] == 2,
            "both choices running, blocks held on every rank",
            timeout=20,
        )
    samples = _wait_for(url, lambda s: _rank_blocks(s) == [0, 0], "the blocks freed everywhere")
    assert samples["mcore_inference_kv_cache_blocks_used"] == 0
    finished = {k: v for k, v in samples.items() if "finished" in str(k)}
    aborted = samples[("mcore_inference_request_finished_total", (("finish_reason", "abort"),))]
    assert aborted == 2, finished


def test_idle_ranks_do_not_spin(server):
    pids = server[2]
    before = [cpu_seconds(pid) for pid in pids]
    time.sleep(2.0)
    used = [cpu_seconds(pid) - start for pid, start in zip(pids, before)]
    assert max(used) < 0.25, f"CPU seconds of idle ranks over 2 s: {used}"
    assert httpx.get(f"{server[1]}/health").status_code == 200


def test_sigterm_stops_the_server_and_every_rank(server):
    process, url, pids, _ = server
    with httpx.stream("POST", f"{url}/v1/completions", json=long_stream_body()) as response:
        lines = response.iter_lines()
        next(lines)
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(httpx.RemoteProtocolError):
            for _ in lines:
                pass
    assert process.wait(timeout=60) == 0
    assert "mcore-inference serve: stopped" in process.stdout.read()
    with pytest.raises(ProcessLookupError):  # nothing is left of its process group ...
        os.killpg(process.pid, 0)
    assert not any(alive(pid) for pid in pids)  # ... every rank included


def test_add_requests_equals_successive_add_request(checkpoint):
    """The server's batched adds: the same ids, seeds and results as one add_request each."""
    from mcore_inference.errors import InvalidRequestError

    model = GPTModel.from_hf(checkpoint).eval()
    prompts = [[5, 6, 7], [9], [1, 2, 3, 4]]
    params = [SamplingParams(temperature=0.8, max_tokens=6), None, SamplingParams(max_tokens=4)]
    config = InferenceConfig(max_batch_size=4, max_sequence_length=64, seed=3)

    def run(batched):
        with InferenceEngine(model, config) as engine:
            if batched:
                ids = engine.add_requests(prompts, params)
            else:
                ids = [engine.add_request(p, s) for p, s in zip(prompts, params)]
            final = {}
            while engine.has_unfinished():
                for result in engine.step():
                    final[result.request_id] = result.tokens
            with pytest.raises(InvalidRequestError, match="params has 1 entries"):
                engine.add_requests(prompts[:2], params[:1])
        return ids, final

    assert run(batched=True) == run(batched=False)
