"""A client that leaves an external model's answer pays what the provider bills the operator.

The attack: stream from an external model and close the socket before the provider's usage
chunk, or send a whole-answer request and disconnect just before the answer: the gateway
closed the provider's stream (or dropped its call) and billed a chunk count and a
characters/4 prompt estimate (the whole answer: the prompt estimate alone), while the
provider billed the operator the full completion. Now the gateway reads the provider's answer
on after the client left (bounded in time and chunks) and bills its reported usage; a provider
that does not report in time is billed the reservation's worst case.

Real parts: a `duet gateway` process, a fake OpenAI-compatible provider (a real HTTP server
speaking the protocol: it counts its prompt in words and bills one token a word), raw sockets
as the clients that leave.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.helpers import gateway_proc, http, make_team
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import Proc, running
from tests.providers.fakes import API_KEY, Fault
from tests.wait import wait_for

WORDS = 40
PROMPT = "tell me a long story about the sea"  # 8 words: the fake bills 8 prompt tokens


def _send(gw: Proc, key: str, stream: bool) -> socket.socket:
    body = json.dumps(
        {
            "model": "gpt",
            "stream": stream,
            "max_tokens": 100,
            "messages": [{"role": "user", "content": PROMPT}],
        }
    ).encode()
    s = socket.create_connection(("127.0.0.1", gw.port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    s.sendall(head.encode() + body)
    return s


def _records(gw: Proc, key: str) -> list[dict[str, Any]]:
    status, _, body = http(f"{gw.url}/v1/usage?group_by=record", key=key)
    assert status == 200, body
    return body["data"]


def test_a_client_that_leaves_pays_the_providers_usage(
    fake: FakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    gpt = fake.fakes["gpt"]
    gpt.reply = lambda body: " ".join(f"w{i}" for i in range(WORDS))
    gw = gateway_proc(tmp_path, {"gpt": external(gpt, {"in": 1.0, "out": 2.0}, 2)})

    def fault(f: Fault) -> None:
        fake.loop.call_soon_threadsafe(gpt.released.clear)
        fake.loop.call_soon_threadsafe(gpt.faults.append, f)

    with running(gw):
        # a stream: the client reads its first text and leaves while the provider stalls
        streamer = make_team(gw.url, "streamer")
        fault(Fault.stall_after(3))  # the role chunk and two words, then a stall
        s = _send(gw, streamer, stream=True)
        got = b""
        while b'"w1"' not in got and b" w1" not in got:
            got += s.recv(65536)
        s.close()
        fake.loop.call_soon_threadsafe(gpt.released.set)
        recs = wait_for(lambda: _records(gw, streamer), 30, "the stream's usage record")
        assert [r["status"] for r in recs] == ["client_disconnected"], recs
        # the provider's own figures (before: ~2 completion tokens, a chars/4 prompt)
        assert (recs[0]["prompt_tokens"], recs[0]["completion_tokens"]) == (8, WORDS), recs

        # a whole answer: the client leaves while the provider is still answering
        whole = make_team(gw.url, "whole")
        seen = len(gpt.requests)
        fault(Fault.hold())
        s = _send(gw, whole, stream=False)
        wait_for(lambda: len(gpt.requests) > seen, 30, "the provider to take the call")
        s.close()
        wait_for(
            lambda: "the client left: awaiting the provider" in gw.log_path.read_text(),
            30,
            "the gateway to see its client leave",
        )
        fake.loop.call_soon_threadsafe(gpt.released.set)
        recs = wait_for(lambda: _records(gw, whole), 30, "the whole answer's usage record")
        assert [r["status"] for r in recs] == ["client_disconnected"], recs
        # before: the prompt estimate alone, no completion
        assert (recs[0]["prompt_tokens"], recs[0]["completion_tokens"]) == (8, WORDS), recs

        # a provider that never reports after its client left: the reservation's worst case
        # (ABANDONED_READ_S, 10 s, later), its prompt's byte bound and all of max_tokens
        stuck = make_team(gw.url, "stuck")
        fault(Fault.stall_after(3))
        s = _send(gw, stuck, stream=True)
        got = b""
        while b'"w1"' not in got and b" w1" not in got:
            got += s.recv(65536)
        s.close()
        recs = wait_for(lambda: _records(gw, stuck), 60, "the stuck stream's usage record")
        assert recs[0]["completion_tokens"] == 100, recs
        assert recs[0]["prompt_tokens"] >= len(PROMPT), recs
        fake.loop.call_soon_threadsafe(gpt.released.set)
