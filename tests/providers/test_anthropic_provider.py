"""AnthropicProvider against the fake Messages API: the request is translated so the fake (which
checks what the real API checks) accepts it, and answers, streams, tool calls, usage, stop
reasons and errors come back as OpenAI objects the official `openai` types accept."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai.types.chat as oat
import pytest

from gateway.backends.providers import Provider, ProviderError, TokenUsage
from tests.providers.conftest import Sleeps
from tests.providers.fakes import FakeProvider, Fault

BODY = {
    "model": "claude",
    "messages": [
        {"role": "system", "content": "be terse"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "second"}, {"type": "text", "text": " question"}],
        },
    ],
    "temperature": 1.7,
    "stop": "END",
    "user": "u-1",
    "seed": 3,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "look things up",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]


async def collect(p: Provider, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = [c async for c in p.chat_stream(body)]
    for c in out:
        oat.ChatCompletionChunk.model_validate(c)
    return out


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def test_chat_translates_both_ways(
    fake_anthropic: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    p = make_provider(fake_anthropic, default_max_tokens=77)
    r = await p.chat(BODY)
    sent = fake_anthropic.requests[0]
    assert (
        sent["system"] == "be terse"
        and sent["max_tokens"] == 77
        and sent["model"] == "anthropic-upstream-model"
    )
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]
    assert sent["temperature"] == 1.0 and sent["stop_sequences"] == ["END"]
    assert sent["metadata"] == {"user_id": "u-1"} and "seed" not in sent
    assert fake_anthropic.headers[0]["x-api-key"] == "sk-fake-test-key"
    assert fake_anthropic.headers[0]["anthropic-version"] == "2023-06-01"
    oat.ChatCompletion.model_validate(r.response)
    msg = r.response["choices"][0]
    assert msg["message"]["content"] == "echo: second question" and msg["finish_reason"] == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (8, 3)
    assert r.cost_usd == pytest.approx((8 * 2 + 3 * 10) / 1e6)


async def test_max_tokens_stop_reason_is_length(
    fake_anthropic: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    r = await make_provider(fake_anthropic).chat({**BODY, "max_tokens": 2})
    assert r.response["choices"][0]["finish_reason"] == "length"
    assert r.response["choices"][0]["message"]["content"] == "echo: second"


async def test_stream_events_become_chunks(
    fake_anthropic: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    chunks = await collect(make_provider(fake_anthropic), {**BODY, "max_completion_tokens": 2})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert text_of(chunks) == "echo: second"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 8
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    assert fake_anthropic.requests[0]["stream"] is True


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_cache_reads_and_writes_are_said_apart_and_priced_apart(
    fake_anthropic: FakeProvider, make_provider: Callable[..., Provider], stream: bool
) -> None:
    """Anthropic's `cache_creation_input_tokens` are prompt tokens written to its cache: they
    count once in the prompt, are said as `cache_write_tokens` (reads as `cached_tokens`),
    and cost the cache-write price."""
    fake_anthropic.cache_read, fake_anthropic.cache_write = 40, 100
    p = make_provider(
        fake_anthropic, cached_input_price_per_m=0.2, cache_write_input_price_per_m=2.5
    )
    if stream:
        usage = (await collect(p, BODY))[-1]["usage"]
    else:
        usage = (await p.chat(BODY)).response["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (8 + 40 + 100, 3)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 40, "cache_write_tokens": 100}
    u = TokenUsage.from_openai(usage)
    assert u is not None and (u.cached_tokens, u.cache_write_tokens) == (40, 100)
    assert p.cost(u) == pytest.approx((8 * 2 + 40 * 0.2 + 100 * 2.5 + 3 * 10) / 1e6)


async def test_tool_calls_round_trip(
    fake_anthropic: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    p = make_provider(fake_anthropic)
    body = {
        "model": "c",
        "messages": [{"role": "user", "content": "weather in Oslo"}],
        "tools": TOOLS,
        "tool_choice": "auto",
    }
    r = await p.chat(body)
    choice = r.response["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "lookup" and json.loads(call["function"]["arguments"]) == {
        "query": "weather in Oslo"
    }
    sent = fake_anthropic.requests[0]
    assert sent["tools"][0]["input_schema"]["properties"] == {"query": {"type": "string"}}
    assert sent["tool_choice"] == {"type": "auto"}

    chunks = await collect(p, body)
    calls = [
        tc
        for c in chunks
        if c["choices"]
        for tc in c["choices"][0]["delta"].get("tool_calls") or []
    ]
    assert calls[0]["id"].startswith("toolu_") and calls[0]["function"]["name"] == "lookup"
    args = "".join(tc["function"]["arguments"] for tc in calls)
    assert json.loads(args) == {"query": "weather in Oslo"}
    assert text_of(chunks) == "Let me check."

    # the tool's result goes back as a tool message; the fake refuses non-alternating roles
    follow = {
        **body,
        "messages": [
            *body["messages"],
            choice["message"],
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
        ],
    }
    r2 = await p.chat(follow)
    sent2 = fake_anthropic.requests[-1]["messages"]
    assert sent2[1]["content"][1]["type"] == "tool_use"
    assert sent2[2]["content"] == [
        {"type": "tool_result", "tool_use_id": call["id"], "content": "sunny"}
    ]
    assert r2.response["choices"][0]["finish_reason"] == "stop"


async def test_overloaded_529_is_retried(
    fake_anthropic: FakeProvider, make_provider: Callable[..., Provider], sleeps: Sleeps
) -> None:
    fake_anthropic.faults.extend([Fault.http(529), Fault.http(429, retry_after=1)])
    r = await make_provider(fake_anthropic).chat(BODY)
    assert r.attempts == 3 and sleeps.delays[1] >= 1.0


async def test_error_event_mid_stream(
    fake_anthropic: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    fake_anthropic.faults.append(Fault.error_event(4))
    got: list[dict[str, Any]] = []
    with pytest.raises(ProviderError) as e:
        async for c in make_provider(fake_anthropic).chat_stream(BODY):
            got.append(c)
    assert e.value.kind == "stream_interrupted" and e.value.status == 529
    assert e.value.error_type == "overloaded_error" and len(fake_anthropic.requests) == 1
    assert text_of(got) == "echo:"


async def test_error_event_before_any_chunk_is_retried(
    fake_anthropic: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    fake_anthropic.faults.append(Fault.error_event(0))
    chunks = await collect(make_provider(fake_anthropic), BODY)
    assert text_of(chunks) == "echo: second question" and len(fake_anthropic.requests) == 2


async def test_cut_stream_without_message_stop_is_an_error(
    fake_anthropic: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    fake_anthropic.faults.append(Fault.drop_after(5))
    with pytest.raises(ProviderError) as e:
        await collect(make_provider(fake_anthropic), BODY)
    assert e.value.kind == "stream_interrupted" and len(fake_anthropic.requests) == 1


async def test_untranslatable_request_is_a_400_before_any_call(
    fake_anthropic: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    p = make_provider(fake_anthropic)
    for body in (
        {**BODY, "n": 2},
        {**BODY, "response_format": {"type": "json_object"}},
        {"messages": [{"role": "system", "content": "only a system prompt"}]},
        {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
    ):
        with pytest.raises(ProviderError) as e:
            await p.chat(body)
        assert e.value.status == 400 and e.value.kind == "invalid_request"
    assert fake_anthropic.requests == []
    assert p.breaker.state == 0
