"""A default per-team `max_concurrent` (issue #22): a team created without a concurrency limit
is held to `[quotas] default_max_concurrent` (128 unless configured), so one team that never
got limits cannot take every slot of the gateway; a team's own `max_concurrent` overrides
the default. Before, such a team had no bound at all.

Real parts: a `duet gateway` process in front of a fake OpenAI-compatible provider (a real
HTTP server) that holds requests open, the official openai client.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway.helpers import gateway_proc, make_team
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import running
from tests.providers.fakes import API_KEY, Fault
from tests.wait import wait_for


@pytest.fixture
def fake() -> Iterator[FakeServers]:
    servers = FakeServers({"gpt": "openai"})
    try:
        yield servers
    finally:
        servers.close()


def test_a_team_without_limits_gets_the_default_concurrency(fake: FakeServers, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    gpt = fake.fakes["gpt"]
    gw = gateway_proc(tmp_path, {"gpt": external(gpt, {"in": 1.0, "out": 2.0}, 2)},
                      quotas={"default_max_concurrent": 1})  # fmt: skip
    with running(gw):
        plain, own = make_team(gw.url, "plain"), make_team(gw.url, "own", max_concurrent=3)

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)

        def hold(key: str) -> None:
            seen = len(gpt.requests)
            fake.loop.call_soon_threadsafe(gpt.faults.append, Fault.hang())

            def send() -> None:
                with contextlib.suppress(openai.APIError):  # the gateway stops under it at the end
                    client(key).chat.completions.create(model="gpt", max_tokens=4,
                                                        messages=[{"role": "user", "content": "hold"}])  # fmt: skip

            threading.Thread(target=send, daemon=True).start()
            wait_for(lambda: len(gpt.requests) > seen, 30, "the provider to hold a request")

        def ask(key: str) -> None:
            client(key).chat.completions.create(model="gpt", max_tokens=4, messages=[{"role": "user", "content": "hi"}])

        hold(plain)
        with pytest.raises(openai.RateLimitError) as e:
            ask(plain)
        assert e.value.body["code"] == "rate_limit_exceeded" and e.value.body["param"] == "concurrency", e.value.body
        assert "limit 1" in e.value.body["message"]
        # Per team, and a team's own limit wins over the default.
        hold(own)
        ask(own)
        fake.loop.call_soon_threadsafe(gpt.released.set)  # end the held requests: a quick stop
