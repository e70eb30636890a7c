"""``mcore-inference serve --tp 2`` on two GPUs (NCCL ranks on cuda:0 and cuda:1): greedy answers
equal a direct ``tp=2`` engine's, token for token (same kernels, same CUDA graphs), and SIGTERM
ends the server and both ranks. Needs the ``serve`` and ``cli`` extras (no openai client).
"""

import signal

import pytest
import torch
from _serve_helpers import MAX_BATCH, MODEL, alive, launch, stop, varied_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
NEW_TOKENS = 24
CONTEXT = 256


def _direct_tp(directory: str, eos: tuple[int, ...]) -> list[list[int]]:
    """Each prompt generated alone by a direct tp=2 engine (a rank of ``run_distributed``),
    stopping at the checkpoint's end-of-sequence ids as the server does."""
    from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
    from mcore_models import GPTModel
    from mcore_parallel import initialize

    state = initialize(tp=2)
    model = GPTModel.from_hf(directory, state=state, device=state.device).eval()
    config = InferenceConfig(max_batch_size=MAX_BATCH, max_sequence_length=CONTEXT)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=eos)
    with InferenceEngine(model, config, state=state) as engine:
        engine.capture_graphs()
        tokens = [engine.generate([prompt], params)[0].tokens for prompt in PROMPTS]
    state.destroy()
    return tokens


def test_tp2_server_on_two_gpus_equals_a_direct_tp2_engine_and_stops_cleanly(tmp_path):
    import httpx

    from mcore_inference.hf_tokenizer import HFTokenizer
    from mcore_parallel.testing import run_distributed

    directory = varied_checkpoint(tmp_path / "ckpt", seed=2)
    tokenizer = HFTokenizer(directory)
    eos = tuple(tokenizer.eos_token_ids)
    expected = run_distributed(_direct_tp, 2, str(directory), eos, backend="nccl", timeout=300)[0]
    server = launch(directory, tmp_path / "stderr.txt", "--tp", "2", device="cuda", context=CONTEXT)
    try:
        assert "cuda:0+cuda:1, tp 2" in server.summary
        for prompt, tokens in zip(PROMPTS, expected):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
            answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
            assert answer["choices"][0]["text"] == tokenizer.decode(tokens)
            assert answer["usage"]["completion_tokens"] == len(tokens)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=120) == 0
        assert len(server.pids) == 2 and not any(alive(pid) for pid in server.pids)
    finally:
        stop(server.process)
