"""End to end with real processes: P and D nodes (and a colocated node) on the tiny model, a
`duet gateway`, and the official `openai` client, sync and async, streaming and not, chat and
completions. Greedy output through the gateway equals the node's own output for the same
prompt token ids."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from bench.pd_client import completion
from gateway.accounts.store.base import UsageRecord
from gateway.accounts.store.sqlite import SqliteStore
from tests.gateway.helpers import MODEL, gateway_proc, http, make_team, metric, scrape, tiny_model
from tests.procs import Proc, running
from text.tokenizer import Tokenizer

GREEDY = {"max_tokens": 12, "temperature": 0}
PROMPTS = ["hello world", "The quick brown fox jumps over the lazy dog " * 4, "a"]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "tell me a story " * 6},
    ],
]


@pytest.fixture(scope="module")
def gw(
    pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, str]]:
    p, d, both = pd_nodes
    tmp = tmp_path_factory.mktemp("gw")
    models = {
        MODEL: tiny_model(tiny_llama, prefill=[p.url], decode=[d.url]),
        "tiny-colocated": tiny_model(tiny_llama, both=[both.url]),
    }
    g = gateway_proc(tmp, models)
    with running(g):
        yield g, make_team(g.url, "e2e")


async def _records(db: Path, team: str) -> list[UsageRecord]:
    """The gateway's usage records, read from its SQLite store (WAL: readable while it runs)."""
    store = SqliteStore(db)
    await store.open()
    try:
        return await store.usage_records(team, 0, 1e12)
    finally:
        await store.close()


async def node_text(node: Proc, ids: list[int], **params: object) -> tuple[str, int]:
    async with aiohttp.ClientSession() as s:
        r = await completion(s, node.url, ids, {**GREEDY, **params})
    assert r.error is None, r.error
    return r.text, len(r.token_ids)


@pytest.mark.parametrize("model", [MODEL, "tiny-colocated"])
async def test_sync_greedy_equals_node(
    gw: tuple[Proc, str], pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path, model: str
) -> None:
    g, key = gw
    both = pd_nodes[2]
    tok = Tokenizer(tiny_llama)
    client = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    for prompt in PROMPTS:
        r = client.completions.create(model=model, prompt=prompt, **GREEDY)
        text, n = await node_text(both, tok.encode(prompt))
        assert r.choices[0].text == text
        assert r.usage.completion_tokens == n and r.usage.prompt_tokens == len(tok.encode(prompt))
        assert (
            r.usage.prompt_tokens_details is not None
            and r.usage.prompt_tokens_details.cached_tokens >= 0
        )
    for messages in CHATS:
        c = client.chat.completions.create(model=model, messages=messages, **GREEDY)
        ids = tok.encode_chat(messages)
        text, n = await node_text(both, ids)
        assert c.choices[0].message.content == text and c.choices[0].message.role == "assistant"
        assert c.usage.prompt_tokens == len(ids) and c.usage.completion_tokens == n
        assert c.object == "chat.completion" and c.id.startswith("chatcmpl-")


async def test_async_streaming_matches_whole(gw: tuple[Proc, str]) -> None:
    g, key = gw
    client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    for messages in CHATS:
        whole = await client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        parts, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
                assert chunk.choices == []
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        assert "".join(parts) == whole.choices[0].message.content
        assert finish == whole.choices[0].finish_reason
        assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
        # the second time the prompt's full blocks are cached on the nodes
        assert (
            usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 16 * 16
            or usage.prompt_tokens < 16
        )
    stream = await client.completions.create(model=MODEL, prompt=PROMPTS[1], stream=True, **GREEDY)
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    whole_c = await client.completions.create(model=MODEL, prompt=PROMPTS[1], **GREEDY)
    assert text == whole_c.choices[0].text


async def _connections_for_streams(
    url: str, body: dict[str, object], headers: dict[str, str], n: int
) -> int:
    """New TCP connections an aiohttp client opened for `n` sequential streams, reading each
    only up to `[DONE]` (as the openai SDK, the gateway and most SSE clients do)."""
    created = 0

    async def on_create(*_: object) -> None:
        nonlocal created
        created += 1

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_create)
    async with aiohttp.ClientSession(trace_configs=[trace]) as s:
        for _ in range(n):
            async with s.post(
                url + "/v1/completions", json={**body, "stream": True, **GREEDY}, headers=headers
            ) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.strip() == b"data: [DONE]":
                        break
    return created


