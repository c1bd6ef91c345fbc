"""A pathological constraint cannot stall the gateway: the grammar check of
response_format / structured_outputs / a forced tool choice runs off the event loop on a bounded
pool, a compile past `[server] guide_compile_timeout_s` is a 400 naming the field, and a resent
guide is answered from the cache (text/guide_compile.py).

A real gateway process on the tiny model's tokenizer; no node is needed — every request here is
answered before any node work. The slow guide is the slowest shape the size bounds admit: 11
objects of 1,000 optional properties (~98k characters, ~1 s to compile on the 2-core dev
machine), against a 0.2 s time limit. Order, not duration, is what the tests assert: the gauge
`duet:guide_compiles_running` says a compile is running, and `/v1/models` answers (and /metrics
still shows it running) before it ends."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.helpers import MODEL, gateway_proc, http, make_team, metric, tiny_model
from tests.procs import Proc, free_port, running
from tests.wait import wait_for

TIMEOUT_S = 0.2
RUNNING = "duet:guide_compiles_running"
COMPILES = "duet:guide_compiles_total"
Gw = tuple[Proc, str]


@pytest.fixture(scope="module")
def gw(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gw]:
    tmp = tmp_path_factory.mktemp("gw-guides")
    nowhere = f"http://127.0.0.1:{free_port()}"  # no node: nothing here reaches one
    g = gateway_proc(
        tmp,
        {MODEL: tiny_model(tiny_llama, both=[nowhere])},
        server={"guide_compile_timeout_s": TIMEOUT_S, "guide_compile_threads": 1},
    )
    with running(g):
        yield g, make_team(g.url, "guides")


def slow_schema() -> dict[str, Any]:
    """A schema the bounds admit that compiles for about a second; unique (a fresh cache key)."""
    salt = uuid.uuid4().hex[:6]
    inner = {"type": "object", "properties": {str(i): {} for i in range(1000)}}
    return {"type": "object", "properties": {f"{salt}{k}": inner for k in range(11)}}


def chat(key: str, g: Proc, **over: Any) -> tuple[int, dict[str, str], Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **over,
    }
    return http(g.url + "/v1/chat/completions", "POST", body, key=key)


def as_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def idle(g: Proc) -> None:
    """No compile is running (a timed-out one holds its thread until llguidance returns)."""
    wait_for(lambda: metric(g.url, RUNNING) == 0, 60, "the compile threads to be idle")


def assert_too_complex(answer: tuple[int, dict[str, str], Any], param: str) -> None:
    status, _, body = answer
    assert status == 400, (status, body)
    err = body["error"]
    assert err["param"] == param and err["code"] == "guide_too_complex", err
    assert f"too complex to compile within {TIMEOUT_S:g} s" in err["message"], err


def test_other_requests_are_answered_while_a_guide_compiles(gw: Gw) -> None:
    g, key = gw
    idle(g)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(chat, key, g, response_format=as_format(slow_schema()))
        wait_for(lambda: metric(g.url, RUNNING) >= 1, 60, "the slow schema's compile to start")
        status, _, models = http(g.url + "/v1/models", key=key)
        # the compile that was running before /v1/models was asked is running still: the event
        # loop answered while it compiled (on the old gateway even /metrics waited for it)
        still = metric(g.url, RUNNING)
        assert status == 200 and [m["id"] for m in models["data"]][:1] == [MODEL], models
        assert still >= 1, "the compile ended before /v1/models was answered"
        assert_too_complex(slow.result(timeout=60), "response_format")


def test_a_too_complex_constraint_is_a_400_naming_its_field(gw: Gw) -> None:
    g, key = gw
    idle(g)
    assert_too_complex(
        chat(key, g, structured_outputs={"json": slow_schema()}), "structured_outputs.json"
    )
    idle(g)
    tool = {"type": "function", "function": {"name": "f", "parameters": slow_schema()}}
    assert_too_complex(
        chat(key, g, tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}),
        "tools",
    )
    idle(g)
    # wider than the bounds admit: refused on its size, before the time limit is needed
    wide = {"type": "object", "properties": {str(i): {} for i in range(1001)}}
    status, _, body = chat(key, g, response_format=as_format(wide))
    assert status == 400 and body["error"]["param"] == "response_format", body
    assert "declares 1001 properties; at most 1000" in body["error"]["message"], body


def test_a_resent_guide_is_compiled_once(gw: Gw) -> None:
    g, key = gw
    idle(g)
    before = metric(g.url, COMPILES)
    schema = {
        "type": "object",
        "properties": {uuid.uuid4().hex: {"type": "integer"}},
        "required": [],
    }
    bad = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}},
    }  # lookbehind: refused
    for _ in range(3):
        status, _, body = chat(key, g, response_format=as_format(schema))
        assert status != 400, body  # accepted (no node answers it: 5xx)
        status, _, body = chat(key, g, response_format=as_format(bad))
        assert status == 400 and body["error"]["param"] == "response_format", body
    wait_for(lambda: metric(g.url, COMPILES) >= before + 2, 30, "the two compiles to be counted")
    assert metric(g.url, COMPILES) == before + 2
    # a too-complex verdict is remembered too: the same slow schema resent is refused at once,
    # without a second compile
    slow = slow_schema()
    assert_too_complex(chat(key, g, response_format=as_format(slow)), "response_format")
    idle(g)
    n = metric(g.url, COMPILES)
    assert_too_complex(chat(key, g, response_format=as_format(slow)), "response_format")
    assert metric(g.url, RUNNING) == 0 and metric(g.url, COMPILES) == n


def test_a_guides_verdict_is_not_shared_between_teams(gw: Gw) -> None:
    """A cached verdict answers at once, a compile takes milliseconds to seconds: a verdict
    cache shared by all teams would tell a team whether another sent a schema. Each team's
    check compiles its guide itself, once (response_format, and a forced tool's schema)."""
    g, key = gw
    other = make_team(g.url, f"guides-{uuid.uuid4().hex[:6]}")
    schema = {"type": "object", "properties": {uuid.uuid4().hex: {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {**schema}}}
    tool["function"]["parameters"]["title"] = uuid.uuid4().hex  # a guide of its own
    forced = {"type": "function", "function": {"name": "f"}}
    for ask in ({"response_format": as_format(schema)}, {"tools": [tool], "tool_choice": forced}):
        idle(g)
        before = metric(g.url, COMPILES)
        for team in (key, key, other, other):
            status, _, body = chat(team, g, **ask)
            assert status != 400, body  # accepted (no node answers it: 5xx)
        # one compile per team: the first team's verdict did not answer the second's check
        wait_for(lambda b=before: metric(g.url, COMPILES) >= b + 2, 30, "both teams' compiles")
        assert metric(g.url, COMPILES) == before + 2, ask
