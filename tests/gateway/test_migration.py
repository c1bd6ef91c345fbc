"""Stream migration: a decode node SIGKILLed after its first tokens went out, and the
client's answer goes on from another node — real node processes (tiny random Llama, fp32, so
greedy output is exact), a real gateway, the official openai client.

- D killed mid-stream (P/D and prefill-on-D): the streamed text equals the uninterrupted run
  token for token, and one usage record lists both decode nodes, the migration and each leg's
  tokens, with the prompt billed once;
- the same for a whole (non-streamed) answer;
- the record's cached tokens are the new leg's (its node's prefix-cache hits, up to the prompt);
- n = 2, D killed mid-stream: each choice migrates on its own and equals its uninterrupted run
  (greedy, and seeded sampling: sample i continues seed + i);
- P killed mid-transfer and then D killed mid-stream, in one request: still the same text;
- a seeded sampled request continues its random sequence on the new node; so does a guided
  one under P/D, whose grammar state continues too (P samples the migrated leg's next token);
- the migration limit or the migration deadline reached: a defined SSE error event
  (`migration_limit_reached`, `migration_deadline_exceeded`).

The kill is timed by the relay in front of a node (tests/gateway/faults.py): after N chunks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from bench.pd_client import completion
from tests.gateway.faults import KillRelay
from tests.gateway.helpers import MODEL, gateway_proc, make_team, metric, tiny_model
from tests.gateway.test_failures import _node, _records, nothing_held
from tests.procs import Proc, running
from tests.wait import until
from text.guide_check import canonical_schema
from text.tokenizer import Tokenizer

PROMPT = "a prompt long enough to fill a few KV blocks: " + "lorem ipsum " * 12
MAX = 60


async def kill_after(relays: list[KillRelay], node: Proc, chunks: int) -> KillRelay:
    r = await KillRelay(node, "after_chunks", chunks).start()
    relays.append(r)
    return r


async def reference(node: Proc, tiny_llama: Path, **sampling: Any) -> str:
    """The uninterrupted run, straight from a node."""
    ids = Tokenizer(tiny_llama).encode(PROMPT)
    async with aiohttp.ClientSession() as s:
        r = await completion(
            s, node.url, ids, {"max_tokens": MAX, "temperature": 0, "ignore_eos": True, **sampling}
        )
    assert r.error is None
    return r.text


def gateway(
    tmp: Path, tiny_llama: Path, routing: dict[str, Any] | None = None, **static: list[str]
) -> Proc:
    return gateway_proc(
        tmp, {MODEL: tiny_model(tiny_llama, **static)}, **({"routing": routing} if routing else {})
    )


async def ask(g: Proc, key: str, stream: bool, **sampling: Any) -> str:
    return (await ask_n(g, key, stream, **sampling))[0]


async def ask_n(g: Proc, key: str, stream: bool, **sampling: Any) -> list[str]:
    """Each choice's text, by index."""
    c = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    args = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": MAX,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
        **sampling,
    }
    texts = [""] * sampling.get("n", 1)
    if not stream:
        for choice in (await c.completions.create(**args)).choices:
            texts[choice.index] = choice.text
        return texts
    async for chunk in await c.completions.create(stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    return texts


async def one_record(g: Proc, key: str) -> dict[str, Any]:
    await until(lambda: bool(_records(g, key)), what="the usage record")
    rows = _records(g, key)
    assert len(rows) == 1, rows
    return rows[0]


def check_record(row: dict[str, Any], nodes: list[str], tiny_llama: Path) -> None:
    assert row["status"] == "ok"
    assert row["nodes"].split() == nodes
    assert row["migrations"] == 1
    assert len(row["leg_tokens"]) == 2 and all(row["leg_tokens"]) and sum(row["leg_tokens"]) == MAX
    assert row["completion_tokens"] == MAX
    assert row["prompt_tokens"] == len(Tokenizer(tiny_llama).encode(PROMPT))  # billed once


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_decode_killed_mid_stream_migrates(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay], stream: bool
) -> None:
    d1, d2 = _node("decode", tiny_llama, tmp_path), _node("decode", tiny_llama, tmp_path)
    with running(d1, d2):
        # in team m's prefix-cache domain (gateway/config.py::cache_domain): D2 keeps it cached
        want = await reference(d2, tiny_llama, cache_salt="team:m")
        r = await kill_after(relays, d1, chunks=7)
        g = gateway(tmp_path, tiny_llama, decode=[r.url, d2.url])  # no P: each D prefills
        with running(g):
            key = make_team(g.url, "m")
            hits = metric(d2.url, "duet:prefix_cache_hits_total")
            assert await ask(g, key, stream) == want
            assert r.killed
            row = await one_record(g, key)
            check_record(row, [r.url, d2.url], tiny_llama)
            # D2 ran the reference: the new leg finds the prompt (and the streamed ids) in its
            # prefix cache, and the record counts those hits up to the prompt (billed once)
            new_hits = metric(d2.url, "duet:prefix_cache_hits_total") - hits
            assert new_hits > 0 and row["cached_tokens"] == min(new_hits, row["prompt_tokens"]), (
                new_hits,
                row,
            )
            assert metric(g.url, "duet:gateway_retries_total") >= 1
            await until(lambda: nothing_held(d2), what="D2 to hold nothing")


