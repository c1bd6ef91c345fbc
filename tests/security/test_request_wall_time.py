"""A request cannot hold a tier slot or its team's concurrency past the gateway's cap on its
time (`[server] request_timeout_s`).

The attack: write deadlines cut a client that stops reading, and reading ahead frees the slot
of one whose node is done; but a client that reads a byte now and then of an answer the nodes
make slowly (a long `max_tokens`, a busy node) held its tier admission slot and a unit of its
team's `max_concurrent` for as long as the answer took, with nothing bounding it. Now past the
cap the stream ends with a `request_timeout` error event (a whole answer: a 504), the node's
stream is closed, the slot and the team's count are free, and one usage record bills what the
gateway read for it.

On `/v1/messages` the cap's error is Anthropic's `timeout_error` (its type for a 504), whole
(the status) and streamed (the error event, which has no status to say it), so the official
`anthropic` client raises its `GatewayTimeoutError` and sees the type; it was `api_error`.

Real parts: an echo node process that streams a token every 50 ms (bench/echo_node.py: an
answer of 1,000 tokens takes 50 s), a `duet gateway` process with one admission slot and a 2 s
cap in front, a team with `max_concurrent = 1`, plain HTTP and the official `anthropic` client.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.gateway.helpers import MODEL, gateway_proc, http, make_team, tiny_model
from tests.procs import Proc, free_port, running
from tests.wait import wait_for

CAP_S = 2.0
#: 1,000 tokens 50 ms apart: 50 s without the cap
MAX_TOKENS, TOKEN_DELAY_S = 1000, 0.05


def _echo(tmp: Path) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "bench.echo_node", "--port", str(port)]
    return Proc([*cmd, "--token-delay", str(TOKEN_DELAY_S)], port, tmp / f"echo-{port}.log")


def _streams_open(node: Proc) -> int:
    text = urllib.request.urlopen(node.url + "/metrics", timeout=5).read().decode()
    lines = text.splitlines()
    return int(next(ln.split()[1] for ln in lines if ln.startswith("echo_streams_open ")))


def _events(raw: bytes) -> list[Any]:
    """The SSE body's data payloads, decoded (`[DONE]` as the string)."""
    out: list[Any] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _post_stream(g: Proc, key: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(
        g.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    # a client bound far above the cap, far below the uncapped answer's 50 s
    with urllib.request.urlopen(req, timeout=25) as r:
        return r.status, r.read()


def test_a_request_past_the_cap_ends_frees_its_slot_and_is_billed_once(
    tmp_path: Path, tiny_llama: Path
) -> None:
    node = _echo(tmp_path)
    g = gateway_proc(
        tmp_path,
        {MODEL: tiny_model(tiny_llama, both=[node.url])},
        server={"request_timeout_s": CAP_S},
        # one slot, and a short wait for it: a slot still held is a 503 for the next request
        tiers={"max_inflight": 1, "interactive_max_wait_s": 1},
    )
    with running(node, g):
        key = make_team(g.url, "trickle", max_concurrent=1)
        body = {"model": MODEL, "prompt": "slowly", "max_tokens": MAX_TOKENS, "ignore_eos": True}

        # a stream: its tokens flow, then the cap ends it with an error event and [DONE]
        t0 = time.monotonic()
        status, raw = _post_stream(g, key, {**body, "stream": True})
        took = time.monotonic() - t0
        assert status == 200 and CAP_S <= took < CAP_S + 10, (status, took)
        events = _events(raw)
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2]["error"]["code"] == "request_timeout", events[-2]
        received = sum(1 for e in events[:-2] for c in e["choices"] if c["text"])
        assert 0 < received < MAX_TOKENS, received
        # the node's stream was closed with it (the echo node counts its open streams)
        wait_for(lambda: _streams_open(node) == 0, 10, "the node's stream to close")

        # the slot and the team's one unit of concurrency are free: the next request is admitted
        # (before: 503 after its 1 s wait for the slot); a whole answer past the cap is a 504
        status, _, err = http(g.url + "/v1/completions", "POST", body, key=key)
        assert status == 504 and err["error"]["code"] == "request_timeout", (status, err)
        status, _, ok = http(g.url + "/v1/completions", "POST", {**body, "max_tokens": 3}, key=key)
        assert status == 200 and ok["usage"]["completion_tokens"] == 3, (status, ok)

        # one record each: the timed-out ones bill what the gateway had read for them
        def records() -> list[dict[str, Any]] | None:
            status, _, page = http(f"{g.url}/v1/usage?group_by=record", key=key)
            assert status == 200, page
            return page["data"] if len(page["data"]) >= 3 else None

        recs = sorted(wait_for(records, 30, "three usage records"), key=lambda r: r["created_at"])
        assert [r["status"] for r in recs] == ["request_timeout", "request_timeout", "ok"], recs
        streamed, whole, _ = recs
        assert received <= streamed["completion_tokens"] < MAX_TOKENS, (received, streamed)
        assert 0 < whole["completion_tokens"] < MAX_TOKENS and whole["cost_usd"] > 0, whole


def test_the_messages_api_says_timeout_error_past_the_cap(tmp_path: Path, tiny_llama: Path) -> None:
    node = _echo(tmp_path)
    g = gateway_proc(
        tmp_path,
        {MODEL: tiny_model(tiny_llama, both=[node.url])},
        server={"request_timeout_s": CAP_S},
    )
    with running(node, g):
        key = make_team(g.url, "slow")
        # no retries (the client retries a 504), a bound far above the cap
        client = anthropic.Anthropic(base_url=g.url, api_key=key, max_retries=0, timeout=25)
        ask: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": "slowly"}],
        }

        # a whole answer: a 504 of type timeout_error, as Anthropic's own API answers
        with pytest.raises(anthropic.GatewayTimeoutError) as whole:
            client.messages.create(**ask)
        assert whole.value.status_code == 504, whole.value
        assert whole.value.body["error"]["type"] == "timeout_error", whole.value.body

        # a stream: its text flows, then the error event says timeout_error
        seen: list[str] = []
        with (
            pytest.raises(anthropic.APIStatusError) as streamed,
            client.messages.stream(**ask) as s,
        ):
            seen.extend(ev.type for ev in s)
        assert seen[0] == "message_start" and "text" in seen, seen
        assert "message_stop" not in seen, seen
        assert streamed.value.body["error"]["type"] == "timeout_error", streamed.value.body


