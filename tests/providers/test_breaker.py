"""Circuit breaker: opens after N failures, refuses while open, half-opens after the cool-down,
closes on success, re-opens on a failed probe — on an injected clock, with no sleeps; and the
provider consults it (an open breaker means the provider is not contacted at all)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.backends.providers import (
    BreakerState,
    CircuitBreaker,
    Provider,
    ProviderError,
    register_provider_metrics,
)
from gateway.backends.providers.config import BreakerConfig
from tests.providers.fakes import FakeProvider, Fault


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_breaker_cycle() -> None:
    clock = Clock()
    b = CircuitBreaker(
        BreakerConfig(failure_threshold=3, cooldown_s=30, success_threshold=2), clock
    )
    for _ in range(2):
        assert b.allow()
        b.record_failure()
    assert b.state is BreakerState.CLOSED
    b.record_success()  # resets the consecutive count
    for _ in range(3):
        assert b.allow()
        b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allow()
    clock.t += 29.9
    assert b.state is BreakerState.OPEN and b.retry_after() == pytest.approx(0.1)
    clock.t += 0.1
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow() and not b.allow()  # one probe at a time
    b.record_success()
    assert b.state is BreakerState.HALF_OPEN  # success_threshold=2
    assert b.allow()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allow()


def test_failed_probe_reopens_for_a_full_cooldown() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, cooldown_s=10), clock)
    b.record_failure()
    clock.t += 10
    assert b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN and b.retry_after() == 10 and b.times_opened == 2


def test_abandoned_probe_frees_its_slot() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, cooldown_s=1), clock)
    b.record_failure()
    clock.t += 1
    assert b.allow() and not b.allow()
    b.record_neutral()
    assert b.allow()


async def test_provider_breaker_opens_refuses_and_recovers(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    clock = Clock()
    p = make_provider(
        fake_openai,
        clock=clock,
        retry={"max_attempts": 1},
        breaker={"failure_threshold": 2, "cooldown_s": 60},
    )
    registry = CollectorRegistry()
    register_provider_metrics(registry, lambda: [p])
    body = {"messages": [{"role": "user", "content": "hi"}]}
    fake_openai.faults.extend([Fault.http(500), Fault.http(400), Fault.drop()])
    for _ in range(3):
        with pytest.raises(ProviderError):
            await p.chat(body)
    # 500 and drop count; the 400 (the request's fault) neither counts nor resets
    assert p.breaker.state is BreakerState.OPEN
    assert b'duet:provider_breaker_state{provider="fake-openai"} 2.0' in generate_latest(registry)
    with pytest.raises(ProviderError) as e:
        [c async for c in p.chat_stream(body)]
    assert e.value.kind == "breaker_open" and e.value.status == 503 and e.value.retry_after == 60
    assert len(fake_openai.requests) == 3  # not contacted while open
    clock.t += 60
    assert b'duet:provider_breaker_state{provider="fake-openai"} 1.0' in generate_latest(registry)
    chunks = [c async for c in p.chat_stream(body)]
    assert chunks[-1]["usage"] and p.breaker.state is BreakerState.CLOSED
    assert b'duet:provider_breaker_state{provider="fake-openai"} 0.0' in generate_latest(registry)


async def test_stream_abandoned_by_client_in_half_open_releases_probe(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    clock = Clock()
    p = make_provider(
        fake_openai,
        clock=clock,
        retry={"max_attempts": 1},
        breaker={"failure_threshold": 1, "cooldown_s": 5},
    )
    fake_openai.faults.append(Fault.http(503))
    with pytest.raises(ProviderError):
        await p.chat({"messages": [{"role": "user", "content": "hi"}]})
    clock.t += 5
    gen = p.chat_stream({"messages": [{"role": "user", "content": "a b c"}]})
    await anext(gen)
    await gen.aclose()  # the client went away mid-stream
    assert p.breaker.state is BreakerState.HALF_OPEN and p.breaker.allow()


async def test_cancelled_calls_in_half_open_release_their_probe(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    import asyncio

    clock = Clock()
    p = make_provider(
        fake_openai,
        clock=clock,
        retry={"max_attempts": 1},
        breaker={"failure_threshold": 1, "cooldown_s": 5},
    )
    fake_openai.faults.append(Fault.http(503))
    with pytest.raises(ProviderError):
        await p.chat({"messages": [{"role": "user", "content": "hi"}]})
    clock.t += 5
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for call in (lambda: p.chat(body), lambda: anext(p.chat_stream(body))):
        fake_openai.faults.append(Fault.hang())
        seen = len(fake_openai.requests)
        task = asyncio.ensure_future(call())
        async with asyncio.timeout(5):  # until the probe is in flight at the provider
            while len(fake_openai.requests) == seen:
                await asyncio.sleep(0.01)
        assert not p.breaker.allow()  # the probe holds the only half-open slot
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert p.breaker.state is BreakerState.HALF_OPEN and p.breaker.allow()  # the slot came back
        p.breaker.record_neutral()


async def test_retry_refused_by_the_breaker_raises_the_real_error(
    fake_openai: FakeProvider, make_provider: Callable[..., Provider]
) -> None:
    p = make_provider(fake_openai, retry={"max_attempts": 3}, breaker={"failure_threshold": 1})
    fake_openai.faults.append(Fault.http(502))
    with pytest.raises(ProviderError) as e:
        await p.chat({"messages": [{"role": "user", "content": "hi"}]})
    assert (e.value.status, e.value.kind) == (502, "http") and len(fake_openai.requests) == 1
