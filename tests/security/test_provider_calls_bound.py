"""A gateway-wide bound on calls to external providers (gateway/backends/provider_slots.py):
`[server] max_provider_calls` calls run at once, whatever team or external model they are for;
one more is refused at once — 503 `overloaded` with Retry-After, OpenAI's error body, before
its prompt is sent (the provider never sees it) — and the `duet:provider_calls_running` gauge
counts the calls running. A call gives its slot back when it ends, also when its client leaves
mid-stream. Before, external models had only each team's admission: enough teams at their
own limits held any number of provider calls.

Real parts: a `duet gateway` process in front of a fake OpenAI-compatible provider (a real
HTTP server) that holds streams open, the official openai client, the gateway's /metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.config import ConfigError, parse_config
from tests.gateway.helpers import gateway_proc, make_team, metric
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import running
from tests.providers.fakes import API_KEY, Fault
from tests.wait import wait_for

BOUND = 2
RUNNING = "duet:provider_calls_running"


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_provider_calls_over_the_bound_are_refused_503(
    fake: FakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    gpt = fake.fakes["gpt"]
    gw = gateway_proc(
        tmp_path,
        {"gpt": external(gpt, {"in": 1.0, "out": 2.0}, 2)},
        server={"max_provider_calls": BOUND},
    )
    msg = [{"role": "user", "content": "one two three"}]
    with running(gw):
        keys = [
            make_team(gw.url, f"t{i}") for i in range(BOUND + 1)
        ]  # a team each: no team limit applies
        assert metric(gw.url, RUNNING) == 0

        def hold(key: str) -> tuple[Any, Any]:
            """A stream the provider holds after its first events: a call running."""
            fake.loop.call_soon_threadsafe(gpt.faults.append, Fault.stall_after(2))
            stream = _client(gw.url, key).chat.completions.create(
                model="gpt", messages=msg, stream=True, max_tokens=16
            )
            chunks = iter(stream)
            next(chunks)  # it has begun
            return stream, chunks

        fake.loop.call_soon_threadsafe(gpt.released.clear)
        held = [hold(k) for k in keys[:BOUND]]
        assert metric(gw.url, RUNNING) == BOUND
        seen = len(gpt.requests)
        with pytest.raises(openai.InternalServerError) as e:
            _client(gw.url, keys[BOUND]).chat.completions.create(
                model="gpt", messages=msg, max_tokens=4
            )
        assert e.value.status_code == 503, e.value
        assert e.value.response.headers.get("retry-after") == "1", e.value.response.headers
        body = e.value.response.json()
        assert set(body) == {"error"} and set(body["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }, body
        assert (
            body["error"]["code"] == "overloaded" and body["error"]["type"] == "service_unavailable"
        ), body
        assert f"{BOUND} calls to external providers" in body["error"]["message"], body
        assert len(gpt.requests) == seen  # refused before its prompt was sent
        assert (
            metric(gw.url, 'duet:gateway_shed_total{reason="provider_calls",tier="interactive"}')
            == 1
        )

        # A client that leaves mid-stream gives its slot back; the next call runs.
        held[0][0].close()
        wait_for(
            lambda: metric(gw.url, RUNNING) == BOUND - 1,
            30,
            "the left client's slot to be given back",
        )
        got = _client(gw.url, keys[BOUND]).chat.completions.create(
            model="gpt", messages=msg, max_tokens=4
        )
        assert got.choices[0].message.content == "echo: one two three"

        # The held streams finish, and every slot is free again.
        fake.loop.call_soon_threadsafe(gpt.released.set)
        for _, chunks in held[1:]:
            for _ in chunks:
                pass
        wait_for(lambda: metric(gw.url, RUNNING) == 0, 30, "every provider call's slot to be free")


def test_the_bound_is_checked_at_config_load() -> None:
    models = {
        "m": {
            "kind": "external",
            "provider": "openai",
            "base_url": "http://127.0.0.1:9/v1",
            "max_model_len": 1024,
        }
    }
    assert parse_config({"models": models}).server.max_provider_calls == 256
    assert (
        parse_config(
            {"models": models, "server": {"max_provider_calls": 0}}
        ).server.max_provider_calls
        == 0
    )
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(
            ConfigError, match=r"\[server\] max_provider_calls must be an integer >= 0"
        ):
            parse_config({"models": models, "server": {"max_provider_calls": bad}})
