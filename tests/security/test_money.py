"""Budgets hold on external models: the reservation of a request to a
commercial API must bound what the provider can bill, whatever the script of the prompt.

The attack: a team with a $1 daily budget sends 100 concurrent chat requests of CJK and emoji
text to an external model. The provider bills about one token per CJK character and several per
emoji; the gateway reserved "one token per 3 characters", so each reservation covered a third to
a ninth of the bill, and the team spent several times its budget ($2.41 on $1 in the review).
Now the reservation is the prompt's UTF-8 byte count (a byte-level BPE token covers at least one
byte): spend stays within the budget plus one request's cost.

Real parts: the gateway process and its SQLite store, the official openai client; the provider
is the local fake (tests/providers/fakes.py) with a tokenizer-like bill.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL)
from tests.gateway.helpers import gateway_proc, http, make_team
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import running
from tests.providers.fakes import API_KEY, FakeProvider, Fault
from tests.wait import wait_for

#: $ per million tokens: a dear model, so one request costs cents
PRICES = {"in": 20.0, "out": 40.0}
BUDGET = 1.0
#: 1,500 characters: CJK (3 UTF-8 bytes each, billed 1 token) and emoji (4 bytes, billed 3)
PROMPT = ("预算必须守住" * 200) + ("🙂🚀" * 150)
MAX_TOKENS = 16


def billed_tokens(messages: list[dict[str, Any]]) -> int:
    """A byte-level BPE's bill: one token per CJK character, three per emoji, one per ASCII word."""
    n = 0
    for m in messages:
        text = str(m.get("content") or "")
        n += sum(3 if ord(c) > 0xFFFF else 1 for c in text if ord(c) > 0x7F)
        n += len("".join(c if ord(c) <= 0x7F else " " for c in text).split())
    return n


_SERVERS: dict[str, FakeServers] = {}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("money")
    servers = FakeServers({"gpt": "openai"})
    servers.fakes["gpt"].prompt_tokens = billed_tokens
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FAKE_PROVIDER_KEY", API_KEY)
            gw = gateway_proc(tmp, {"gpt": external(servers.fakes["gpt"], PRICES, 2)})
            with running(gw):
                _SERVERS[gw.url] = servers
                yield gw.url, tmp / "gateway.db"
    finally:
        servers.close()


def gateway_fake(url: str) -> tuple[asyncio.AbstractEventLoop, FakeProvider]:
    """The fake provider behind the module's gateway, with the loop it runs on."""
    servers = _SERVERS[url]
    return servers.loop, servers.fakes["gpt"]


def one_request_cost() -> float:
    messages = [{"role": "user", "content": PROMPT}]
    return (billed_tokens(messages) * PRICES["in"] + MAX_TOKENS * PRICES["out"]) / 1e6


def attack(client: openai.OpenAI, db: Path, team: str, **create: Any) -> float:
    """100 concurrent chat requests of the team to the external model: some answered, the rest
    refused for the budget; what the team spent."""

    def send(_: int) -> str:
        try:
            client.chat.completions.create(model="gpt", max_tokens=MAX_TOKENS, **create)
            return "ok"
        except openai.RateLimitError as e:
            assert e.body["code"] == "budget_exceeded", e.body
            return "refused"

    with ThreadPoolExecutor(max_workers=100) as pool:
        outcomes = list(pool.map(send, range(100)))
    assert "ok" in outcomes and "refused" in outcomes, outcomes
    with sqlite3.connect(db) as conn:
        (spent,) = conn.execute(
            "SELECT COALESCE(SUM(cost_usd), 0) FROM usage WHERE team_id = ?", (team,)
        ).fetchone()
    return spent


def test_cjk_and_emoji_cannot_overspend_a_budget(gateway: tuple[str, Path]) -> None:
    url, db = gateway
    key = make_team(url, "cjk", daily_budget_usd=BUDGET)
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    # the fake answers "echo: <prompt>": two words, so each request bills its prompt and 2 tokens
    assert 100 * one_request_cost() > 4 * BUDGET  # the attack would overspend 4x over

    spent = attack(client, db, "cjk", messages=[{"role": "user", "content": PROMPT}])
    assert spent <= BUDGET + one_request_cost(), f"spent ${spent:.4f} on a ${BUDGET} budget"


#: a tool whose description is the attack's text: providers bill tool definitions as prompt
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": PROMPT,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def billed_rest(body: dict[str, Any]) -> int:
    """The fake's bill for what a request carries beside its messages (tools, response_format)."""
    rest = {k: body[k] for k in ("tools", "tool_choice", "response_format") if k in body}
    return billed_tokens([{"content": json.dumps(rest, ensure_ascii=False)}]) if rest else 0