def test_a_batch_line_runs_past_the_cap(tmp_path: Path, tiny_llama: Path) -> None:
    """The batch runner's lines are not cut at the cap: the runner reads them as they come, and a
    line that needs longer than the cap would only be retried to the same end (before: a 504,
    retried, each run cut again)."""
    node = _echo(tmp_path)
    g = gateway_proc(
        tmp_path,
        {MODEL: tiny_model(tiny_llama, both=[node.url])},
        server={"request_timeout_s": CAP_S},
    )
    with running(node, g):
        key = make_team(g.url, "bulk")
        n = int(2 * CAP_S / TOKEN_DELAY_S)  # twice the cap at the node
        line = {"model": MODEL, "prompt": "slowly", "max_tokens": n, "ignore_eos": True}
        status, _, created = http(g.url + "/v1/batch", "POST", {"requests": [line]}, key=key)
        assert status == 202, created

        def ended() -> dict[str, Any] | None:
            status, _, st = http(f"{g.url}/v1/batch/{created['batch_id']}", key=key)
            assert status == 200, st
            return st if st["status"] in ("completed", "failed", "expired", "cancelled") else None

        st = wait_for(ended, 120, "the batch to end")
        assert st["status"] == "completed", st
        answer = st["results"][0]["response"]
        assert answer["status_code"] == 200, answer
        assert answer["body"]["usage"]["completion_tokens"] == n, answer
