"""Fixtures: fake OpenAI and Anthropic servers on loopback, and providers pointed at them."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.backends.providers import Provider, build_provider
from tests.procs import free_port
from tests.providers.fakes import API_KEY, FakeProvider


async def _serve(fake: FakeProvider) -> AsyncIterator[FakeProvider]:
    runner = web.AppRunner(fake.app(), shutdown_timeout=1)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    fake.url = f"http://127.0.0.1:{port}/v1"
    try:
        yield fake
    finally:
        fake.released.set()
        await runner.cleanup()


@pytest.fixture
async def fake_openai() -> AsyncIterator[FakeProvider]:
    async for f in _serve(FakeProvider("openai")):
        yield f


@pytest.fixture
async def fake_anthropic() -> AsyncIterator[FakeProvider]:
    async for f in _serve(FakeProvider("anthropic")):
        yield f


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


class Sleeps:
    """An injected `sleep` that records the delays asked for and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    return API_KEY


@pytest.fixture
def make_provider(
    session: aiohttp.ClientSession, sleeps: Sleeps, api_key: str
) -> Callable[..., Provider]:
    def make(fake: FakeProvider, **overrides: Any) -> Provider:
        cfg: dict[str, Any] = {
            "name": f"fake-{fake.wire}",
            "kind": fake.wire,
            "base_url": fake.url,
            "api_key_env": "FAKE_PROVIDER_KEY",
            "model": f"{fake.wire}-upstream-model",
            "input_price_per_m": 2.0,
            "output_price_per_m": 10.0,
            "context_length": 8192,
            "capability_rank": 3,
            "tiers": ["interactive", "batch"],
            "retry": {"max_attempts": 3, "base_delay_s": 0.01, "max_delay_s": 0.1},
            "timeouts": {"connect_s": 2.0, "first_byte_s": 5.0, "idle_s": 5.0},
        }
        clock = overrides.pop("clock", None)
        for k, v in overrides.items():
            cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
        kw: dict[str, Any] = {"sleep": sleeps, "rng": random.Random(0)}
        if clock is not None:
            kw["clock"] = clock
        return build_provider(cfg, session, **kw)

    return make
