"""A node killed (SIGKILL) at each stage of a request gives the defined answer (DESIGN §1), and
no KV blocks stay held on the surviving nodes:

- P dead before the prefill leg → another P, or prefill locally on D: same greedy output;
- P killed right after its prefill leg → D's pull fails, D recomputes: same greedy output;
- D killed before its first token → another D: same greedy output;
- D killed mid-stream → an SSE error event, and the usage record says so;
- a client that disconnects → the request is aborted on the nodes it touched.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import openai
import pytest

from bench.pd_client import completion
from tests.gateway.faults import KillRelay, Mode
from tests.gateway.helpers import MODEL, gateway_proc, http, make_team, metric, tiny_model
from tests.procs import Proc, duet_node, running
from tests.wait import until
from text.tokenizer import Tokenizer

COMMON = ("--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")
PROMPT = "a prompt long enough to fill a few KV blocks: " + "lorem ipsum " * 12
GREEDY = {"max_tokens": 10, "temperature": 0}


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


def _node(role: str, model: Path, tmp: Path) -> Proc:
    return duet_node(role, model, tmp, *COMMON)


async def relay(relays: list[KillRelay], node: Proc, mode: Mode, chunks: int = 3) -> KillRelay:
    r = await KillRelay(node, mode, chunks).start()
    relays.append(r)
    return r


async def reference(node: Proc, tiny_llama: Path) -> str:
    ids = Tokenizer(tiny_llama).encode(PROMPT)
    async with aiohttp.ClientSession() as s:
        r = await completion(s, node.url, ids, {**GREEDY, "ignore_eos": True})
    assert r.error is None
    return r.text


def nothing_held(*nodes: Proc) -> bool:
    return all(
        metric(n.url, "duet:num_requests_held") == 0
        and metric(n.url, "duet:num_requests_running") == 0
        and metric(n.url, "duet:kv_cache_usage_perc") == 0
        for n in nodes
    )


def gw_started(tmp: Path, tiny_llama: Path, **static: list[str]) -> Proc:
    return gateway_proc(tmp, {MODEL: tiny_model(tiny_llama, **static)})


def client(g: Proc, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)


async def ask(g: Proc, key: str) -> str:
    r = await client(g, key).completions.create(
        model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True}, **GREEDY
    )
    return r.choices[0].text


async def test_prefill_dead_before_leg(tmp: Path, tiny_llama: Path) -> None:
    p1, p2, d = (
        _node("prefill", tiny_llama, tmp),
        _node("prefill", tiny_llama, tmp),
        _node("decode", tiny_llama, tmp),
    )
    with running(p1, p2, d):
        want = await reference(d, tiny_llama)
        p1.kill()
        g = gw_started(tmp, tiny_llama, prefill=[p1.url, p2.url], decode=[d.url])
        with running(g):
            key = make_team(g.url, "f")
            before = metric(p2.url, "duet:prompt_tokens_total")
            assert await ask(g, key) == want  # P1 refused the connection: P2 did the prefill
            assert metric(p2.url, "duet:prompt_tokens_total") > before
            assert metric(g.url, "duet:gateway_retries_total") >= 1
            p2.kill()
            assert await ask(g, key) == want  # no P left: D prefilled locally
            await until(lambda: nothing_held(d), what="D to hold nothing")


async def test_prefill_killed_after_leg(
    tmp: Path, tiny_llama: Path, relays: list[KillRelay]
) -> None:
    p, d = _node("prefill", tiny_llama, tmp), _node("decode", tiny_llama, tmp)
    with running(p, d):
        want = await reference(d, tiny_llama)
        r = await relay(relays, p, "after_response")
        g = gw_started(tmp, tiny_llama, prefill=[r.url], decode=[d.url])
        with running(g):
            key = make_team(g.url, "f")
            assert await ask(g, key) == want  # D's pull failed; D recomputed the prompt
            assert r.killed
            await until(lambda: nothing_held(d), what="D to hold nothing")


async def test_decode_killed_before_first_token(
    tmp: Path, tiny_llama: Path, relays: list[KillRelay]
) -> None:
    p, d1, d2 = (
        _node("prefill", tiny_llama, tmp),
        _node("decode", tiny_llama, tmp),
        _node("decode", tiny_llama, tmp),
    )
    with running(p, d1, d2):
        want = await reference(d2, tiny_llama)
        r = await relay(relays, d1, "on_request")
        g = gw_started(tmp, tiny_llama, prefill=[p.url], decode=[r.url, d2.url])
        with running(g):
            key = make_team(g.url, "f")
            assert await ask(g, key) == want  # D1 died: the gateway went to D2
            assert r.killed
            # the first try's prefill blocks were released on P (abort), the second try's by D2
            await until(lambda: nothing_held(p, d2), what="P and D2 to hold nothing")
            records = http(g.url + "/v1/usage?group_by=model", key=key)[2]["data"]
            assert records[0]["requests"] == 1


async def test_decode_killed_mid_stream(
    tmp: Path, tiny_llama: Path, relays: list[KillRelay]
) -> None:
    p, d = _node("prefill", tiny_llama, tmp), _node("decode", tiny_llama, tmp)
    with running(p, d):
        r = await relay(relays, d, "after_chunks", chunks=3)
        g = gw_started(tmp, tiny_llama, prefill=[p.url], decode=[r.url])
        with running(g):
            key = make_team(g.url, "f")
            stream = await client(g, key).completions.create(
                model=MODEL,
                prompt=PROMPT,
                stream=True,
                max_tokens=200,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            got = []
            with pytest.raises(openai.APIError, match="mid-stream"):
                async for chunk in stream:
                    got.append(chunk.choices[0].text)
            assert got and r.killed
            await until(lambda: nothing_held(p), what="P to hold nothing")
            await until(
                lambda: metric(g.url, "duet:gateway_requests_total") >= 1, what="the record"
            )
            rows = _records(g, key)
            assert [x["status"] for x in rows] == ["error_midstream"]
            assert 1 <= rows[0]["completion_tokens"] < 200


async def test_client_disconnect_aborts_on_nodes(tmp: Path, tiny_llama: Path) -> None:
    p, d = _node("prefill", tiny_llama, tmp), _node("decode", tiny_llama, tmp)
    with running(p, d):
        g = gw_started(tmp, tiny_llama, prefill=[p.url], decode=[d.url])
        with running(g):
            key = make_team(g.url, "f")
            body = {
                "model": MODEL,
                "prompt": PROMPT,
                "stream": True,
                "max_tokens": 800,
                "temperature": 0,
                "ignore_eos": True,
            }
            async with aiohttp.ClientSession() as s:
                resp = await s.post(
                    g.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )
                assert resp.status == 200, await resp.text()
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        break  # the first token is out: now leave
                resp.close()
            await until(lambda: nothing_held(p, d), what="the nodes to drop the request")
            try:
                await until(lambda: bool(_records(g, key)), what="the usage record")
            except AssertionError:
                print(g.log()[-5000:])
                raise
            rows = _records(g, key)
            assert rows[0]["status"] == "client_disconnected"
            assert rows[0]["completion_tokens"] < 800
            assert metric(d.url, "duet:generation_tokens_total") < 800


def _records(g: Proc, key: str) -> list[dict]:  # type: ignore[type-arg]
    """This team's usage records, read through the CLI (what an operator runs)."""
    import json
    import subprocess
    import sys

    db = Path(g.args[g.args.index("--config") + 1]).parent / "gateway.db"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "duet",
            "usage",
            "report",
            "--store",
            f"sqlite://{db}",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)
