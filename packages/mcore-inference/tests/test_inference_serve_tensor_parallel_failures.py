"""``mcore-inference serve --tp 2`` when things go wrong: a server killed with SIGKILL leaves no
rank, a rank that crashes fails the requests loudly (503 naming it) instead of hanging, ranks
that cannot load the checkpoint end the server with one line, and a ``--tp`` that does not fit
the model or the machine is refused before anything starts.
"""

import contextlib
import json
import os
import signal
import subprocess

import httpx
import pytest
import torch
from _serve_helpers import MODEL, gone, launch, long_stream_body, serve_command, stop

from mcore_inference.errors import InferenceConfigError
from mcore_inference.serve import ServeConfig
from mcore_inference.serve.server import check_tensor_parallel


def test_a_killed_server_leaves_no_rank(serve_checkpoint, tmp_path):
    server = launch(serve_checkpoint, tmp_path / "stderr.txt", "--tp", "2")
    process, url, pids = server.process, server.url, server.pids
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=long_stream_body()) as response:
            next(response.iter_lines())
            process.kill()  # SIGKILL: no handler runs in the server
            process.wait(30)
        assert gone(pids), f"rank processes {pids} outlived the killed server"
    finally:
        stop(process)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_crashed_rank_fails_the_requests_loudly(serve_checkpoint, tmp_path):
    server = launch(serve_checkpoint, tmp_path / "stderr.txt", "--tp", "2")
    process, url, pids = server.process, server.url, server.pids
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=long_stream_body()) as response:
            lines = response.iter_lines()
            next(lines)
            os.kill(pids[1], signal.SIGKILL)
            rest = [line for line in lines if line]
        # The open stream ends with an error naming the rank instead of hanging.
        errors = [json.loads(line.removeprefix("data: ")) for line in rest if "error" in line]
        assert errors and "engine rank 1 of tp=2" in errors[-1]["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
        again = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert again.status_code == 503 and "rank 1" in again.json()["error"]["message"]
        assert gone(pids)  # the server ended rank 0 too (it could wait for rank 1 for ever)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        stop(process)


def test_tp_that_does_not_fit_is_refused_before_listening(serve_checkpoint, capsys):
    from mcore_inference.cli import main

    # 3 divides neither the 4 heads nor the 2 KV heads of the model: refused before any rank
    # starts, with one line and exit status 2.
    assert main(serve_command(serve_checkpoint, "--tp", "3")[3:]) == 2
    captured = capsys.readouterr()
    assert "listening" not in captured.out
    assert captured.err.strip() == (
        "mcore-inference serve: error: tp=3 does not divide the model's attention heads (4); "
        "expected a tensor-parallel size that divides each of: attention heads 4, KV heads 2, "
        "FFN size 128, vocabulary 160"
    )


def test_ranks_that_fail_to_load_end_the_server_with_one_line(serve_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in serve_checkpoint.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    failed = subprocess.run(
        serve_command(broken, "--tp", "2"), capture_output=True, text=True, env=env, timeout=120
    )
    assert failed.returncode == 1 and "listening" not in failed.stdout
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("mcore-inference serve: error: rank ") and " of tp=2: loading " in last


def test_tp_zero_is_refused_by_the_command_line(serve_checkpoint, capsys):
    from mcore_inference.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(serve_command(serve_checkpoint, "--tp", "0")[3:])
    assert exit_info.value.code != 0
    captured = capsys.readouterr()
    assert "tp=0; expected an integer >= 1" in captured.out + captured.err


def test_tp_checks_name_the_option(serve_checkpoint):
    with pytest.raises(InferenceConfigError, match=r"KV heads \(2\)"):
        check_tensor_parallel(serve_checkpoint, 4, "cpu")
    check_tensor_parallel(serve_checkpoint, 2, "cpu")
    visible = torch.cuda.device_count()
    if visible < 2:
        with pytest.raises(InferenceConfigError, match=r"tp=2 needs 2 GPUs \(one per rank\)"):
            check_tensor_parallel(serve_checkpoint, 2, "cuda")
    else:
        check_tensor_parallel(serve_checkpoint, 2, "cuda")
    with pytest.raises(InferenceConfigError, match="tp=-1; expected an integer >= 1"):
        ServeConfig(model="m", tp=-1)
    with pytest.raises(InferenceConfigError, match="tp=2 needs engine_process=True"):
        ServeConfig(model="m", tp=2, engine_process=False)
    with pytest.raises(InferenceConfigError, match=r"device='cuda:1' with tp=2; expected 'cuda'"):
        ServeConfig(model="m", tp=2, device="cuda:1")
