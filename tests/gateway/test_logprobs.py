"""Logprobs through the gateway: the official openai client asks for completions
`logprobs=2` and chat `logprobs=True, top_logprobs=2`, streamed and not, on a P/D model and a
colocated one; the SDK parses the answers, and the values equal the node's own answer for the
same prompt token ids (the node's equal the engine's: tests/nodes/test_logprobs.py)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.accounts.store.base import UsageRecord
from gateway.accounts.store.sqlite import SqliteStore
from tests.gateway.helpers import MODEL, gateway_proc, http, make_team, tiny_model
from tests.procs import Proc, running
from text.tokenizer import Tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"max_tokens": 6, "temperature": 0}
TOL = 1e-5  # the same engine; the prefix cache's reuse changes the fp32 arithmetic by ~1e-7


@pytest.fixture(scope="module")
def gw(
    pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, str]]:
    p, d, both = pd_nodes
    models = {
        MODEL: tiny_model(tiny_llama, prefill=[p.url], decode=[d.url]),
        "tiny-colocated": tiny_model(tiny_llama, both=[both.url]),
    }
    g = gateway_proc(tmp_path_factory.mktemp("gw-lp"), models)
    with running(g):
        yield g, make_team(g.url, "lp")


async def node_logprobs(node: Proc, ids: list[int], n: int) -> dict[str, Any]:
    """The node's own completions logprobs object for these token ids (greedy)."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(node.url + "/v1/completions", json={"prompt": ids, **GREEDY, "logprobs": n}) as r,
    ):
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["logprobs"]


def _by_string(tok: Tokenizer, tops: list[dict[str, Any]]) -> list[str]:
    """Top tokens by id as completions keys them: by string, two ids that decode alike once."""
    return list(dict.fromkeys(tok.decode([t["token_id"]]) for t in tops))


def _ranked(e: dict[str, Any]) -> bool:
    """A greedy position in vLLM's token-id form: the sampled token is the likeliest (rank 1),
    listed first among its top tokens, which are ranked 1, 2, … in falling logprob."""
    tops = e["top_logprobs"]
    return (
        e["rank"] == 1
        and (tops[0]["token_id"], tops[0]["logprob"]) == (e["token_id"], e["logprob"])
        and [t["rank"] for t in tops] == list(range(1, len(tops) + 1))
        and all(a["logprob"] >= b["logprob"] for a, b in itertools.pairwise(tops))
    )


def _close(a: list[float | None], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        x is not None and abs(x - y) < TOL for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("model", [MODEL, "tiny-colocated"])
async def test_completions_logprobs(
    gw: tuple[Proc, str], pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path, model: str
) -> None:
    g, key = gw
    ref = await node_logprobs(pd_nodes[2], Tokenizer(tiny_llama).encode(PROMPT), 2)
    client = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    r = client.completions.create(model=model, prompt=PROMPT, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens == ref["tokens"] and lp.text_offset == ref["text_offset"]
    assert _close(lp.token_logprobs or [], ref["token_logprobs"])
    assert lp.top_logprobs is not None and [list(t or {}) for t in lp.top_logprobs] == [
        list(t) for t in ref["top_logprobs"]
    ]
    for got, want in zip(lp.top_logprobs, ref["top_logprobs"], strict=True):
        assert got is not None and _close(list(got.values()), list(want.values()))
    tokens, values = [], []
    for c in client.completions.create(
        model=model, prompt=PROMPT, logprobs=2, stream=True, **GREEDY
    ):
        for ch in c.choices:
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens or []
                values += ch.logprobs.token_logprobs or []
    assert tokens == ref["tokens"] and _close(values, ref["token_logprobs"])
    assert (
        client.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].logprobs is None
    )


@pytest.mark.parametrize("model", [MODEL, "tiny-colocated"])
async def test_chat_logprobs(
    gw: tuple[Proc, str], pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path, model: str
) -> None:
    g, key = gw
    ref = await node_logprobs(pd_nodes[2], Tokenizer(tiny_llama).encode_chat(MESSAGES), 2)
    client = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    kw: dict[str, Any] = {
        "model": model,
        "messages": MESSAGES,
        "logprobs": True,
        "top_logprobs": 2,
        **GREEDY,
    }
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [e.token for e in content] == ref["tokens"]
    assert _close([e.logprob for e in content], ref["token_logprobs"])
    for e, want in zip(content, ref["top_logprobs"], strict=True):
        assert e.bytes == list(e.token.encode())
        assert [t.token for t in e.top_logprobs] == list(want)
        assert _close([t.logprob for t in e.top_logprobs], list(want.values()))
    streamed = [
        e
        for c in client.chat.completions.create(**kw, stream=True)
        for ch in c.choices
        if ch.logprobs is not None
        for e in ch.logprobs.content or []
    ]
    assert [e.token for e in streamed] == ref["tokens"]
    assert _close([e.logprob for e in streamed], ref["token_logprobs"])
    plain = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": -1}, "logprobs"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": MESSAGES, "top_logprobs": 2},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "logprobs": 3}, "logprobs"),
    ],
)
def test_bad_logprobs_get_400(
    gw: tuple[Proc, str], path: str, body: dict[str, Any], param: str
) -> None:
    g, key = gw
    status, _, answer = http(g.url + path, "POST", {**body, "max_tokens": 2}, key=key)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    status, _, answer = http(
        g.url + "/v1/completions", "POST", {"model": MODEL, "prompt": "x", "max_tokens": 2}, key=key
    )
    assert status == 200, answer