async def test_streams_end_with_done_so_clients_keep_connections(
    gw: tuple[Proc, str], pd_nodes: tuple[Proc, Proc, Proc]
) -> None:
    """The gateway and the nodes send `[DONE]` and the body's end in one send: a client that
    stops at `[DONE]` finds the body ended and reuses its connection (with two sends it often
    found the body unfinished and had to close it — a new connection for the next request)."""
    g, key = gw
    auth = {"Authorization": f"Bearer {key}"}
    assert await _connections_for_streams(g.url, {"model": MODEL, "prompt": "hello"}, auth, 12) == 1
    assert await _connections_for_streams(pd_nodes[2].url, {"prompt": [1, 2, 3]}, {}, 12) == 1


async def test_n_samples_share_one_prefill(
    gw: tuple[Proc, str], pd_nodes: tuple[Proc, Proc, Proc]
) -> None:
    g, key = gw
    p, d, _ = pd_nodes
    client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    prompt = "n samples share one prefill: " + "xyz " * 40
    hits0, p_tokens0 = (
        metric(d.url, "duet:prefix_cache_hits_total"),
        metric(p.url, "duet:prompt_tokens_total"),
    )
    r = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    n_prompt = r.usage.prompt_tokens
    # P computed the prompt once; D served samples 1 and 2 from the KV pulled for sample 0.
    assert metric(p.url, "duet:prompt_tokens_total") - p_tokens0 <= n_prompt
    assert metric(d.url, "duet:prefix_cache_hits_total") - hits0 >= 2 * (n_prompt // 16 * 16)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=CHATS[0],
        n=2,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {0: "", 1: ""}
    roles = set()
    async for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.delta.role:
                roles.add(ch.index)
    assert roles == {0, 1} and texts[0] == texts[1] and texts[0]  # greedy: both samples agree


def test_models_health_metrics_usage(gw: tuple[Proc, str]) -> None:
    g, key = gw
    client = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    assert {m.id for m in client.models.list()} == {MODEL, "tiny-colocated"}
    done = client.completions.create(
        model=MODEL, prompt="count me", max_tokens=3, temperature=0, user="end-user-1"
    )
    status, _, body = http(g.url + "/v1/usage?group_by=model", key=key)
    assert status == 200 and body["team_id"] == "e2e"
    row = next(r for r in body["data"] if r["model"] == MODEL)
    assert row["requests"] >= 1 and row["completion_tokens"] >= 3 and row["cost_usd"] > 0
    # `user` attributes spend: a streamed chat for another end user, then totals per user
    stream = client.chat.completions.create(
        model=MODEL, messages=CHATS[0], max_tokens=2, temperature=0, stream=True, user="end-user-2"
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    status, _, body = http(g.url + "/v1/usage?group_by=user", key=key)
    assert status == 200 and body["group_by"] == "user"
    by_user = {r["user"]: r for r in body["data"]}
    assert by_user["end-user-1"]["requests"] == 1 and by_user["end-user-2"]["requests"] == 1
    assert by_user["end-user-1"]["completion_tokens"] == done.usage.completion_tokens
    assert by_user[None]["requests"] >= 1  # the module's other requests named no user
    status, _, body = http(g.url + "/v1/usage?group_by=nobody", key=key)
    assert (
        status == 400
        and body["error"]["param"] == "group_by"
        and "'user'" in body["error"]["message"]
    )
    # each usage record holds its request's user (committed before the response's end)
    recs = asyncio.run(_records(g.log_path.parent / "gateway.db", "e2e"))
    assert [r.user for r in recs if r.request_id == "req-" + done.id.removeprefix("cmpl-")] == [
        "end-user-1"
    ]
    assert [r.endpoint for r in recs if r.user == "end-user-2"] == ["chat"]
    text = scrape(g.url)
    assert re.search(r'^duet:spend_usd_total\{model="tiny",team="e2e"\} [0-9.e-]+$', text, re.M)
    assert re.search(
        r'^duet:gateway_requests_total\{model="tiny",status="ok",team="e2e",tier="interactive"\}',
        text,
        re.M,
    )
    assert "duet:time_to_first_token_seconds_bucket" in text
    assert http(g.url + "/health", key=None)[0] == 200
