"""OpenAI → Anthropic request mapping details the fake server cannot see on its own."""

from __future__ import annotations

import pytest

from gateway.backends.providers import ProviderError
from gateway.backends.providers.anthropic_shapes import (
    ERROR_STATUS,
    error_type_named,
    error_type_of,
    status_of,
)
from gateway.backends.providers.translate import to_anthropic
from gateway.backends.providers.translate_answer import AnthropicStreamTranslator, from_anthropic


def test_images_merging_and_tool_choice() -> None:
    png = "data:image/png;base64,iVBORw0KGgo="
    out = to_anthropic(
        {
            "messages": [
                {"role": "developer", "content": "rule one"},
                {"role": "system", "content": [{"type": "text", "text": "rule two"}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": png}},
                        {"type": "image_url", "image_url": {"url": "https://img.example/x.jpg"}},
                    ],
                },
                {"role": "user", "content": "what is this?"},
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 5,
        },
        "m",
        100,
    )
    assert out["system"] == "rule one\n\nrule two" and out["max_tokens"] == 5
    assert len(out["messages"]) == 1  # consecutive user turns merged
    blocks = out["messages"][0]["content"]
    assert blocks[0]["source"] == {
        "type": "base64",
        "media_type": "image/png",
        "data": "iVBORw0KGgo=",
    }
    assert blocks[1]["source"] == {"type": "url", "url": "https://img.example/x.jpg"}
    assert out["tools"] == [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]
    assert out["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}


@pytest.mark.parametrize(
    "messages",
    [
        [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}}],
            }
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}
                ],
            }
        ],
        [{"role": "tool", "content": "x"}],
        [
            {
                "role": "assistant",
                "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{oops"}}],
            }
        ],
        [{"role": "wizard", "content": "x"}],
        "not a list",
    ],
)
def test_bad_requests_are_400(messages: object) -> None:
    with pytest.raises(ProviderError) as e:
        to_anthropic({"messages": messages}, "m", 10)
    assert e.value.status == 400


@pytest.mark.parametrize(
    "field",
    [
        {"max_tokens": 0},
        {"max_tokens": "9"},
        {"temperature": "hot"},
        {"temperature": 2.5},
        {"top_p": True},
        {"top_k": 0},
        {"stop": [""]},
        {"stop": 5},
        {"tools": {"f": 1}},
        {"tool_choice": "sometimes"},
    ],
)
def test_bad_fields_are_400(field: dict) -> None:
    with pytest.raises(ProviderError) as e:
        to_anthropic({"messages": [{"role": "user", "content": "x"}], **field}, "m", 10)
    assert e.value.status == 400 and e.value.kind == "invalid_request"


def test_cache_tokens_and_stop_reasons() -> None:
    resp, usage = from_anthropic(
        {
            "type": "message",
            "id": "msg_1",
            "model": "c",
            "stop_reason": "refusal",
            "content": [{"type": "text", "text": "no"}],
            "usage": {
                "input_tokens": 10,
                "output_tokens": 1,
                "cache_read_input_tokens": 30,
                "cache_creation_input_tokens": 5,
            },
        }
    )
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (45, 30, 1)
    assert resp["choices"][0]["finish_reason"] == "content_filter"
    with pytest.raises(ProviderError) as e:
        from_anthropic({"type": "error"})
    assert e.value.kind == "invalid_response"


def test_stream_without_message_start_or_stop_is_refused() -> None:
    t = AnthropicStreamTranslator()
    assert t.feed("ping", '{"type": "ping"}') == []
    with pytest.raises(ProviderError):
        t.feed(
            "content_block_delta",
            '{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": '
            '"x"}}',
        )
    t = AnthropicStreamTranslator()
    t.feed(
        "message_start",
        '{"type": "message_start", "message": {"id": "m", "model": "c", "usage": {"input_tokens": '
        "3}}}",
    )
    with pytest.raises(ProviderError, match="message_stop"):
        t.finish()


def test_anthropic_error_types_and_statuses_agree_both_ways() -> None:
    # the nine types Anthropic documents, 504 timeout_error among them
    assert ERROR_STATUS["timeout_error"] == 504 and len(ERROR_STATUS) == 9
    for etype, status in ERROR_STATUS.items():
        assert (status_of(etype), error_type_of(status)) == (status, etype)
    # a stream's error event has no status: an Anthropic type it names stands, any other
    # type is its status's (none: 500)
    assert error_type_named("timeout_error", None) == "timeout_error"
    assert error_type_named("upstream_error", None) == "api_error"
    assert error_type_named("upstream_error", 429) == "rate_limit_error"