# -- token-in/token-out: vLLM's /inference/v1/generate and the render endpoints ---------------


@pytest.mark.parametrize("model", [MODEL, "tiny-colocated"])
def test_generate_equals_completions_with_the_same_ids(
    gw: tuple[Proc, str], tiny_llama: Path, model: str
) -> None:
    """generate's token ids and logprobs are the ones /v1/completions makes for the same prompt
    ids (greedy, fp32), on P/D and colocated, billed as any request."""
    g, key = gw
    tok = Tokenizer(tiny_llama)
    ids = tok.encode(PROMPT)
    client = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    ref = client.completions.create(model=model, prompt=ids, logprobs=2, **GREEDY)
    lp = ref.choices[0].logprobs
    assert lp is not None and ref.usage is not None
    sampling = {"max_tokens": GREEDY["max_tokens"], "temperature": 0, "logprobs": 2, "top_k": -1}
    body = {"model": model, "token_ids": ids, "sampling_params": sampling, "output_mode": "tokens"}
    status, headers, out = http(g.url + "/inference/v1/generate", "POST", body, key=key)
    assert status == 200, out
    choice = out["choices"][0]
    assert len(choice["token_ids"]) == ref.usage.completion_tokens
    assert tok.decode(choice["token_ids"]) == ref.choices[0].text
    assert choice["finish_reason"] == ref.choices[0].finish_reason
    assert out["output_mode"] == "tokens" and out["model"] == model
    # vLLM's token-id form: the sampled token and its rank, then the top tokens by id
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == choice["token_ids"]
    assert [tok.decode([e["token_id"]]) for e in content] == lp.tokens
    assert _close([e["logprob"] for e in content], lp.token_logprobs or [])
    assert [_by_string(tok, e["top_logprobs"]) for e in content] == [
        list(t or {}) for t in lp.top_logprobs or []
    ]
    assert all(_ranked(e) for e in content)
    assert out["usage"]["prompt_tokens"] == len(ids) == ref.usage.prompt_tokens
    assert float(headers["x-duet-cost-usd"]) > 0  # billed
    # vLLM's return_token_ids on /v1/completions gives the same ids
    again = client.completions.create(
        model=model, prompt=ids, extra_body={"return_token_ids": True}, **GREEDY
    )
    assert again.choices[0].model_extra["token_ids"] == choice["token_ids"]  # type: ignore[index]


