"""The gateway's listener against slow and greedy clients: a client address holds
at most `[server] max_connections_per_address` open connections (more are closed at once); a
request whose headers are not complete within `header_timeout_s` of its start (slowloris) —
a new connection's first request or a keep-alive connection's next one — and a request body
that arrives slower than `body_min_rate_bytes_s` after `body_timeout_s` are answered 408 and
closed (runtime/read_deadlines.py); an idle keep-alive connection closes after
`keepalive_timeout_s`. Before, any number of idle or trickling sockets stayed open for
aiohttp's keep-alive timer, each a descriptor of the gateway, and a trickled body held its
connection and handler for ever. What a client that behaves does — a streamed answer longer
than every deadline, an upload that takes longer than `body_timeout_s` — still works.

Real parts: a `duet gateway` process, raw TCP sockets, real HTTP for a client that behaves, and
the local fake provider (tests/providers/fakes.py) for an answer the test holds open.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.batch.gateway_procs import jsonl, lines_for
from tests.gateway.helpers import MODEL, gateway_proc, http, make_team, tiny_model
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import Proc, running
from tests.providers.fakes import API_KEY, Fault
from tests.raw_http import RawConn, assert_timed_out
from tests.wait import wait_for

CAP = 3
HEADER_S = 3.0
BODY_S = 2.0
#: far longer than any wait here: a connection these tests see closed was closed by a deadline
KEEPALIVE_S = 600.0
#: what the tests wait for a deadline to close a connection (generous: the deadlines are 2-3 s)
CLOSE_WITHIN_S = 30.0


@dataclass
class Env:
    gw: Proc
    key: str
    fake: FakeServers


@pytest.fixture(scope="module")
def env(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("conns")
    fake = FakeServers({"gpt": "openai"})
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FAKE_PROVIDER_KEY", API_KEY)
            server = {
                "max_connections_per_address": CAP,
                "header_timeout_s": HEADER_S,
                "body_timeout_s": BODY_S,
                "keepalive_timeout_s": KEEPALIVE_S,
            }
            models = {
                MODEL: tiny_model(tiny_llama, both=["http://127.0.0.1:9"]),
                "gpt": external(fake.fakes["gpt"], {"in": 1.0, "out": 2.0}, 2),
            }
            g = gateway_proc(tmp, models, server=server, batch={"data_dir": str(tmp / "batch")})
            with running(g):
                yield Env(g, make_team(g.url, "slow"), fake)
    finally:
        fake.close()


@pytest.fixture
def gw(env: Env) -> Proc:
    return env.gw


def _connect(gw: Proc) -> RawConn:
    return RawConn(gw.port)


def test_connections_per_address_are_capped_and_slow_headers_dropped(gw: Proc) -> None:
    held = [_connect(gw) for _ in range(CAP)]
    try:
        for c in held:
            c.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished: slowloris
        extra = _connect(gw)
        try:
            wait_for(extra.closed, 10, "the connection over the cap to be closed")
        finally:
            extra.close()
        assert not any(c.closed() for c in held)  # the first CAP are open until their deadline
        wait_for(lambda: all(c.closed() for c in held), 15, "trickling connections to be closed")
    finally:
        for c in held:
            c.close()
    # Their slots are free again: a client that behaves is served.
    status, _, body = http(f"{gw.url}/health", key=None)
    assert status == 200, body


def test_refused_connections_cannot_flood_the_log(gw: Proc) -> None:
    """Each connection over the cap was one log line: a client could write lines as fast as it
    opened sockets. Now one line per 10 s, the rest counted into the next."""
    held = [_connect(gw) for _ in range(CAP)]
    try:
        before = gw.log().count("refused a connection from")
        for _ in range(40):
            extra = _connect(gw)
            try:
                wait_for(extra.closed, 10, "the connection over the cap to be closed")
            finally:
                extra.close()
        # 40 refusals, within a 10 s window or two
        assert gw.log().count("refused a connection from") - before <= 2
    finally:
        for c in held:
            c.close()


def _post_head(
    env: Env, length: int, path: str = "/v1/chat/completions", ctype: str = "application/json"
) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {env.key}\r\n"
        f"Content-Type: {ctype}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_a_trickled_body_is_cut(env: Env) -> None:
    """Slowloris on the body: whole headers, a large Content-Length, then a byte now and then —
    each one of them kept the connection (and the handler reading the body) open before."""
    c = _connect(env.gw)
    try:
        c.send(_post_head(env, 100_000) + b'{"model": "gpt", "messages": [')

        def cut() -> bool:
            c.send(b" ")  # one byte per poll: a few dozen bytes/s, far under the minimum rate
            return c.closed()

        wait_for(cut, CLOSE_WITHIN_S, "the connection trickling its body to be closed")
    finally:
        c.close()
    assert "request body arrived slower than 4096 bytes/s" in env.gw.log()


def test_a_stalled_body_is_answered_408_and_closed(env: Env) -> None:
    c = _connect(env.gw)
    try:
        c.send(_post_head(env, 1000) + b'{"model": "gpt", "messages": [')  # and nothing more
        assert_timed_out(c, "the request body arrived slower than 4096 bytes/s", CLOSE_WITHIN_S)
    finally:
        c.close()


def test_a_keep_alive_connections_next_request_has_a_header_deadline(gw: Proc) -> None:
    """The first request is served; the second one's headers stop halfway. Before, only a new
    connection's first headers had a deadline: this connection waited for the idle timer."""
    c = _connect(gw)
    try:
        c.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = c.response()
        assert status == 200, (status, body)
        assert headers.get("connection", "").lower() != "close", headers
        c.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the blank line never comes
        assert_timed_out(
            c, f"the request's headers did not arrive within {HEADER_S:g} s", CLOSE_WITHIN_S
        )
    finally:
        c.close()


