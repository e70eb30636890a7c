"""The control protocol of ``serve --tp 2`` without HTTP: rank 0 runs the engine process's loop
over a command queue and a follower rank steps with it (two gloo ranks on the CPU); rank 0's
answers equal a single-rank engine's and the follower ends with no KV block held. The whole
server is tested in ``test_inference_serve_http.py``.
"""

import os
import time

import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_models import GPTModel


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


def test_follower_steps_with_rank_0_through_arrivals_and_an_abort(serve_checkpoint, tmp_path):
    """Requests arrive and one is aborted while the ranks step: rank 0's answers equal a
    single-rank engine's, the follower ends with no KV block held, and both stop when told."""
    from mcore_parallel.testing import run_distributed

    fifo = tmp_path / "control"
    os.mkfifo(fifo)
    prompts = [[3, 4], [5, 6, 7], [9, 10], [11, 12, 13, 14]]
    (stopped, finals), follower = run_distributed(
        _lockstep_rank, 2, str(serve_checkpoint), prompts, str(fifo), timeout=120
    )
    model = GPTModel.from_hf(serve_checkpoint).eval()
    with InferenceEngine(model, InferenceConfig(max_batch_size=4, max_sequence_length=64)) as ref:
        expected = ref.generate(prompts[1:], SamplingParams(temperature=0.0, max_tokens=6))
    assert stopped and finals == {k: r.tokens for k, r in enumerate(expected, 1)}
    assert follower[-1] == ("blocks", 1, 0)  # the follower reported its blocks freed
