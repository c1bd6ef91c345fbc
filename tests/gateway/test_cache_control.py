"""Anthropic's `cache_control` on the Messages API, through the official `anthropic` client, a
real `duet gateway` and a real node (the tiny Llama): the first call writes the marked prefix
(`cache_creation_input_tokens`, billed at the cache write price) and the node retains its
blocks; the second call with the same prefix reads it (`cache_read_input_tokens`, billed at the
cache read price); another team's identical prompt reads nothing (cache domains hold). The
OpenAI-shaped chat usage says the same counts (`prompt_tokens_details`), and the usage record
and the team's `/v1/usage` totals keep the cache writes (`cache_write_tokens`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.gateway.conftest import COMMON
from tests.gateway.helpers import gateway_proc, http, make_team, metric, tiny_model
from tests.gateway.test_providers_e2e import record
from tests.procs import Proc, duet_node, running

PRICES = {
    "input_usd_per_mtok": 1.0,
    "output_usd_per_mtok": 2.0,
    "cached_input_usd_per_mtok": 0.1,
    "cache_write_usd_per_mtok": 1.25,
}
SYSTEM = " ".join(f"Rule {i}: answer briefly and stay on the topic of item {i}." for i in range(12))


@dataclass
class Env:
    gw: Proc
    node: Proc
    db: Path
    keys: dict[str, str]

    def client(self, team: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.gw.url, api_key=self.keys[team], max_retries=0, timeout=60
        )


@pytest.fixture(scope="module")
def env(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("cache-control")
    node = duet_node("both", tiny_llama, tmp, *COMMON)
    with running(node):
        gw = gateway_proc(tmp, {"tiny": tiny_model(tiny_llama, both=[node.url], **PRICES)})
        with running(gw):
            keys = {t: make_team(gw.url, t) for t in ("alpha", "beta")}
            yield Env(gw, node, tmp / "gateway.db", keys)


def ask(c: anthropic.Anthropic, question: str, ttl: str = "5m") -> tuple[str, Any]:
    raw = c.messages.with_raw_response.create(
        model="tiny",
        max_tokens=4,
        system=[
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": ttl}}
        ],
        messages=[{"role": "user", "content": question}],
    )
    return raw.headers["request-id"], raw.parse().usage


def billed(u: Any) -> float:
    return (
        u.input_tokens * PRICES["input_usd_per_mtok"]
        + u.cache_read_input_tokens * PRICES["cached_input_usd_per_mtok"]
        + u.cache_creation_input_tokens * PRICES["cache_write_usd_per_mtok"]
        + u.output_tokens * PRICES["output_usd_per_mtok"]
    ) / 1e6


def test_the_second_call_reads_the_cache_and_is_billed_at_the_read_price(env: Env) -> None:
    c = env.client("alpha")
    rid1, u1 = ask(c, "What is item 3 about?", ttl="1h")
    assert u1.cache_read_input_tokens == 0
    assert u1.cache_creation_input_tokens >= 64  # the system prompt, in whole 16-token blocks
    assert u1.cache_creation_input_tokens % 16 == 0
    assert metric(env.node.url, "duet:kv_blocks_retained") == u1.cache_creation_input_tokens // 16

    rid2, u2 = ask(c, "And item 7?")
    assert u2.cache_read_input_tokens >= u1.cache_creation_input_tokens
    assert u2.cache_creation_input_tokens == 0
    for rid, u in ((rid1, u1), (rid2, u2)):
        r = record(env, rid)
        prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
        assert (r["prompt_tokens"], r["cached_tokens"]) == (prompt, u.cache_read_input_tokens)
        # the record keeps the cache writes the client was told of (operators total them)
        assert r["cache_write_tokens"] == u.cache_creation_input_tokens, r
        assert r["cost_usd"] == pytest.approx(billed(u), rel=1e-9)
    # the read is cheaper than the write of the same prefix
    assert record(env, rid2)["cost_usd"] < record(env, rid1)["cost_usd"]
    # and the team's /v1/usage totals carry its cache writes beside its reads
    status, _, page = http(f"{env.gw.url}/v1/usage?start=0", key=env.keys["alpha"])
    assert status == 200, page
    [total] = page["data"]
    assert total["cache_write_tokens"] >= u1.cache_creation_input_tokens, total
    assert total["cached_tokens"] >= u2.cache_read_input_tokens, total


def test_a_stream_and_the_chat_endpoint_say_the_same_counts(env: Env) -> None:
    question = "What is item 9 about?"
    _, whole = ask(env.client("alpha"), question)
    with env.client("alpha").messages.stream(
        model="tiny",
        max_tokens=4,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": question}],
    ) as stream:
        streamed = stream.get_final_message().usage
    assert streamed.cache_read_input_tokens > whole.cache_read_input_tokens  # the whole prompt
    oai = openai.OpenAI(base_url=env.gw.url + "/v1", api_key=env.keys["alpha"], max_retries=0)
    chat = oai.chat.completions.create(
        model="tiny",
        max_tokens=4,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    )
    assert chat.usage.prompt_tokens_details.cached_tokens == streamed.cache_read_input_tokens
    assert chat.usage.prompt_tokens == streamed.input_tokens + streamed.cache_read_input_tokens


def test_another_teams_identical_prompt_reads_nothing(env: Env) -> None:
    ask(env.client("alpha"), "What is item 5 about?")
    _, u = ask(env.client("beta"), "What is item 5 about?")
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens > 0


def test_more_than_four_breakpoints_is_a_400(env: Env) -> None:
    mark = {"type": "ephemeral"}
    with pytest.raises(anthropic.BadRequestError, match="maximum of 4 blocks"):
        env.client("alpha").messages.create(
            model="tiny",
            max_tokens=4,
            system=[{"type": "text", "text": f"part {i}", "cache_control": mark} for i in range(5)],
            messages=[{"role": "user", "content": "hi"}],
        )


TOOL = {
    "name": "lookup_item",
    "description": "Look an item up in the catalogue by its number and return its description.",
    "input_schema": {
        "type": "object",
        "properties": {"number": {"type": "integer", "description": "the item's number"}},
        "required": ["number"],
    },
    "cache_control": {"type": "ephemeral"},
}


@pytest.mark.parametrize("where", ["tools", "last_turn"])
def test_a_mark_on_a_tool_or_a_turn_keeps_the_prefix_up_to_it(env: Env, where: str) -> None:
    """A tool's mark keeps the prompt up to the tools; a turn's up to that turn, so the next
    call of the conversation reads it."""
    c = env.client("alpha")
    lead = "" if where == "tools" else SYSTEM  # the tools' text is long already
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": f"{lead} Which item is about {where}?"},
        {"role": "assistant", "content": "Item 4."},
        {"role": "user", "content": [{"type": "text", "text": "Why?"}]},
    ]
    kw: dict[str, Any] = {"tools": [TOOL]} if where == "tools" else {}
    if where == "last_turn":
        turns[2]["content"][0]["cache_control"] = {"type": "ephemeral"}
    first = c.messages.create(model="tiny", max_tokens=4, messages=turns, **kw).usage
    assert first.cache_creation_input_tokens >= 16 and first.cache_read_input_tokens == 0
    more = [*turns, {"role": "assistant", "content": "It is."}, {"role": "user", "content": "Ok"}]
    second = c.messages.create(model="tiny", max_tokens=4, messages=more, **kw).usage
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens
    if where == "last_turn":  # all the first prompt but its generation prompt was marked
        assert first.input_tokens < 16 + 8
    else:  # the tools only: the turns after them were not
        assert first.input_tokens > 16