async def test_pd_migration_pulls_the_kv_again(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay]
) -> None:
    """Under P/D the migrated leg is a P/D request too: P prefills prompt + streamed tokens, D2
    pulls them."""
    p, d1, d2 = (_node(role, tiny_llama, tmp_path) for role in ("prefill", "decode", "decode"))
    with running(p, d1, d2):
        want = await reference(d2, tiny_llama)
        r = await kill_after(relays, d1, chunks=9)
        g = gateway(tmp_path, tiny_llama, prefill=[p.url], decode=[r.url, d2.url])
        with running(g):
            key = make_team(g.url, "m")
            pulled = metric(d2.url, "duet:kv_transfer_bytes_total")
            assert await ask(g, key, True) == want
            assert r.killed
            assert (
                metric(d2.url, "duet:kv_transfer_bytes_total") > pulled
            )  # the migration's KV moved P → D2
            check_record(await one_record(g, key), [p.url, r.url, p.url, d2.url], tiny_llama)
            await until(lambda: nothing_held(p, d2), what="P and D2 to hold nothing")


async def test_prefill_killed_mid_transfer_then_decode_mid_stream(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay]
) -> None:
    """P dies once its prefill leg answered (D1's pull fails: D1 recomputes), then D1 dies
    mid-stream: the migration finds no P and prefills on D2. One answer, exact."""
    p, d1, d2 = (_node(role, tiny_llama, tmp_path) for role in ("prefill", "decode", "decode"))
    with running(p, d1, d2):
        want = await reference(d2, tiny_llama)
        rp = await KillRelay(p, "after_response").start()
        relays.append(rp)
        rd = await kill_after(relays, d1, chunks=5)
        g = gateway(tmp_path, tiny_llama, prefill=[rp.url], decode=[rd.url, d2.url])
        with running(g):
            key = make_team(g.url, "m")
            assert await ask(g, key, True) == want
            assert rp.killed and rd.killed
            check_record(await one_record(g, key), [rp.url, rd.url, d2.url], tiny_llama)
            await until(lambda: nothing_held(d2), what="D2 to hold nothing")


async def test_seeded_sampling_continues(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay]
) -> None:
    """A seeded sampled request: the new node skips the draws of the streamed tokens, so the
    random sequence goes on where it was."""
    sampling = {"temperature": 0.9, "seed": 1234}
    d1, d2 = _node("decode", tiny_llama, tmp_path), _node("decode", tiny_llama, tmp_path)
    with running(d1, d2):
        want = await reference(d2, tiny_llama, **sampling)
        r = await kill_after(relays, d1, chunks=6)
        g = gateway(tmp_path, tiny_llama, decode=[r.url, d2.url])
        with running(g):
            key = make_team(g.url, "m")
            assert await ask(g, key, True, **sampling) == want
            assert r.killed


async def test_guided_pd_migration_continues_the_grammar_and_the_draws(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay]
) -> None:
    """A guided (JSON schema), seeded sampled request under P/D, D killed mid-stream: the
    migrated leg's prefill carries `resume` too, so the token P samples for D comes
    from the grammar state and the seeded draws after the streamed tokens — the text equals the
    uninterrupted run. (Without it P starts the grammar and the draws afresh, and D either
    refuses P's token or emits another one.)"""
    schema = {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 400}},
        "required": ["text"],
    }
    sampling = {"temperature": 0.9, "seed": 99}
    node_guide = {"kind": "json_schema", "spec": canonical_schema(schema)}
    p, d1, d2 = (_node(role, tiny_llama, tmp_path) for role in ("prefill", "decode", "decode"))
    with running(p, d1, d2):
        want = await reference(d2, tiny_llama, guide=node_guide, **sampling)
        assert want.startswith('{"text":"') and len(want) > 40
        r = await kill_after(relays, d1, chunks=9)
        g = gateway(tmp_path, tiny_llama, prefill=[p.url], decode=[r.url, d2.url])
        with running(g):
            key = make_team(g.url, "m")
            pulled = metric(d2.url, "duet:kv_transfer_bytes_total")
            assert (
                await ask(
                    g, key, True, extra_body={"ignore_eos": True, "guided_json": schema}, **sampling
                )
                == want
            )
            assert r.killed
            assert (
                metric(d2.url, "duet:kv_transfer_bytes_total") > pulled
            )  # the migrated leg went P → D2


