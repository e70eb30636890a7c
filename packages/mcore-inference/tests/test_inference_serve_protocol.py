"""Request validation of ``mcore_inference.serve.protocol``: what valid bodies turn into, and
which field an invalid one is refused for (the HTTP tests check the same through the server)."""

import pytest

from mcore_inference.serve.protocol import (
    ProtocolError,
    parse_chat_request,
    parse_completion_request,
)


def test_completion_body_becomes_options_with_openai_defaults():
    request = parse_completion_request({"model": "m", "prompt": "hi"})
    options = request.options
    assert request.prompts == ("hi",)
    assert (options.max_tokens, options.temperature, options.top_p, options.top_k) == (
        16,
        1.0,
        1.0,
        0,
    )
    assert (options.n, options.stop, options.seed, options.logprobs) == (1, (), None, False)
    assert not options.stream and not options.include_usage and not options.ignore_eos


def test_completion_body_with_every_supported_field():
    request = parse_completion_request(
        {
            "model": "m",
            "prompt": [[1, 2], "text"],
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "n": 2,
            "best_of": 2,
            "stop": "x",
            "seed": 3,
            "logprobs": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "presence_penalty": 0,
            "logit_bias": {},
            "echo": False,
            "user": "someone",
            "ignore_eos": True,
        }
    )
    options = request.options
    assert request.prompts == ((1, 2), "text")
    assert (options.max_tokens, options.temperature, options.top_p, options.top_k) == (
        5,
        0.0,
        0.5,
        0,
    )
    assert (options.n, options.stop, options.seed, options.logprobs) == (2, ("x",), 3, True)
    assert options.stream and options.include_usage and options.ignore_eos


def test_chat_body_joins_text_parts_and_reads_max_completion_tokens():
    request = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 7,
            "logprobs": True,
            "top_logprobs": 0,
            "response_format": {"type": "text"},
            "tool_choice": "none",
        }
    )
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "be brief"),
        ("user", "ab"),
    ]
    assert request.options.max_tokens == 7 and request.options.logprobs
    assert (
        parse_chat_request(
            {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        ).options.max_tokens
        is None
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([1, 2], None),
        ({"prompt": "x"}, "model"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [1, -2]}, "prompt[1]"),
        ({"model": "m", "prompt": ["a", [1, "b"]]}, "prompt[1][1]"),
        ({"model": "m", "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": True}, "temperature"),
        ({"model": "m", "prompt": "x", "top_k": -2}, "top_k"),
        ({"model": "m", "prompt": "x", "n": 129}, "n"),
        ({"model": "m", "prompt": "x", "stop": ["ok", ""]}, "stop[1]"),
        (
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            {"model": "m", "prompt": "x", "stream": True, "stream_options": {"x": 1}},
            "stream_options",
        ),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "suffix": "s"}, "suffix"),
        ({"model": "m", "prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_invalid_completion_field_is_named(body, param):
    with pytest.raises(ProtocolError) as info:
        parse_completion_request(body)
    assert info.value.param == param
    assert info.value.status == 400
    assert info.value.body()["error"]["param"] == param
    if param is not None:
        assert param.split("[")[0] in info.value.message and "expected" in info.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0].tool_calls",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            },
            "messages[0].content[0].text",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 1,
                "max_completion_tokens": 1,
            },
            "max_completion_tokens",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
            "tool_choice",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt"),
    ],
)
def test_invalid_chat_field_is_named(body, param):
    with pytest.raises(ProtocolError) as info:
        parse_chat_request(body)
    assert info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"
