"""The batch tier inside a real `duet gateway` process, in front of two real tiny-model nodes:
the official openai client's files + batches calls with the gateway's API keys, output equal to
the same requests sent one by one (greedy), usage records at tier=batch, the discounted price
and each line's OpenAI `user`, team isolation, and quotas (a full rate window slows a batch; a
spent budget fails its lines at once)."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.batch.conftest import client
from tests.batch.gateway_procs import (
    DISCOUNT,
    NODE_ARGS,
    batch_gateway,
    file_lines,
    full_price,
    lines_for,
    submit,
    usage_records,
    wait_done,
)
from tests.gateway.helpers import http, make_team, scrape
from tests.procs import Proc, duet_node, running


@pytest.fixture(scope="module")
def nodes(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("nodes")
    a, b = (
        duet_node("both", tiny_llama, tmp, *NODE_ARGS),
        duet_node("both", tiny_llama, tmp, *NODE_ARGS),
    )
    with running(a, b):
        yield a, b


async def one_by_one(
    url: str, key: str, lines: list[dict[str, Any]], parallel: int = 8
) -> dict[str, Any]:
    """Each line's body as its own interactive request through the gateway."""
    sem = asyncio.Semaphore(parallel)
    async with client(url, key) as c:

        async def one(line: dict[str, Any]) -> tuple[str, Any]:
            async with sem:
                return line["custom_id"], await c.chat.completions.create(**line["body"])

        return dict(await asyncio.gather(*(one(x) for x in lines)))


async def test_500_line_batch_through_gateway(
    nodes: tuple[Proc, Proc], tiny_llama: Path, tmp_path: Path
) -> None:
    gw = batch_gateway(tmp_path, tiny_llama, [n.url for n in nodes])
    lines = lines_for(500)
    with running(gw):
        key_a, key_b = make_team(gw.url, "team-a"), make_team(gw.url, "team-b")
        async with client(gw.url, key_a) as c:
            batch_id = await submit(c, lines)
            input_id = (await c.batches.retrieve(batch_id)).input_file_id
        async with client(gw.url, key_b) as other:  # another team sees nothing of it
            with pytest.raises(openai.NotFoundError):
                await other.batches.retrieve(batch_id)
            with pytest.raises(openai.NotFoundError):
                await other.batches.cancel(batch_id)
            with pytest.raises(openai.NotFoundError):
                await other.files.content(input_id)
            assert (await other.batches.list()).data == []
        async with client(gw.url, "sk-duet-not-a-key") as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.batches.retrieve(batch_id)
        _, _, health = http(gw.url + "/health")  # its details need the admin key
        assert health["batch"]["concurrency"] == 8 and health["batch"]["worker_id"].endswith(
            f":{gw.port}"
        )
        b = await wait_done(gw.url, key_a, batch_id)
        assert b.status == "completed", b
        assert (
            b.request_counts.completed == 500
            and b.request_counts.failed == 0
            and b.error_file_id is None
        )
        out = await file_lines(gw.url, key_a, b.output_file_id)
        assert [o["custom_id"] for o in out] == [x["custom_id"] for x in lines]
        direct = await one_by_one(gw.url, key_a, lines)
    for o in out:
        resp = o["response"]
        assert resp["status_code"] == 200, o
        want = direct[o["custom_id"]]
        got = resp["body"]["choices"][0]
        assert got["message"]["content"] == want.choices[0].message.content, o["custom_id"]
        assert got["finish_reason"] == want.choices[0].finish_reason
        assert resp["body"]["usage"]["completion_tokens"] == want.usage.completion_tokens
        assert resp["body"]["usage"]["prompt_tokens"] == want.usage.prompt_tokens
    records = usage_records(tmp_path / "gateway.db", "team-a")
    batch = [r for r in records if r["tier"] == "batch"]
    inter = [r for r in records if r["tier"] == "interactive"]
    assert len(batch) == 500 and len(inter) == 500
    assert {r["request_id"] for r in batch} == {o["response"]["request_id"] for o in out}
    for r in batch:
        assert r["status"] == "ok" and r["completion_tokens"] > 0
        assert r["cost_usd"] == pytest.approx(
            full_price(r["prompt_tokens"], r["completion_tokens"]) * (1 - DISCOUNT)
        )
    for r in inter:
        assert r["cost_usd"] == pytest.approx(
            full_price(r["prompt_tokens"], r["completion_tokens"])
        )
    assert not usage_records(tmp_path / "gateway.db", "team-b")


async def test_quota_window_defers_lines_and_spent_budget_fails_them(
    nodes: tuple[Proc, Proc], tiny_llama: Path, tmp_path: Path
) -> None:
    gw = batch_gateway(tmp_path, tiny_llama, [n.url for n in nodes], concurrency=6, max_attempts=2)
    with running(gw):
        # One request at a time for this team, six runner slots: most claims are refused by the
        # quota. With 2 attempts per line, any refusal counted as an attempt would fail lines.
        narrow = make_team(gw.url, "narrow", max_concurrent=1)
        broke = make_team(gw.url, "broke", daily_budget_usd=1e-9)
        async with client(gw.url, narrow) as c:
            narrow_id = await submit(c, lines_for(20, max_tokens=16, user="nightly-job"))
        async with client(gw.url, broke) as c:
            broke_id = await submit(c, lines_for(5))
        # the simple form, same team, same quota: plain OpenAI bodies in, results inline
        status, _, simple = http(
            f"{gw.url}/v1/batch",
            "POST",
            {"requests": [x["body"] for x in lines_for(3, user="simple")], "priority": "low"},
            key=narrow,
        )
        assert status == 202, simple
        b = await wait_done(gw.url, narrow, narrow_id)
        assert (
            b.status == "completed"
            and b.request_counts.completed == 20
            and b.request_counts.failed == 0
        )
        assert len(await file_lines(gw.url, narrow, b.output_file_id)) == 20
        b = await wait_done(gw.url, narrow, simple["batch_id"])
        _, _, done = http(f"{gw.url}/v1/batch/{simple['batch_id']}", key=narrow)
        assert (
            done["status"] == "completed"
            and [r["response"]["status_code"] for r in done["results"]] == [200] * 3
        )
        assert http(f"{gw.url}/v1/batch/{simple['batch_id']}", key=broke)[0] == 404
        b = await wait_done(gw.url, broke, broke_id)
        assert b.status == "completed" and b.request_counts.failed == 5 and b.output_file_id is None
        errors = await file_lines(gw.url, broke, b.error_file_id)
        metrics = scrape(gw.url)
    # the quota did refuse the narrow team's lines (so the deferral above was exercised) ...
    refused = re.search(
        r'^duet:ratelimit_rejections_total\{kind="concurrency",team="narrow"\} (\S+)$',
        metrics,
        re.M,
    )
    assert refused and float(refused.group(1)) > 0, metrics
    # ... and each spent-budget line was tried once: its 429 is final
    spent = re.search(
        r'^duet:ratelimit_rejections_total\{kind="daily_budget",team="broke"\} (\S+)$',
        metrics,
        re.M,
    )
    assert spent and float(spent.group(1)) == 5
    assert len(errors) == 5
    for e in errors:
        assert e["response"]["status_code"] == 429
        assert e["response"]["body"]["error"]["type"] == "insufficient_quota"
    records = usage_records(tmp_path / "gateway.db", "narrow")
    assert all(r["tier"] == "batch" for r in records)
    # a line's OpenAI `user` reaches its usage record, as on the interactive path
    ok = Counter(r["user"] for r in records if r["status"] == "ok")
    assert ok == {"nightly-job": 20, "simple": 3}