@pytest.mark.parametrize("model", [MODEL, "tiny-colocated"])
async def test_streamed_generate_is_the_whole_answer_billed_once(
    gw: tuple[Proc, str], tiny_llama: Path, model: str
) -> None:
    """`stream: true` streams vLLM's generate chunks (token ids, their logprobs, the finish
    reason; the usage last when asked): together the whole answer's tokens, and one usage
    record each, the same figures (read through the official openai client's SSE reader)."""
    g, _ = gw
    team = "lp-stream-" + model
    key = make_team(g.url, team)
    ids = Tokenizer(tiny_llama).encode(PROMPT)
    sampling = {"max_tokens": GREEDY["max_tokens"], "temperature": 0, "logprobs": 2}
    body = {"model": model, "token_ids": ids, "sampling_params": sampling, "request_id": "r-1"}
    status, _, whole = http(g.url + "/inference/v1/generate", "POST", body, key=key)
    assert status == 200, whole
    client = openai.OpenAI(base_url=g.url, api_key=key, max_retries=0)
    assert whole["prompt_token_ids"] is None  # not asked
    asked = {**body, "return_token_ids": True}
    assert (
        http(g.url + "/inference/v1/generate", "POST", asked, key=key)[2]["prompt_token_ids"] == ids
    )
    streamed = {
        **body,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    events: list[dict[str, Any]] = list(
        client.post(
            "/inference/v1/generate",
            cast_to=object,
            body=streamed,
            stream=True,
            stream_cls=openai.Stream[dict[str, Any]],
        )
    )
    assert {e["request_id"] for e in events} == {"r-1"}
    # vLLM's return_token_ids: the prompt's ids on the first event only
    assert events[0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in e for e in events[1:])
    choices = [c for e in events for c in e["choices"]]
    want = whole["choices"][0]
    assert [t for c in choices for t in c["token_ids"]] == want["token_ids"]
    assert len(choices) > 1 and all(c["token_ids"] for c in choices[:-1])  # one step a chunk
    assert choices[-1]["finish_reason"] == want["finish_reason"]
    assert {e["output_mode"] for e in events} == {"tokens"}
    got_lp = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
    want_lp = want["logprobs"]["content"]
    assert [e["token_id"] for e in got_lp] == want["token_ids"]
    assert [[t["token_id"] for t in e["top_logprobs"]] for e in got_lp] == [
        [t["token_id"] for t in e["top_logprobs"]] for e in want_lp
    ]
    assert _close([e["logprob"] for e in got_lp], [e["logprob"] for e in want_lp])
    assert all(_ranked(e) for e in got_lp)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(
        want["token_ids"]
    )
    assert events[-1]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    rows = [r for r in await _records(g.log_path.parent / "gateway.db", team) if r.status == "ok"]
    assert len(rows) == 3, rows  # two whole answers and the streamed one: each billed once
    assert {(r.prompt_tokens, r.completion_tokens) for r in rows} == {
        (len(ids), len(want["token_ids"]))
    }
    assert all(r.cost_usd > 0 for r in rows)


async def _records(db: Path, team: str) -> list[UsageRecord]:
    """The gateway's usage records of `team`, read from its SQLite store (WAL: readable while it
    runs)."""
    store = SqliteStore(db)
    await store.open()
    try:
        return await store.usage_records(team, 0, 1e12)
    finally:
        await store.close()


def test_render_then_generate_equals_chat(gw: tuple[Proc, str], tiny_llama: Path) -> None:
    """Render a chat body into the ids the model is sent, generate from them: the chat
    endpoint's greedy answer, token for token."""
    g, key = gw
    tok = Tokenizer(tiny_llama)
    chat = {"model": MODEL, "messages": MESSAGES, **GREEDY}
    status, _, rendered = http(g.url + "/v1/chat/completions/render", "POST", chat, key=key)
    assert status == 200, rendered
    assert rendered["token_ids"] == tok.encode_chat(MESSAGES)
    assert rendered["sampling_params"] == GREEDY and rendered["model"] == MODEL
    status, _, out = http(g.url + "/inference/v1/generate", "POST", rendered, key=key)
    assert status == 200, out
    client = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    answer = client.chat.completions.create(**chat)  # type: ignore[arg-type]
    assert tok.decode(out["choices"][0]["token_ids"]) == answer.choices[0].message.content
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
    status, _, listed = http(g.url + "/v1/completions/render", "POST", body, key=key)
    assert status == 200 and listed == [
        {"token_ids": tok.encode(PROMPT), "sampling_params": {"max_tokens": 3}, "model": MODEL}
    ], listed


@pytest.mark.parametrize(
    "body, param",
    [
        ({"token_ids": [1, 2], "sampling_params": {}}, "model"),
        ({"model": MODEL, "sampling_params": {}}, "token_ids"),
        ({"model": MODEL, "token_ids": [], "sampling_params": {}}, "token_ids"),
        ({"model": MODEL, "token_ids": [1], "sampling_params": {"temperature": -1}}, None),
        ({"model": MODEL, "token_ids": [1], "sampling_params": {"logprobs": 21}}, None),
        ({"model": MODEL, "token_ids": [1], "sampling_params": {"beam": 2}}, None),
        (
            {"model": MODEL, "token_ids": [1], "sampling_params": {}, "stream_options": {}},
            "stream_options",
        ),
        ({"model": MODEL, "token_ids": [1], "sampling_params": {}, "priority": 3}, "priority"),
        (
            {"model": MODEL, "token_ids": [1], "sampling_params": {}, "output_mode": "text"},
            "output_mode",
        ),
    ],
)
def test_bad_generate_bodies_get_400(
    gw: tuple[Proc, str], body: dict[str, Any], param: str | None
) -> None:
    g, key = gw
    status, _, answer = http(g.url + "/inference/v1/generate", "POST", body, key=key)
    assert status == 400, answer
    want = param or f"sampling_params.{next(iter(body['sampling_params']))}"
    assert answer["error"]["param"] == want, answer
    status, _, answer = http(g.url + "/inference/v1/generate", "POST", body, key=None)
    assert status == 401, answer


async def test_a_nodes_generate_equals_its_completions(
    pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path
) -> None:
    """The node's own /inference/v1/generate (what the gateway's is to the cluster) answers the
    tokens and logprobs its /v1/completions makes for the same ids; a bad field is a 400 naming
    it as the generate body does."""
    node = pd_nodes[2]
    ids = Tokenizer(tiny_llama).encode(PROMPT)
    ref = await node_logprobs(node, ids, 2)
    sampling = {"max_tokens": GREEDY["max_tokens"], "temperature": 0, "logprobs": 2}
    async with aiohttp.ClientSession() as s:
        body = {"token_ids": ids, "sampling_params": sampling}
        async with s.post(node.url + "/inference/v1/generate", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        bad = {"token_ids": ids, "sampling_params": {"top_p": 7}}
        async with s.post(node.url + "/inference/v1/generate", json=bad) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "sampling_params.top_p"
    choice = out["choices"][0]
    assert len(choice["token_ids"]) == out["usage"]["completion_tokens"] == len(ref["tokens"])
    content = choice["logprobs"]["content"]
    tok = Tokenizer(tiny_llama)
    assert [e["token_id"] for e in content] == choice["token_ids"]
    assert [tok.decode([e["token_id"]]) for e in content] == ref["tokens"]
    assert _close([e["logprob"] for e in content], ref["token_logprobs"])
    assert [_by_string(tok, e["top_logprobs"]) for e in content] == [
        list(t) for t in ref["top_logprobs"]
    ]
    assert all(_ranked(e) for e in content)
    # streamed: the same ids in order, one chunk per step, the usage last when asked
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            node.url + "/inference/v1/generate",
            json={
                **body,
                "stream": True,
                "stream_options": {"include_usage": True},
                "return_token_ids": True,
            },
        ) as r,
    ):
        assert r.status == 200 and r.content_type == "text/event-stream"
        lines = [ln.strip() async for ln in r.content if ln.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert events[0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in e for e in events[1:])
    chunks = [c for e in events for c in e["choices"]]
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert chunks[-1]["finish_reason"] == choice["finish_reason"]
    streamed = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
    assert [e["token_id"] for e in streamed] == choice["token_ids"]
    assert _close([e["logprob"] for e in streamed], ref["token_logprobs"])
    assert all(_ranked(e) for e in streamed)
    usage = events[-1]["usage"]  # the prompt's blocks are cached by now: only the counts agree
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == len(choice["token_ids"])
    assert usage["prompt_tokens"] == out["usage"]["prompt_tokens"]


async def test_a_nodes_render_equals_the_gateways(
    gw: tuple[Proc, str], pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path
) -> None:
    """A node renders a chat body into the ids the gateway renders for its model, and a
    completions body into its prompt's ids, with the body's sampling fields."""
    g, key = gw
    node = pd_nodes[2]
    chat = {"messages": MESSAGES, **GREEDY}
    _, _, want = http(
        g.url + "/v1/chat/completions/render", "POST", {**chat, "model": MODEL}, key=key
    )
    async with aiohttp.ClientSession() as s:
        async with s.post(node.url + "/v1/chat/completions/render", json=chat) as r:
            assert r.status == 200, await r.text()
            got = await r.json()
        body = {"prompt": PROMPT, "max_tokens": 3}
        async with s.post(node.url + "/v1/completions/render", json=body) as r:
            assert r.status == 200, await r.text()
            listed = await r.json()
        async with s.post(node.url + "/v1/completions/render", json={"prompt": ""}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
    assert got["token_ids"] == want["token_ids"] == Tokenizer(tiny_llama).encode_chat(MESSAGES)
    assert got["sampling_params"] == GREEDY
    assert (
        listed
        == [
            {
                "token_ids": Tokenizer(tiny_llama).encode(PROMPT),
                "sampling_params": {"max_tokens": 3},
                "model": listed[0]["model"],
            }
        ]
        and listed[0]["model"]
    )