def test_tool_definitions_cannot_overspend_a_budget(gateway: tuple[str, Path]) -> None:
    """The same attack carried in a tool's description (and so in what the provider bills as the
    prompt) with a one-word message. The reservation once counted message content only: each
    request reserved a few tokens and the team spent several budgets."""
    url, db = gateway
    _, gpt = gateway_fake(url)
    gpt.request_tokens = billed_rest
    key = make_team(url, "cjk-tools", daily_budget_usd=BUDGET)
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "hi"}]
    cost = (
        billed_rest({"tools": TOOLS, "tool_choice": "auto"}) * PRICES["in"] + 7 * PRICES["out"]
    ) / 1e6
    assert 100 * cost > 4 * BUDGET  # the attack would overspend 4x over

    spent = attack(client, db, "cjk-tools", messages=messages, tools=TOOLS)
    assert spent <= BUDGET + cost, f"spent ${spent:.4f} on a ${BUDGET} budget"


def test_a_client_that_leaves_pays_for_its_sent_prompt(gateway: tuple[str, Path]) -> None:
    """A prompt already sent to a provider is charged even if the client leaves before the first
    token: else a team could have every prompt computed for free by hanging up at once."""
    url, db = gateway
    key = make_team(url, "leaver")
    fake = gateway_fake(url)
    fake_loop, gpt = fake
    fake_loop.call_soon_threadsafe(gpt.faults.append, Fault.hang())
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=2)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(
            model="gpt",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS,
            stream=True,
        )

    def record() -> tuple[Any, ...] | None:
        with sqlite3.connect(db) as conn:
            return conn.execute(
                "SELECT status, prompt_tokens, completion_tokens, cost_usd FROM usage "
                "WHERE team_id = 'leaver'"
            ).fetchone()

    wait_for(lambda: record() is not None, 30, "the usage record of the request whose client left")
    status, prompt, completion, cost = record()  # type: ignore[misc]
    assert status == "client_disconnected" and completion == 0
    assert prompt > 0 and cost == pytest.approx(prompt * PRICES["in"] / 1e6), (prompt, cost)


def test_two_gateways_on_postgres_hold_one_budget(
    postgres_db: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same attack through two gateway processes sharing one PostgreSQL store (several
    gateways, one quota): 100 concurrent requests, alternating gateways, on a $1
    day. Each gateway books in the shared store under the team's row lock, so together they
    spend at most the budget plus one request; every answered request has exactly one usage
    record, and a refused one none."""
    servers = FakeServers({"gpt": "openai"})
    servers.fakes["gpt"].prompt_tokens = billed_tokens
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    try:
        models = {"gpt": external(servers.fakes["gpt"], PRICES, 2)}
        gateways = [gateway_proc(tmp_path, models, store=postgres_db) for _ in range(2)]
        with running(*gateways):
            key = make_team(gateways[0].url, "cjk2", daily_budget_usd=BUDGET)
            clients = [
                openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0, timeout=120)
                for g in gateways
            ]

            def send(i: int) -> str:
                try:
                    clients[i % 2].chat.completions.create(
                        model="gpt",
                        messages=[{"role": "user", "content": PROMPT}],
                        max_tokens=MAX_TOKENS,
                    )
                    return f"ok{i % 2}"
                except openai.RateLimitError as e:
                    assert e.body["code"] == "budget_exceeded", e.body
                    return "refused"

            with ThreadPoolExecutor(max_workers=100) as pool:
                outcomes = list(pool.map(send, range(100)))
            status, _, usage = http(f"{gateways[1].url}/v1/usage?team_id=cjk2")
            assert status == 200, usage
            status, _, records = http(f"{gateways[0].url}/v1/usage?team_id=cjk2&group_by=record")
            assert status == 200, records
    finally:
        servers.close()
    answered = outcomes.count("ok0") + outcomes.count("ok1")
    assert outcomes.count("ok0") and outcomes.count("ok1") and "refused" in outcomes, outcomes
    (total,) = usage["data"]
    assert total["cost_usd"] <= BUDGET + one_request_cost(), (
        f"spent ${total['cost_usd']:.4f} on a ${BUDGET} budget"
    )
    assert total["requests"] == answered == len(records["data"]), (total, answered)
    assert all(r["status"] == "ok" and r["cost_usd"] > 0 for r in records["data"])
    assert len({r["request_id"] for r in records["data"]}) == answered
