"""External models, fallback chains and `model: "auto"` through a real `duet gateway` process,
with the official `openai` client.

Real parts: the gateway process, a colocated node on the tiny model, the usage report CLI.
Fakes only for what cannot exist here: the commercial APIs (tests/providers/fakes.py, local
aiohttp servers speaking OpenAI's and Anthropic's wire formats), run on their own event loop
in a thread so the synchronous client can call the gateway while they answer.

Each fallback trigger is checked where an operator would look: the `x-duet-model-used` header,
the usage record (model used, its cost at that model's prices) and `duet:fallback_total`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from tests.gateway.conftest import COMMON
from tests.gateway.helpers import gateway_proc, http, make_team, scrape, tiny_model
from tests.procs import Proc, duet_node, free_port, running
from tests.providers.fakes import API_KEY, FakeProvider, Fault
from tests.wait import wait_for

GPT = {"in": 5.0, "out": 10.0}
CLAUDE = {"in": 20.0, "out": 40.0}
HARD = (
    "Prove that there are infinitely many primes, and derive the density bound rigorously using "
    "induction; then design a distributed, fault-tolerant sieve and analyze its consistency "
    "tradeoffs."
)


class FakeServers:
    """Fake providers on a private event loop in a daemon thread."""

    def __init__(self, wires: dict[str, str]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fakes: dict[str, FakeProvider] = {}
        self._runners: list[web.AppRunner] = []
        for name, wire in wires.items():
            self.fakes[name] = asyncio.run_coroutine_threadsafe(
                self._start(wire), self.loop
            ).result(30)

    async def _start(self, wire: str) -> FakeProvider:
        fake = FakeProvider(wire)  # its asyncio.Event belongs to this loop
        runner = web.AppRunner(fake.app(), shutdown_timeout=1)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        fake.url = f"http://127.0.0.1:{port}/v1"
        self._runners.append(runner)
        return fake

    async def _stop(self) -> None:
        for f in self.fakes.values():
            f.released.set()
        for r in self._runners:
            await r.cleanup()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def external(
    fake: FakeProvider, prices: dict[str, float], rank: int, **extra: Any
) -> dict[str, Any]:
    return {
        "kind": "external",
        "provider": fake.wire,
        "base_url": fake.url,
        "api_key_env": "FAKE_PROVIDER_KEY",
        "upstream_model": f"{fake.wire}-upstream",
        "input_usd_per_mtok": prices["in"],
        "output_usd_per_mtok": prices["out"],
        "max_model_len": 8192,
        "capability_rank": rank,
        "retry": {"max_attempts": 1},
        **extra,
    }


@dataclass
class Env:
    gw: Proc
    node: Proc
    fakes: dict[str, FakeProvider]
    db: Path
    key: str

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.gw.url + "/v1", api_key=key or self.key, max_retries=0, timeout=60
        )


@pytest.fixture(scope="module")
def env(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("providers")
    servers = FakeServers({"gpt": "openai", "flaky": "openai", "claude": "anthropic"})
    f = servers.fakes
    try:
        node = duet_node("both", tiny_llama, tmp, *COMMON)
        with running(node), pytest.MonkeyPatch.context() as mp:
            mp.setenv("FAKE_PROVIDER_KEY", API_KEY)
            models = {
                "tiny": tiny_model(
                    tiny_llama, both=[node.url], capability_rank=1, fallback=["gpt"]
                ),
                "dead": tiny_model(
                    tiny_llama, both=[f"http://127.0.0.1:{free_port()}"], fallback=["gpt"]
                ),
                "gpt": external(f["gpt"], GPT, 2),
                "flaky": external(
                    f["flaky"],
                    GPT,
                    2,
                    fallback=["claude"],
                    breaker={"failure_threshold": 2, "cooldown_s": 4.0},
                ),
                "claude": external(f["claude"], CLAUDE, 3, tiers=["interactive"]),
            }
            sections = {
                "tiers": {"max_inflight": 1, "interactive_fallback_wait_s": 0.3},
                "auto": {"models": ["tiny", "gpt", "claude"]},
                "teams.pinned": {"auto_pin": {"simple": "claude"}},
                "teams.paidbatch": {"allow_paid_for_batch": True},
                "teams.nogpt": {"forbid": ["gpt"]},
            }
            gw = gateway_proc(tmp, models, **sections)
            with running(gw):
                yield Env(gw, node, f, tmp / "gateway.db", make_team(gw.url, "main"))
    finally:
        servers.close()


def samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = scrape(url)
    out = []
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        out.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return out


def sample(url: str, name: str, **labels: str) -> float:
    return sum(
        v for lbl, v in samples(url, name) if all(lbl.get(k) == x for k, x in labels.items())
    )


def fallbacks(env: Env, frm: str, to: str, reason: str) -> float:
    return sample(env.gw.url, "duet:fallback_total", **{"from": frm, "to": to, "reason": reason})


def breaker(env: Env, provider: str) -> float:
    return sample(env.gw.url, "duet:provider_breaker_state", provider=provider)


def record(env: Env, request_id: str) -> dict[str, Any]:
    """The usage record of one request, read with the operator's report command."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "duet",
            "usage",
            "report",
            "--group-by",
            "record",
            "--format",
            "json",
            "--store",
            f"sqlite://{env.db}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [r for r in json.loads(out.stdout) if r["request_id"] == request_id]
    assert len(rows) == 1, out.stdout[-2000:]
    return rows[0]


