"""An answer that breaks off mid-way bills exactly the completion tokens its client was sent
(money that cannot leak; a team never pays for what it did not get) — real node
processes (tiny random Llama, fp32, so greedy output is exact), a real gateway, the official
openai client.

The decode node is SIGKILLed mid-stream (tests/gateway/faults.py's relay, after N events) and
no other node can continue the stream, so the answer ends with an SSE error event (or, whole,
a 502). The kill lands right after a node delta that carried a token but no text (its byte
starts a UTF-8 character the next token finishes: the tiny model's byte-level BPE makes many):
the gateway read that token, the client never got anything of it.

What the client received is counted exactly from the node's own deltas: the same greedy run
straight from the node gives each delta's tokens and text; the client has the text of the
shortest run of deltas whose text is what it received, and their tokens are the tokens it got.
(The chunk count is not exact: one chunk's text may finish several tokens.)
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.gateway.faults import KillRelay
from tests.gateway.helpers import MODEL, gateway_proc, make_team, tiny_model
from tests.gateway.test_failures import _node, _records
from tests.procs import Proc, running
from tests.wait import until
from text.tokenizer import Tokenizer

PROMPT = "a prompt long enough to fill a few KV blocks: " + "lorem ipsum " * 12
MAX = 60
GREEDY = {"max_tokens": MAX, "temperature": 0, "ignore_eos": True}


async def deltas(node: Proc, tiny_llama: Path) -> list[tuple[int, str]]:
    """The uninterrupted run straight from the node: (tokens, text) of each SSE delta."""
    ids = Tokenizer(tiny_llama).encode(PROMPT)
    out = []
    async with (
        aiohttp.ClientSession() as s,
        s.post(node.url + "/v1/completions", json={"prompt": ids, "stream": True, **GREEDY}) as r,
    ):
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                c = json.loads(line[6:])["choices"][0]
                out.append((len(c.get("token_ids") or ()), c["text"]))
    assert sum(n for n, _ in out) == MAX and all(n == 1 for n, _ in out)
    return out


def cut_after_textless(run: list[tuple[int, str]]) -> int:
    """How many deltas the node sends before it dies: up to one that carried a token but no
    text, with text before it (so the stream has begun)."""
    for k in range(2, len(run) - 1):
        if not run[k - 1][1] and any(t for _, t in run[: k - 1]):
            return k
    pytest.fail("the greedy run has no delta without text: pick another prompt")


def tokens_received(run: list[tuple[int, str]], text: str) -> int:
    """The tokens of the shortest run of deltas whose text is `text` (what the client got)."""
    got, tokens = "", 0
    for n, t in run:
        if got == text:
            return tokens
        got, tokens = got + t, tokens + n
    assert got == text
    return tokens


def gateway(tmp: Path, tiny_llama: Path, decode: str) -> Proc:
    return gateway_proc(tmp, {MODEL: tiny_model(tiny_llama, decode=[decode])})


async def one_record(g: Proc, key: str) -> dict[str, object]:
    await until(lambda: bool(_records(g, key)), what="the usage record")
    rows = _records(g, key)
    assert len(rows) == 1, rows
    return rows[0]


async def test_a_cut_stream_bills_what_the_client_received(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay]
) -> None:
    """The only decode node dies mid-stream (no node to migrate to): the record bills the
    tokens whose text the client received, not the token the gateway read but never sent."""
    d = _node("decode", tiny_llama, tmp_path)
    with running(d):
        run = await deltas(d, tiny_llama)
        cut = cut_after_textless(run)
        r = await KillRelay(d, "after_chunks", cut).start()
        relays.append(r)
        g = gateway(tmp_path, tiny_llama, r.url)
        with running(g):
            key = make_team(g.url, "b")
            c = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
            stream = await c.completions.create(
                model=MODEL,
                prompt=PROMPT,
                stream=True,
                max_tokens=MAX,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            text = ""
            with pytest.raises(openai.APIError, match="mid-stream"):
                async for chunk in stream:
                    text += chunk.choices[0].text
            assert r.killed and text
            received = tokens_received(run, text)
            assert received < sum(n for n, _ in run[:cut])  # the gateway read more than it sent
            row = await one_record(g, key)
            assert row["status"] == "error_midstream"
            assert row["completion_tokens"] == received, (row, text)
            assert sum(row["leg_tokens"]) == cut  # what the node made, for the operator


async def test_a_cut_whole_answer_bills_no_completion_tokens(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay]
) -> None:
    """The same cut under a whole (non-streamed) answer: the client gets a 502 and none of the
    tokens, so the record bills none (its prompt, computed, is still paid)."""
    d = _node("decode", tiny_llama, tmp_path)
    with running(d):
        r = await KillRelay(d, "after_chunks", 6).start()
        relays.append(r)
        g = gateway(tmp_path, tiny_llama, r.url)
        with running(g):
            key = make_team(g.url, "b")
            c = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.APIStatusError, match="broke off") as e:
                await c.completions.create(
                    model=MODEL,
                    prompt=PROMPT,
                    max_tokens=MAX,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            assert e.value.status_code == 502 and r.killed
            row = await one_record(g, key)
            assert row["status"] == "error_midstream" and row["completion_tokens"] == 0, row
            assert sum(row["leg_tokens"]) == 6 and row["prompt_tokens"] > 0 and row["cost_usd"] > 0


async def test_a_stream_cut_before_any_text_is_a_502_billing_no_completion(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay]
) -> None:
    """The node dies after one delta that showed no text: the client was sent nothing, so the
    answer is a plain 502 (not an SSE stream that never opened) and bills no completion tokens."""
    d = _node("decode", tiny_llama, tmp_path)
    with running(d):
        run = await deltas(d, tiny_llama)
        assert run[0] == (1, "")  # this prompt's first token is a byte of an unfinished character
        r = await KillRelay(d, "after_chunks", 1).start()
        relays.append(r)
        g = gateway(tmp_path, tiny_llama, r.url)
        with running(g):
            key = make_team(g.url, "b")
            c = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.APIStatusError, match="mid-stream") as e:
                stream = await c.completions.create(
                    model=MODEL,
                    prompt=PROMPT,
                    stream=True,
                    max_tokens=MAX,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                async for _ in stream:
                    pass
            assert e.value.status_code == 502 and r.killed
            row = await one_record(g, key)
            assert row["status"] == "error_midstream" and row["completion_tokens"] == 0, row
            assert row["leg_tokens"] == [1]
