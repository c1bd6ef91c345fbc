"""The fakes speak the real wire formats: the official SDKs parse their answers into typed
objects, streaming and not, and raise their typed errors on injected failures."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.providers.fakes import API_KEY, FakeProvider, Fault


async def test_openai_sdk_reads_fake_completion(fake_openai: FakeProvider) -> None:
    client = openai.AsyncOpenAI(base_url=fake_openai.url, api_key=API_KEY, max_retries=0)
    r = await client.chat.completions.create(
        model="gpt-x", messages=[{"role": "user", "content": "hello there"}], max_tokens=50
    )
    assert r.choices[0].message.content == "echo: hello there"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (2, 3)
    await client.close()


async def test_openai_sdk_reads_fake_stream(fake_openai: FakeProvider) -> None:
    client = openai.AsyncOpenAI(base_url=fake_openai.url, api_key=API_KEY, max_retries=0)
    stream = await client.chat.completions.create(
        model="gpt-x",
        messages=[{"role": "user", "content": "one two three"}],
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=3,
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo: one two"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    await client.close()


async def test_openai_sdk_sees_fake_errors(fake_openai: FakeProvider) -> None:
    client = openai.AsyncOpenAI(base_url=fake_openai.url, api_key=API_KEY, max_retries=0)
    fake_openai.faults.append(Fault.http(429, retry_after=2))
    with pytest.raises(openai.RateLimitError) as e:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert e.value.response.headers["retry-after"] == "2"
    bad = openai.AsyncOpenAI(base_url=fake_openai.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    await client.close()
    await bad.close()


async def test_anthropic_sdk_reads_fake_message(fake_anthropic: FakeProvider) -> None:
    client = anthropic.AsyncAnthropic(
        base_url=fake_anthropic.url.removesuffix("/v1"), api_key=API_KEY, max_retries=0
    )
    m = await client.messages.create(
        model="claude-x",
        max_tokens=100,
        system="be brief",
        messages=[{"role": "user", "content": "hi you"}],
    )
    assert m.content[0].type == "text" and m.content[0].text == "echo: hi you"
    assert m.stop_reason == "end_turn"
    assert (m.usage.input_tokens, m.usage.output_tokens) == (4, 3)
    await client.close()


async def test_anthropic_sdk_reads_fake_stream(fake_anthropic: FakeProvider) -> None:
    client = anthropic.AsyncAnthropic(
        base_url=fake_anthropic.url.removesuffix("/v1"), api_key=API_KEY, max_retries=0
    )
    async with client.messages.stream(
        model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "a b c"}]
    ) as s:
        texts = [t async for t in s.text_stream]
        final = await s.get_final_message()
    assert "".join(texts) == "echo: a"
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 2
    await client.close()


async def test_anthropic_sdk_reads_fake_tool_stream(fake_anthropic: FakeProvider) -> None:
    client = anthropic.AsyncAnthropic(
        base_url=fake_anthropic.url.removesuffix("/v1"), api_key=API_KEY, max_retries=0
    )
    tools = [{"name": "lookup", "description": "look up", "input_schema": {"type": "object"}}]
    async with client.messages.stream(
        model="c",
        max_tokens=50,
        tools=tools,
        messages=[{"role": "user", "content": "weather in Oslo"}],
    ) as s:
        final = await s.get_final_message()
    assert final.stop_reason == "tool_use"
    use = next(b for b in final.content if b.type == "tool_use")
    assert use.name == "lookup" and use.input == {"query": "weather in Oslo"}
    await client.close()


async def test_anthropic_sdk_sees_fake_errors(fake_anthropic: FakeProvider) -> None:
    client = anthropic.AsyncAnthropic(
        base_url=fake_anthropic.url.removesuffix("/v1"), api_key=API_KEY, max_retries=0
    )
    fake_anthropic.faults.append(Fault.http(529))
    with pytest.raises(anthropic.InternalServerError) as e:
        await client.messages.create(
            model="c", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.status_code == 529 and "overloaded" in str(e.value.body)
    fake_anthropic.faults.append(Fault.error_event(2))
    with pytest.raises(anthropic.APIStatusError, match="overload"):
        async with client.messages.stream(
            model="c", max_tokens=50, messages=[{"role": "user", "content": "x y z"}]
        ) as s:
            async for _ in s.text_stream:
                pass
    with pytest.raises(anthropic.BadRequestError, match="alternate"):
        await client.messages.create(
            model="c",
            max_tokens=5,
            messages=[{"role": "user", "content": "x"}, {"role": "user", "content": "y"}],
        )
    await client.close()
