"""A default per-team `max_concurrent`: a team created without a concurrency limit
is held to `[quotas] default_max_concurrent` (64 unless configured), so one team that never
got limits cannot take every slot of the gateway; a team's own `max_concurrent` overrides
the default. Before, such a team had no bound at all.

Cheap checks come before tokenizing: a team already at its concurrency limit is refused (429)
on this gateway's own count before its prompt is measured — an over-long prompt gets the 429,
not the tokenizer's 400 (before: measured first, 400) — and more than 2048 messages is a 400
before any template work.

Real parts: a `duet gateway` process in front of a fake OpenAI-compatible provider (a real
HTTP server) that holds requests open, the official openai client.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import openai
import pytest

from tests.gateway.helpers import MODEL, gateway_proc, make_team, tiny_model
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import running
from tests.providers.fakes import API_KEY, Fault
from tests.wait import wait_for


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def _hold(fake: FakeServers, url: str, key: str) -> None:
    """One request of the team held open at the fake provider (it counts as in flight)."""
    gpt = fake.fakes["gpt"]
    seen = len(gpt.requests)
    fake.loop.call_soon_threadsafe(gpt.faults.append, Fault.hang())

    def send() -> None:
        with contextlib.suppress(openai.APIError):  # the gateway stops under it at the end
            _client(url, key).chat.completions.create(
                model="gpt", max_tokens=4, messages=[{"role": "user", "content": "hold"}]
            )

    threading.Thread(target=send, daemon=True).start()
    wait_for(lambda: len(gpt.requests) > seen, 30, "the provider to hold a request")


def test_a_team_without_limits_gets_the_default_concurrency(
    fake: FakeServers, tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    gpt = fake.fakes["gpt"]
    # MODEL: a self-hosted model (the gateway tokenizes its prompts) whose node is never reached
    models = {
        "gpt": external(gpt, {"in": 1.0, "out": 2.0}, 2),
        MODEL: tiny_model(tiny_llama, both=["http://127.0.0.1:9"], max_model_len=1024),
    }
    gw = gateway_proc(tmp_path, models, quotas={"default_max_concurrent": 1})
    with running(gw):
        plain, own = make_team(gw.url, "plain"), make_team(gw.url, "own", max_concurrent=3)

        def client(key: str) -> openai.OpenAI:
            return _client(gw.url, key)

        def hold(key: str) -> None:
            _hold(fake, gw.url, key)

        def ask(key: str) -> None:
            client(key).chat.completions.create(
                model="gpt", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )

        hold(plain)
        with pytest.raises(openai.RateLimitError) as e:
            ask(plain)
        assert (
            e.value.body["code"] == "rate_limit_exceeded" and e.value.body["param"] == "concurrency"
        ), e.value.body
        assert "limit 1" in e.value.body["message"]
        # Refused before the tokenizer: a prompt far past the context gets the 429, not a 400.
        with pytest.raises(openai.RateLimitError) as e:
            client(plain).chat.completions.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "word " * 200_000}]
            )
        assert e.value.body["param"] == "concurrency", e.value.body
        with pytest.raises(openai.BadRequestError) as e2:
            client(own).chat.completions.create(
                model="gpt", max_tokens=4, messages=[{"role": "user", "content": "hi"}] * 2049
            )
        assert e2.value.body["param"] == "messages" and "2048" in e2.value.body["message"], (
            e2.value.body
        )
        # Per team, and a team's own limit wins over the default.
        hold(own)
        ask(own)
        fake.loop.call_soon_threadsafe(gpt.released.set)  # end the held requests: a quick stop


def test_embeddings_pass_the_team_gate_and_the_tier_grant(
    fake: FakeServers, tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`/v1/embeddings` takes its tier and its cheap refusals where chat does: a batch-only team
    asking for interactive gets the 403, and a team at its concurrency limit gets the 429 before
    its input is tokenized (an input far past the context: 429, not the tokenizer's 400). Before,
    embeddings resolved the tier from the header alone and tokenized first."""
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    # an embedding model whose node is never reached: both refusals come before any node work
    emb = {
        "kind": "embedding",
        "tokenizer": str(tiny_llama),
        "input_usd_per_mtok": 0.02,
        "static": {"both": ["http://127.0.0.1:9"]},
        "max_model_len": 1024,
    }
    gw = gateway_proc(
        tmp_path,
        {"gpt": external(fake.fakes["gpt"], {"in": 1.0, "out": 2.0}, 2), "emb": emb},
        quotas={"default_max_concurrent": 1},
        teams={"lowly": {"interactive": False}},
    )
    with running(gw):
        plain, lowly = make_team(gw.url, "plain"), make_team(gw.url, "lowly")
        with pytest.raises(openai.PermissionDeniedError) as e:
            _client(gw.url, lowly).embeddings.create(
                model="emb", input="hi", extra_headers={"x-duet-tier": "interactive"}
            )
        assert e.value.body["code"] == "tier_not_allowed", e.value.body
        with pytest.raises(openai.BadRequestError) as e2:  # not held: the tokenizer's 400
            _client(gw.url, plain).embeddings.create(model="emb", input="word " * 5_000)
        assert e2.value.body["param"] == "input", e2.value.body
        _hold(fake, gw.url, plain)
        with pytest.raises(openai.RateLimitError) as e3:
            _client(gw.url, plain).embeddings.create(model="emb", input="word " * 5_000)
        assert e3.value.body["param"] == "concurrency", e3.value.body
        fake.loop.call_soon_threadsafe(
            fake.fakes["gpt"].released.set
        )  # end the held request: a quick stop