def chat(client: openai.OpenAI, model: str, text: str, **kw: Any) -> Any:
    """A chat call through `with_raw_response`: (headers, parsed completion)."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=kw.pop("max_tokens", 16),
        **kw,
    )
    return raw.headers, raw.parse()


def cost(prices: dict[str, float], usage: Any) -> float:
    return (usage.prompt_tokens * prices["in"] + usage.completion_tokens * prices["out"]) / 1e6


def test_models_lists_providers_and_auto(env: Env) -> None:
    data = {m.id: m for m in env.client().models.list().data}
    assert {"tiny", "dead", "gpt", "flaky", "claude", "auto"} <= set(data)
    assert data["gpt"].owned_by == "external" and data["tiny"].owned_by == "duet"


def test_external_model_is_charged_at_its_prices(env: Env) -> None:
    """OpenAI and Anthropic wire formats, whole and streamed; tokens and cost as the provider
    counted them, in the usage endpoint and the usage record."""
    key = make_team(env.gw.url, "acct")
    client = env.client(key)
    h, r = chat(client, "gpt", "hello there world")
    assert r.choices[0].message.content == "echo: hello there world" and r.model == "gpt"
    assert h["x-duet-model-used"] == "gpt"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 4)
    assert float(h["x-duet-cost-usd"]) == pytest.approx(cost(GPT, r.usage))
    assert env.fakes["gpt"].requests[-1]["model"] == "openai-upstream"
    stream = client.chat.completions.create(
        model="claude",
        messages=[{"role": "user", "content": "one two"}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for c in stream:
        parts += [ch.delta.content or "" for ch in c.choices]
        usage = c.usage or usage
    assert "".join(parts) == "echo: one two" and (usage.prompt_tokens, usage.completion_tokens) == (
        2,
        3,
    )
    status, _, body = http(f"{env.gw.url}/v1/usage?group_by=model", key=key)
    assert status == 200, body
    rows = {row["model"]: row for row in body["data"]}
    assert rows["gpt"]["cost_usd"] == pytest.approx(cost(GPT, r.usage))
    assert rows["claude"]["cost_usd"] == pytest.approx((2 * CLAUDE["in"] + 3 * CLAUDE["out"]) / 1e6)
    assert (rows["claude"]["prompt_tokens"], rows["claude"]["completion_tokens"]) == (2, 3)


def test_no_healthy_nodes_falls_back(env: Env) -> None:
    before = fallbacks(env, "dead", "gpt", "no_healthy_nodes")
    h, r = chat(env.client(), "dead", "are you there")
    assert h["x-duet-model-used"] == "gpt" and r.model == "gpt"
    assert r.choices[0].message.content == "echo: are you there"
    assert fallbacks(env, "dead", "gpt", "no_healthy_nodes") == before + 1
    rec = record(env, h["x-request-id"])
    assert (rec["model_requested"], rec["model_used"], rec["status"]) == ("dead", "gpt", "ok")
    assert rec["cost_usd"] == pytest.approx(cost(GPT, r.usage)) and rec["cost_usd"] > 0


def test_batch_does_not_fall_back_to_a_paid_model_unless_allowed(env: Env) -> None:
    seen = len(env.fakes["gpt"].requests)
    before = fallbacks(env, "dead", "none", "no_healthy_nodes")
    with pytest.raises(openai.APIStatusError) as e:
        chat(env.client(), "dead", "batch job", extra_headers={"x-duet-tier": "batch"})
    assert e.value.status_code == 503 and len(env.fakes["gpt"].requests) == seen
    assert fallbacks(env, "dead", "none", "no_healthy_nodes") == before + 1
    h, r = chat(
        env.client(make_team(env.gw.url, "paidbatch")),
        "dead",
        "batch job",
        extra_headers={"x-duet-tier": "batch"},
    )
    assert h["x-duet-model-used"] == "gpt" and h["x-duet-tier"] == "batch"
    assert r.choices[0].message.content == "echo: batch job"


def test_provider_5xx_breaker_opens_half_opens_and_closes(env: Env) -> None:
    flaky, claude = env.fakes["flaky"], env.fakes["claude"]
    client = env.client()
    flaky.faults.extend([Fault.http(500), Fault.http(503)])
    answered = []
    for i in range(2):  # each 5xx (no retry configured) moves the request to claude
        h, r = chat(client, "flaky", f"try {i}")
        assert (
            h["x-duet-model-used"] == "claude" and r.choices[0].message.content == f"echo: try {i}"
        )
        answered.append((h["x-request-id"], r.usage))
    # open after failure_threshold = 2 (the checks up to the probe fit in the 4 s cool-down)
    assert breaker(env, "flaky") == 2
    assert fallbacks(env, "flaky", "claude", "provider_5xx") == 2
    # open: not contacted at all, straight to the fallback (streamed, Anthropic translated)
    seen = len(flaky.requests)
    stream = client.chat.completions.create(
        model="flaky",
        messages=[{"role": "user", "content": "while open"}],
        max_tokens=16,
        stream=True,
    )
    assert "".join(ch.delta.content or "" for c in stream for ch in c.choices) == "echo: while open"
    assert len(flaky.requests) == seen and len(claude.requests) >= 3
    assert fallbacks(env, "flaky", "claude", "breaker_open") == 1
    wait_for(lambda: breaker(env, "flaky") == 1, what="half-open after the cool-down")
    h, r = chat(client, "flaky", "probe")  # the probe succeeds: closed again
    assert h["x-duet-model-used"] == "flaky" and r.choices[0].message.content == "echo: probe"
    assert breaker(env, "flaky") == 0 and len(flaky.requests) == seen + 1
    for rid, usage in answered:  # the fallbacks were charged at claude's prices
        rec = record(env, rid)
        assert (rec["model_requested"], rec["model_used"]) == ("flaky", "claude")
        assert rec["cost_usd"] == pytest.approx(cost(CLAUDE, usage))


def test_provider_429_falls_back_before_the_stream_starts(env: Env) -> None:
    """A 429 asking for a longer wait than the gateway holds a client: the streamed request
    moves to the fallback before any chunk, and the client sees one clean answer."""
    before = fallbacks(env, "flaky", "claude", "provider_429")
    env.fakes["flaky"].faults.append(Fault.http(429, retry_after=90))
    raw = env.client().chat.completions.with_raw_response.create(
        model="flaky",
        messages=[{"role": "user", "content": "slow down"}],
        max_tokens=16,
        stream=True,
    )
    assert raw.headers["x-duet-model-used"] == "claude"
    chunks = list(raw.parse())
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == "echo: slow down"
    assert sum(1 for c in chunks for ch in c.choices if ch.delta.role) == 1
    assert {c.model for c in chunks} == {"claude"}
    assert fallbacks(env, "flaky", "claude", "provider_429") == before + 1
    chat(env.client(), "flaky", "reset")  # a success: the breaker's failure count back to 0


def test_stream_cut_mid_answer_is_an_error_event_not_a_retry(env: Env) -> None:
    gpt = env.fakes["gpt"]
    seen = len(gpt.requests)
    cut = threading.Event()  # the role chunk and two words, then the connection is cut
    gpt.faults.append(Fault.drop_after(3, cut))
    stream = env.client().chat.completions.with_raw_response.create(
        model="gpt",
        messages=[{"role": "user", "content": "alpha beta gamma delta"}],
        max_tokens=16,
        stream=True,
    )
    rid = stream.headers["x-request-id"]
    parts: list[str] = []
    with pytest.raises(openai.APIError) as e:
        for c in stream.parse():
            parts += [ch.delta.content or "" for ch in c.choices]
            if "".join(parts) == "echo: alpha":
                cut.set()  # the words have reached the client: now the provider drops
    assert "interrupted" in str(e.value.message)
    assert "".join(parts) == "echo: alpha"  # what arrived, once: no retry resent it
    assert len(gpt.requests) == seen + 1
    rec = record(env, rid)
    assert (rec["model_used"], rec["status"]) == ("gpt", "error_midstream")
    assert (
        rec["completion_tokens"] == 2 and rec["prompt_tokens"] > 0 and rec["cost_usd"] > 0
    )  # what it streamed


def test_auto_routes_simple_and_hard_prompts_to_different_models(env: Env) -> None:
    client = env.client()
    h, r = chat(client, "auto", "hi")
    assert (h["x-duet-model-used"], h["x-duet-auto-label"], r.model) == ("tiny", "simple", "tiny")
    h2, r2 = chat(client, "auto", HARD)
    assert (h2["x-duet-model-used"], h2["x-duet-auto-label"], r2.model) == (
        "claude",
        "hard",
        "claude",
    )
    assert r2.choices[0].message.content.startswith("echo: Prove that")
    rec = record(env, h2["x-request-id"])
    assert (rec["model_requested"], rec["model_used"]) == ("auto", "claude")
    assert rec["cost_usd"] == pytest.approx(cost(CLAUDE, r2.usage))
    # a team's pin wins; a team's ban holds by name too
    h3, _ = chat(env.client(make_team(env.gw.url, "pinned")), "auto", "hi")
    assert h3["x-duet-model-used"] == "claude"
    with pytest.raises(openai.PermissionDeniedError):
        chat(env.client(make_team(env.gw.url, "nogpt")), "gpt", "hi")


def test_saturated_pool_falls_back(env: Env) -> None:
    """max_inflight = 1: a request held on a stopped node fills the pool; the next interactive
    request waits interactive_fallback_wait_s, then goes to its fallback model."""
    before = fallbacks(env, "tiny", "gpt", "saturated")
    pgid = env.node.proc.pid
    os.killpg(pgid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(chat, env.client(), "tiny", "hold the slot", max_tokens=4)
            wait_for(
                lambda: http(env.gw.url + "/health")[2]["running"] == 1,
                what="the slot taken",
            )
            h, r = chat(env.client(), "tiny", "need an answer now")
            assert (
                h["x-duet-model-used"] == "gpt"
                and r.choices[0].message.content == "echo: need an answer now"
            )
            assert fallbacks(env, "tiny", "gpt", "saturated") == before + 1
            rec = record(env, h["x-request-id"])
            assert (rec["model_requested"], rec["model_used"], rec["cost_usd"]) == (
                "tiny",
                "gpt",
                pytest.approx(cost(GPT, r.usage)),
            )
            os.killpg(pgid, signal.SIGCONT)
            h0, _ = held.result(120)
            assert h0["x-duet-model-used"] == "tiny"  # the held request was served by its own model
    finally:
        os.killpg(pgid, signal.SIGCONT)


def test_logprobs_on_an_external_model_are_refused_by_name(env: Env) -> None:
    """Providers differ on logprobs (Anthropic has none): external models refuse them with a
    400 naming the field, before any call to the provider; duet's own models serve them."""
    before = len(env.fakes["gpt"].requests)
    with pytest.raises(openai.BadRequestError) as e:
        chat(env.client(), "gpt", "hello", logprobs=True, top_logprobs=2)
    err = e.value.body
    assert (
        isinstance(err, dict)
        and err.get("param") == "logprobs"
        and err.get("code") == "unsupported_by_model"
    ), err
    assert len(env.fakes["gpt"].requests) == before
    _, r = chat(env.client(), "tiny", "hello", logprobs=True, top_logprobs=2, max_tokens=3)
    assert (
        r.choices[0].logprobs is not None
        and len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    )


