"""``ServeConfig`` validation and the ``mcore-inference serve`` options generated from it."""

import dataclasses

import pytest
import tyro

from mcore_inference import InferenceConfigError
from mcore_inference.cli import COMMANDS, main
from mcore_inference.serve import ServeConfig


def _parse(args: list[str]) -> ServeConfig:
    options, _ = COMMANDS["serve"]
    return tyro.cli(options, args=args)


def test_every_field_is_an_option_with_its_default_and_docstring(capsys):
    assert _parse(["--model", "ckpt"]) == ServeConfig(model="ckpt")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    serve_help = " ".join(capsys.readouterr().out.split())
    for field in dataclasses.fields(ServeConfig):
        assert "--" + field.name.replace("_", "-") in serve_help
    assert (
        "Requests allowed to wait for a batch slot; beyond it new requests get 503." in serve_help
    )
    assert "(default: 256)" in serve_help


def test_options_reach_the_config():
    config = _parse(
        [
            "--model",
            "m",
            "--port",
            "0",
            "--max-waiting-requests",
            "3",
            "--no-use-cuda-graphs",
            "--served-model-name",
            "x",
            "--num-blocks",
            "12",
            "--no-engine-process",
            "--no-cuda-graph-mixed-steps",
        ]
    )
    assert not config.cuda_graph_mixed_steps and ServeConfig(model="m").cuda_graph_mixed_steps
    assert (config.port, config.max_waiting_requests, config.use_cuda_graphs) == (0, 3, False)
    assert not config.engine_process and ServeConfig(model="m").engine_process
    assert (config.served_model_name, config.num_blocks) == ("x", 12)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"model": ""}, "model"),
        ({"port": 70000}, "port"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"num_blocks": -1}, "num_blocks"),
        ({"max_waiting_requests": -1}, "max_waiting_requests"),
        ({"timeout_graceful_shutdown": 1.5}, "timeout_graceful_shutdown"),
        ({"log_level": "loud"}, "log_level"),
        ({"served_model_name": ""}, "served_model_name"),
        ({"engine_process": "yes"}, "engine_process"),
        ({"cuda_graph_mixed_steps": 1}, "cuda_graph_mixed_steps"),
        ({"admission_window_ms": -1.0}, "admission_window_ms"),
        ({"admission_window_ms": 5.0, "engine_process": False}, "admission_window_ms"),
    ],
)
def test_invalid_field_raises_naming_it(fields, name):
    with pytest.raises(InferenceConfigError, match=name):
        ServeConfig(**{"model": "ckpt", **fields})