async def test_migration_limit_is_an_sse_error(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay]
) -> None:
    """max_migrations = 1 and both decode nodes die mid-stream: the client gets the text so far,
    then a defined error event and [DONE]; the record says error_midstream with both legs."""
    d1, d2 = _node("decode", tiny_llama, tmp_path), _node("decode", tiny_llama, tmp_path)
    with running(d1, d2):
        want = await reference(d2, tiny_llama)
        r1, r2 = await kill_after(relays, d1, chunks=4), await kill_after(relays, d2, chunks=4)
        g = gateway(tmp_path, tiny_llama, routing={"max_migrations": 1}, decode=[r1.url, r2.url])
        with running(g):
            key = make_team(g.url, "m")
            text = await ask_until_error(g, key, "migration_limit_reached")
            assert r1.killed and r2.killed
            assert text and want.startswith(text)  # what came is right, nothing repeated
            row = await one_record(g, key)
            assert row["status"] == "error_midstream" and row["migrations"] == 1
            assert row["nodes"].split() == [r1.url, r2.url]
            assert sum(row["leg_tokens"]) == row["completion_tokens"] < MAX


async def test_migration_deadline_is_an_sse_error(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay]
) -> None:
    """Past [routing] migration_deadline_s no migration starts: the error event says why."""
    d1, d2 = _node("decode", tiny_llama, tmp_path), _node("decode", tiny_llama, tmp_path)
    with running(d1, d2):
        r = await kill_after(relays, d1, chunks=4)
        g = gateway(
            tmp_path, tiny_llama, routing={"migration_deadline_s": 0.001}, decode=[r.url, d2.url]
        )
        with running(g):
            key = make_team(g.url, "m")
            assert await ask_until_error(g, key, "migration_deadline_exceeded")
            row = await one_record(g, key)
            assert row["status"] == "error_midstream" and row["migrations"] == 0
            assert row["nodes"].split() == [r.url]


async def ask_until_error(g: Proc, key: str, code: str) -> str:
    """A greedy stream that ends with an SSE error event of `code`, then [DONE]: the text before."""
    events = []
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "stream": True,
        "max_tokens": MAX,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            g.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp,
    ):
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == code, error
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 0.9, "seed": 77}], ids=["greedy", "seeded"]
)
async def test_every_choice_of_n_migrates(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay], sampling: dict[str, Any]
) -> None:
    """n = 2: both samples stream from D1 (sample 1 as a local leg after sample 0's first
    token); D1 dies mid-stream and each sample moves to D2 on its own, with its own streamed ids
    (and seed + i): each choice equals its uninterrupted run."""
    d1, d2 = _node("decode", tiny_llama, tmp_path), _node("decode", tiny_llama, tmp_path)
    with running(d1, d2):
        seeds = [{"seed": sampling["seed"] + i} if sampling else {} for i in range(2)]
        want = [await reference(d2, tiny_llama, **{**sampling, **seed}) for seed in seeds]
        if sampling:
            assert want[0] != want[1]  # distinct samples: a mix-up of the choices would show
        r = await kill_after(relays, d1, chunks=12)
        g = gateway(tmp_path, tiny_llama, decode=[r.url, d2.url])
        with running(g):
            key = make_team(g.url, "m")
            assert await ask_n(g, key, True, n=2, **sampling) == want
            assert r.killed
            row = await one_record(g, key)
            assert (
                row["status"] == "ok"
                and row["completion_tokens"] == 2 * MAX
                and row["migrations"] == 2
            )
            nodes = row["nodes"].split()
            assert nodes[0] == r.url and nodes[1:] == [d2.url, d2.url], nodes
            assert (
                len(row["leg_tokens"]) == 2
                and all(row["leg_tokens"])
                and sum(row["leg_tokens"]) == MAX
            )
            await until(lambda: nothing_held(d2), what="D2 to hold nothing")