def test_max_tokens_past_an_external_models_context_is_a_400(env: Env) -> None:
    """An external model's max_tokens is checked against its context (max_model_len, 8192
    here) before anything is reserved or sent: it was passed on unchecked, so the provider's
    error — after a reservation of a billion tokens against the team's budget — was the answer."""
    key = make_team(env.gw.url, "ctx")
    sent = len(env.fakes["gpt"].requests)
    with pytest.raises(openai.BadRequestError) as e:
        chat(env.client(key), "gpt", "hello", max_tokens=10**9)
    assert e.value.body["param"] == "max_tokens" and "8192" in e.value.body["message"], e.value.body
    assert len(env.fakes["gpt"].requests) == sent  # nothing went to the provider
    _, r = chat(env.client(key), "gpt", "hello", max_tokens=8000)  # within the context: served
    assert r.choices[0].message.content == "echo: hello"


def test_token_ids_are_refused_on_an_external_model(env: Env) -> None:
    """A provider's answer carries no token ids: /inference/v1/generate and return_token_ids
    name the model in a 400 before any call to the provider."""
    before = len(env.fakes["gpt"].requests)
    body = {"model": "gpt", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    status, _, got = http(env.gw.url + "/inference/v1/generate", "POST", body, key=env.key)
    assert status == 400 and got["error"]["param"] == "model", got
    assert "external provider" in got["error"]["message"]
    body = {"model": "gpt", "prompt": "hi", "max_tokens": 2, "return_token_ids": True}
    status, _, got = http(env.gw.url + "/v1/completions", "POST", body, key=env.key)
    assert status == 400 and got["error"]["param"] == "model", got
    assert len(env.fakes["gpt"].requests) == before
