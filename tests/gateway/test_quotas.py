"""Quotas through a real gateway: 100 concurrent requests from one team against a tight TPM
never overspend, and every 429 carries Retry-After and x-ratelimit-* headers; a daily budget
refuses the request that would cross it."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.gateway.helpers import ADMIN_KEY, MODEL, gateway_proc, http, make_team, tiny_model
from tests.procs import Proc, duet_node, running
from text.tokenizer import Tokenizer

PROMPT = "quota test prompt"
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def gw(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("gw-quota")
    both = duet_node(
        "both",
        tiny_llama,
        tmp,
        "--dtype",
        "float32",
        "--kv-blocks",
        "256",
        "--max-model-len",
        "1024",
    )
    g = gateway_proc(tmp, {MODEL: tiny_model(tiny_llama, both=[both.url])})
    with running(both, g):
        yield g


def body() -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }


async def test_100_concurrent_against_tight_tpm(gw: Proc, tiny_llama: Path) -> None:
    per_request = len(Tokenizer(tiny_llama).encode(PROMPT)) + MAX_TOKENS
    tpm = per_request * 7 + per_request // 2  # room for exactly 7 requests
    key = make_team(gw.url, "tight", tpm=tpm)

    async def one(s: aiohttp.ClientSession) -> tuple[int, dict[str, str], dict]:
        async with s.post(
            gw.url + "/v1/completions", json=body(), headers={"Authorization": f"Bearer {key}"}
        ) as r:
            return r.status, dict(r.headers), await r.json()

    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*[one(s) for _ in range(100)])
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == 100, {r[0] for r in results}
    used = sum(r[2]["usage"]["total_tokens"] for r in ok)
    assert used <= tpm  # zero overspend
    assert len(ok) == 7  # reserve == actual here (ignore_eos), so exactly what fits is admitted
    for _, headers, err in refused:
        assert err["error"]["code"] == "rate_limit_exceeded" and err["error"]["param"] == "tokens"
        assert err["error"]["type"] == "rate_limit_error"
        assert int(headers["Retry-After"]) >= 1
        assert headers["x-ratelimit-limit-tokens"] == str(tpm)
        assert 0 <= int(headers["x-ratelimit-remaining-tokens"]) < per_request
        assert (
            0 < _seconds(headers["x-ratelimit-reset-tokens"]) <= 61
        )  # one-second buckets: up to 61 s
    # success carries the headers too, and the store agrees with the clients
    assert ok[0][1]["x-ratelimit-limit-tokens"] == str(tpm)
    status, _, usage = http(gw.url + "/v1/usage", key=key)
    assert (
        status == 200
        and usage["data"][0]["total_tokens"] == used
        and usage["data"][0]["requests"] == 7
    )
    # the refusals are counted per kind
    text = await _get(gw.url + "/metrics")
    assert 'duet:ratelimit_rejections_total{kind="tokens",team="tight"} 93.0' in text


def _seconds(reset: str) -> float:
    """OpenAI's reset format: "12.5s", "1m0s"."""
    m = re.fullmatch(r"(?:(\d+)m)?([\d.]+)s", reset)
    assert m, reset
    return int(m.group(1) or 0) * 60 + float(m.group(2))


async def _get(url: str) -> str:
    """A gateway's /metrics, read with the admin key (it needs it by default)."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with aiohttp.ClientSession() as s, s.get(url, headers=admin) as r:
        return await r.text()


def test_daily_budget_refuses_the_request_that_would_cross_it(gw: Proc, tiny_llama: Path) -> None:
    n_prompt = len(Tokenizer(tiny_llama).encode(PROMPT))
    cost = (n_prompt * 1.0 + MAX_TOKENS * 2.0) / 1e6  # tiny_model prices: $1 / $2 per Mtok
    key = make_team(gw.url, "thrifty", daily_budget_usd=cost * 3.5)
    statuses = []
    for _ in range(5):
        status, headers, resp = http(gw.url + "/v1/completions", "POST", body(), key=key)
        statuses.append(status)
        if status == 429:
            assert (
                resp["error"]["code"] == "budget_exceeded"
                and resp["error"]["param"] == "daily_budget"
            )
            assert 1 <= int(headers["Retry-After"]) <= 86400
        else:
            assert math.isclose(float(headers["x-duet-cost-usd"]), cost, rel_tol=1e-6)
    assert statuses == [200, 200, 200, 429, 429]
    spent = http(gw.url + "/v1/usage", key=key)[2]["data"][0]["cost_usd"]
    assert spent <= cost * 3.5 and math.isclose(spent, cost * 3, rel_tol=1e-6)


def test_rpm(gw: Proc) -> None:
    key = make_team(gw.url, "chatty", rpm=2)
    got = [
        http(gw.url + "/v1/completions", "POST", {**body(), "max_tokens": 2}, key=key)
        for _ in range(3)
    ]
    assert [g[0] for g in got] == [200, 200, 429]
    _, headers, err = got[2]
    assert err["error"]["code"] == "rate_limit_exceeded" and err["error"]["param"] == "requests"
    assert (
        headers["x-ratelimit-limit-requests"] == "2"
        and headers["x-ratelimit-remaining-requests"] == "0"
    )
    assert int(headers["Retry-After"]) >= 1


async def test_two_gateways_on_one_postgres_hold_one_limit(
    tiny_llama: Path, tmp_path: Path, postgres_db: str
) -> None:
    both = duet_node(
        "both",
        tiny_llama,
        tmp_path,
        "--dtype",
        "float32",
        "--kv-blocks",
        "256",
        "--max-model-len",
        "1024",
    )
    models = {MODEL: tiny_model(tiny_llama, both=[both.url])}
    g1 = gateway_proc(tmp_path, models, store=postgres_db)
    g2 = gateway_proc(tmp_path, models, store=postgres_db)
    with running(both, g1, g2):
        per_request = len(Tokenizer(tiny_llama).encode(PROMPT)) + MAX_TOKENS
        tpm = per_request * 5 + 1
        key = make_team(g1.url, "shared", tpm=tpm)

        async def one(s: aiohttp.ClientSession, url: str) -> int:
            async with s.post(
                url + "/v1/completions", json=body(), headers={"Authorization": f"Bearer {key}"}
            ) as r:
                await r.read()
                return r.status

        async with aiohttp.ClientSession() as s:
            statuses = await asyncio.gather(*[one(s, (g1, g2)[i % 2].url) for i in range(60)])
        assert (
            statuses.count(200) == 5 and statuses.count(429) == 55
        )  # one limit, not one per gateway
        usage = http(g2.url + "/v1/usage", key=key)[2]["data"][0]
        assert usage["requests"] == 5 and usage["total_tokens"] <= tpm
