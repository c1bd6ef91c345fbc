"""OpenAIProvider against the fake OpenAI server: answers, streams, usage and cost, retries,
timeouts, and streams cut after tokens were yielded (never retried, never duplicated)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai.types.chat as oat
import pytest

from gateway.backends.providers import Provider, ProviderError
from tests.providers.conftest import Sleeps
from tests.providers.fakes import FakeProvider, Fault

BODY = {
    "model": "ignored",
    "messages": [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "tell me three things"},
    ],
    "max_tokens": 50,
    "priority": "batch",
}
REPLY = "echo: tell me three things"


async def collect(p: Provider, body: dict[str, Any]) -> list[dict[str, Any]]:
    return [c async for c in p.chat_stream(body)]


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def test_chat_returns_completion_usage_and_cost(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    p = make_provider(fake_openai)
    r = await p.chat(BODY)
    oat.ChatCompletion.model_validate(r.response)
    assert r.response["choices"][0]["message"]["content"] == REPLY
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 5)
    assert r.cost_usd == pytest.approx((6 * 2.0 + 5 * 10.0) / 1e6)
    assert r.model == "fake-openai" and r.attempts == 1
    sent = fake_openai.requests[0]
    assert sent["model"] == "openai-upstream-model" and "priority" not in sent
    assert fake_openai.headers[0]["Authorization"] == "Bearer sk-fake-test-key"


async def test_stream_yields_openai_chunks_with_usage_last(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    chunks = await collect(make_provider(fake_openai), BODY)
    for c in chunks:
        oat.ChatCompletionChunk.model_validate(c)
    assert text_of(chunks) == REPLY
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert fake_openai.requests[0]["stream_options"] == {"include_usage": True}


async def test_429_retry_honours_retry_after(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider], sleeps: Sleeps
) -> None:
    fake_openai.faults.append(Fault.http(429, retry_after=2))
    r = await make_provider(fake_openai).chat(BODY)
    assert r.attempts == 2 and len(fake_openai.requests) == 2
    assert sleeps.delays[0] >= 2.0


async def test_retry_after_too_long_is_not_waited_for(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider], sleeps: Sleeps
) -> None:
    fake_openai.faults.append(Fault.http(429, retry_after=120))
    with pytest.raises(ProviderError) as e:
        await make_provider(fake_openai).chat(BODY)
    assert e.value.status == 429 and e.value.retry_after == 120 and sleeps.delays == []
    assert len(fake_openai.requests) == 1


async def test_5xx_retried_with_growing_backoff_then_raised(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider], sleeps: Sleeps
) -> None:
    fake_openai.faults.extend([Fault.http(503)] * 4)
    p = make_provider(
        fake_openai,
        retry={"max_attempts": 4, "base_delay_s": 0.5, "max_delay_s": 10, "jitter": 0.1},
    )
    with pytest.raises(ProviderError) as e:
        await p.chat(BODY)
    assert e.value.status == 503 and e.value.retryable and e.value.provider == "fake-openai"
    assert len(fake_openai.requests) == 4 and len(sleeps.delays) == 3
    for d, base in zip(sleeps.delays, (0.5, 1.0, 2.0), strict=True):
        assert base * 0.9 <= d <= base * 1.1


async def test_400_is_not_retried(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    fake_openai.faults.append(Fault.http(400))
    with pytest.raises(ProviderError) as e:
        await make_provider(fake_openai).chat(BODY)
    assert e.value.status == 400 and not e.value.retryable and len(fake_openai.requests) == 1


async def test_connection_drop_before_answer_is_retried(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    fake_openai.faults.extend([Fault.drop(), Fault.drop()])
    r = await make_provider(fake_openai).chat(BODY)
    assert r.attempts == 3 and r.response["choices"][0]["message"]["content"] == REPLY
    fake_openai.faults.append(Fault.drop())
    assert text_of(await collect(make_provider(fake_openai), BODY)) == REPLY


async def test_connect_refused_is_a_retryable_502(make_provider: Callable[..., Provider]) -> None:
    from tests.procs import free_port

    dead = FakeProvider("openai", url=f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(ProviderError) as e:
        await make_provider(dead).chat(BODY)
    assert (e.value.status, e.value.kind, e.value.retryable) == (502, "connect", True)


async def test_first_byte_timeout(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    p = make_provider(fake_openai, retry={"max_attempts": 1}, timeouts={"first_byte_s": 0.3})
    fake_openai.faults.append(Fault.hang())
    with pytest.raises(ProviderError) as e:
        await p.chat(BODY)
    assert (e.value.status, e.value.kind) == (504, "timeout")
    fake_openai.faults.append(Fault.stall_after(0))  # headers sent, then no event
    with pytest.raises(ProviderError) as e:
        await collect(p, BODY)
    assert e.value.kind == "timeout"


async def test_stream_cut_after_tokens_is_not_retried(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    fake_openai.faults.append(Fault.drop_after(3))
    got: list[dict[str, Any]] = []
    with pytest.raises(ProviderError) as e:
        async for c in make_provider(fake_openai).chat_stream(BODY):
            got.append(c)
    assert e.value.kind == "stream_interrupted" and not e.value.retryable
    assert len(fake_openai.requests) == 1
    assert text_of(got) == "echo: tell"  # role chunk + two words, each once


async def test_idle_timeout_mid_stream(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    fake_openai.faults.append(Fault.stall_after(2))
    got: list[dict[str, Any]] = []
    with pytest.raises(ProviderError) as e:
        async for c in make_provider(fake_openai, timeouts={"idle_s": 0.3}).chat_stream(BODY):
            got.append(c)
    assert e.value.kind == "stream_interrupted" and e.value.status == 504
    assert text_of(got) == "echo:" and len(fake_openai.requests) == 1


async def test_failure_before_first_chunk_is_retried_without_duplicates(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    fake_openai.faults.extend([Fault.drop_after(0), Fault.http(502)])
    chunks = await collect(make_provider(fake_openai), BODY)
    assert text_of(chunks) == REPLY and len(fake_openai.requests) == 3
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")) == 1


async def test_in_stream_error_event(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    fake_openai.faults.append(Fault.error_event(2))
    with pytest.raises(ProviderError) as e:
        await collect(make_provider(fake_openai), BODY)
    assert e.value.kind == "stream_interrupted" and "injected stream error" in e.value.message


async def test_missing_key_env_fails_without_calling(
    fake_openai: FakeProvider,
    make_provider: Callable[..., Provider],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FAKE_PROVIDER_KEY")
    with pytest.raises(ProviderError, match="FAKE_PROVIDER_KEY is not set") as e:
        await make_provider(fake_openai).chat(BODY)
    assert fake_openai.requests == [] and "sk-" not in e.value.message


async def test_missing_usage_is_estimated_not_free(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    body = {**BODY}
    p = make_provider(fake_openai)
    # a provider that ignores include_usage: strip the option on the way in
    orig = p._payload

    def no_usage(b: dict[str, Any], stream: bool) -> dict[str, Any]:
        out = orig(b, stream)
        out.pop("stream_options", None)
        return out

    p._payload = no_usage  # type: ignore[method-assign]
    chunks = await collect(p, body)
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    assert text_of(chunks) == REPLY


def test_an_estimate_counts_cjk_as_a_provider_bills_it() -> None:
    """A provider that sends no usage is billed an estimate: about 4 ASCII characters a token,
    but one per CJK character (what byte-level tokenizers bill), never a quarter of that — the
    flat 4-characters estimate billed 600 CJK characters as 150 tokens."""
    from gateway.backends.providers.cost import estimate_tokens

    assert estimate_tokens("预算必须守住" * 100) >= 600
    assert estimate_tokens("the budget must hold " * 10) == pytest.approx(210 / 4, abs=1)
    assert estimate_tokens("") == 0