def _pipelined(env: Env, framing: str) -> bytes:
    """A whole request, its end `framing` as named, and the first bytes of the next one."""
    if framing == "headers":
        first = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    else:
        body = json.dumps(
            {"model": "gpt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        ).encode()
        if framing == "content-length":
            first = _post_head(env, len(body)) + body
        else:  # chunked: the body ends with the last chunk's CRLF
            head = _post_head(env, 0).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
            first = head + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    return first + b"GET /hea"


@pytest.mark.parametrize("framing", ["headers", "content-length", "chunked"])
def test_the_next_requests_first_bytes_in_the_same_read_start_its_header_deadline(
    env: Env, framing: str
) -> None:
    """One write: a whole request (ending with its headers, a Content-Length body or a chunked
    one) and the first bytes of the next; then nothing. Before, the next request's deadline
    started only at a byte after those, so this connection waited for the idle timer
    (`keepalive_timeout_s`, 600 s here) once its answer was written."""
    c = _connect(env.gw)
    try:
        c.send(_pipelined(env, framing))
        status, headers, body = c.response()
        assert status == 200, (status, body)
        assert headers.get("connection", "").lower() != "close", headers
        assert_timed_out(
            c, f"the request's headers did not arrive within {HEADER_S:g} s", CLOSE_WITHIN_S
        )
    finally:
        c.close()


def test_a_streamed_answer_and_an_upload_longer_than_the_deadlines_still_work(env: Env) -> None:
    """The deadlines are about reading from the client: a stream the provider holds open past
    them is answered to its end; an upload slower than the body grace but above the minimum
    rate is stored."""
    gpt = env.fake.fakes["gpt"]
    env.fake.loop.call_soon_threadsafe(gpt.released.clear)
    # two events (the role, "echo:"), then silence until released
    env.fake.loop.call_soon_threadsafe(gpt.faults.append, Fault.stall_after(2))
    client = openai.OpenAI(base_url=env.gw.url + "/v1", api_key=env.key, max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="gpt",
        messages=[{"role": "user", "content": "one two three"}],
        stream=True,
        max_tokens=16,
    )
    chunks = iter(stream)
    text = [next(chunks).choices[0].delta.content or ""]  # the stream has begun
    # Both deadlines pass while it is held: a probe whose headers start now is cut by its own.
    probe = _connect(env.gw)
    try:
        probe.send(b"GET /health HTTP/1.1\r\n")
        wait_for(probe.closed, CLOSE_WITHIN_S, "the probe's header deadline")
    finally:
        probe.close()
    env.fake.loop.call_soon_threadsafe(gpt.released.set)
    text += [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(text) == "echo: one two three"

    # An upload paced over ~1.5 body graces, at several times the minimum rate: a whole-body
    # deadline would cut it; the rate rule does not.
    data = jsonl(lines_for(300))
    boundary = uuid.uuid4().hex
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    piece = max(1, len(body) // 12)
    c = _connect(env.gw)
    try:
        c.send(_post_head(env, len(body), "/v1/files", f"multipart/form-data; boundary={boundary}"))
        for i in range(0, len(body), piece):
            c.send(body[i : i + piece])
            time.sleep(BODY_S / 8)  # pacing the upload, not waiting for anything
        status, _, answer = c.response()
    finally:
        c.close()
    assert status == 200, answer
    assert json.loads(answer)["bytes"] == len(data)


def test_an_idle_keep_alive_connection_is_closed(tiny_llama: Path, tmp_path: Path) -> None:
    """`keepalive_timeout_s`: a connection that sends nothing after its answer is closed,
    silently: it owes no request, so no 408."""
    gw = gateway_proc(
        tmp_path,
        {MODEL: tiny_model(tiny_llama, both=["http://127.0.0.1:9"])},
        server={"keepalive_timeout_s": 2.0, "header_timeout_s": HEADER_S},
    )
    with running(gw):
        c = _connect(gw)
        try:
            c.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert c.response()[0] == 200
            wait_for(c.closed, CLOSE_WITHIN_S, "the idle keep-alive connection to be closed")
            assert c.got == b"", bytes(c.got)
        finally:
            c.close()
