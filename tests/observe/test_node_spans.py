"""The console's trace view shows the P and D legs' spans, read from the nodes' own rings.

Against conftest.py's traced cluster (etcd, coordinator, P, D and the gateway, tracing on, the
internal plane behind a cluster secret): the trace page of one request holds P's
queue/compute/hold and D's reserve/kv_pull/first_token/generate, each under its node's server
span, itself under the gateway's leg span — as the page draws the tree (rows in tree order,
each indented by its depth). A node's `GET /spans` refuses a caller without the secret and a
malformed trace id, and answers only the spans of the trace asked.

A cluster of its own (its nodes are stopped and killed): a decode node that does not answer
(SIGSTOPped) and a prefill node that is gone (SIGKILLed) leave the page rendering, with a note
naming each node whose spans are unavailable.
"""

from __future__ import annotations

import contextlib
import html
import http.cookiejar
import json
import os
import re
import secrets
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.etcd_server import EtcdServer
from tests.gateway.helpers import ADMIN_KEY, make_team, write_config
from tests.observe.conftest import Traced
from tests.pd_cluster import LOCAL_PREFILL_TOKENS, MODEL, PDCluster, cluster_model
from tests.procs import TINY_NODE_ARGS, Proc, duet_node, free_port, running
from tests.wait import wait_for

PROMPT = "Show me every node's spans of this request in the console, please. " * 3


class Console:
    """A browser of the console at the HTTP level: a cookie jar signed in with a key."""

    def __init__(self, base: str, key: str) -> None:
        self.base = base
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )
        form = self.get("/console/login")[1]
        token = re.search(r'name="csrf" value="([^"]+)"', form)
        assert token, form
        data = urllib.parse.urlencode({"csrf": token.group(1), "key": key}).encode()
        with self.opener.open(
            urllib.request.Request(base + "/console/login", data=data), timeout=30
        ) as r:
            assert "/console/login" not in r.url, r.url  # signed in: redirected to a page

    def get(self, path: str) -> tuple[int, str]:
        try:
            with self.opener.open(self.base + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


@dataclass(frozen=True)
class Row:
    name: str
    process: str
    depth: int
    attributes: str


_ROW = re.compile(
    r'<tr><td><span class="depth" data-depth="(\d+)">(.*?)</span></td><td>(.*?)</td><td>.*?</td>'
    r"<td>(.*?)</td></tr>"
)


def rows(page: str) -> list[Row]:
    """The Spans table's rows, in the page's (tree) order."""
    return [
        Row(html.unescape(m[2]), html.unescape(m[3]), int(m[1]), html.unescape(m[4]))
        for m in _ROW.finditer(page)
    ]


def parent(table: list[Row], row: Row) -> Row | None:
    """The row's parent as the page draws it: the nearest row above it one level up."""
    i = table.index(row)
    return next((r for r in reversed(table[:i]) if r.depth == row.depth - 1), None)


def one(table: list[Row], name: str, process: str) -> Row:
    got = [r for r in table if r.name == name and r.process.startswith(process)]
    assert len(got) == 1, (name, process, [(r.name, r.process, r.depth) for r in table])
    return got[0]


def request(c: PDCluster) -> str:
    """One disaggregated request: a prompt D has not seen (a cached one is prefilled on D)."""
    prompt = f"{secrets.token_hex(8)} {PROMPT}"
    raw = c.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=5, temperature=0
    )
    return raw.headers["x-request-id"]


def trace_page(console: Console, rid: str, *names: str) -> str:
    """The request's trace page once it shows every one of `names` (the gateway's request span
    ends as the answer's last byte goes out: the page 404s until then)."""

    def ready() -> str | None:
        status, body = console.get(f"/console/requests/{rid}")
        shown = {r.name for r in rows(body)}
        return body if status == 200 and set(names) <= shown else None

    return wait_for(ready, 15, f"the trace page of {rid} with {names}")


NODE_SPANS = (
    "prefill.queue",
    "prefill.compute",
    "prefill.hold",
    "decode.reserve",
    "decode.kv_pull",
    "decode.first_token",
    "decode.generate",
)


def test_the_trace_page_shows_the_prefill_and_decode_nodes_spans(traced: Traced) -> None:
    rid = request(traced)
    console = Console(traced.gateway.url, ADMIN_KEY)
    page = trace_page(console, rid, *NODE_SPANS)
    assert "unavailable" not in page
    table = rows(page)
    root = one(table, "POST /v1/chat/completions", "duet-gateway")
    assert root.depth == 0
    # P: its server span under the gateway's prefill leg; queue, compute and hold under it
    p_leg = one(table, "gateway.prefill_leg", "duet-gateway")
    p_server = one(table, "POST /v1/completions", "prefill-0 (duet-prefill)")
    assert parent(table, p_server) == p_leg
    for name in ("prefill.queue", "prefill.compute", "prefill.hold"):
        assert parent(table, one(table, name, "prefill-0 (duet-prefill)")) == p_server, name
    assert "duet.outcome" in one(table, "prefill.hold", "prefill-0").attributes
    # D: its server span under the gateway's decode leg; reserve, pull, first token, generate
    d_leg = one(table, "gateway.decode_leg", "duet-gateway")
    d_server = one(table, "POST /v1/completions", "decode-0 (duet-decode)")
    assert parent(table, d_server) == d_leg
    for name in ("decode.reserve", "decode.kv_pull", "decode.first_token", "decode.generate"):
        assert parent(table, one(table, name, "decode-0 (duet-decode)")) == d_server, name
    pull = one(table, "decode.kv_pull", "decode-0")
    assert "duet.kv.bytes" in pull.attributes
    # D's release to P carries the pull's traceparent: P's span of it sits under D's pull
    assert parent(table, one(table, "POST /kv/release", "prefill-0 (duet-prefill)")) == pull
    # the timeline names each node span's node (P's and D's server spans share a name)
    svg = re.search(r"<svg.*?</svg>", page, re.S)
    assert svg and "prefill.compute · prefill-0" in html.unescape(svg.group(0))
    assert "decode.generate · decode-0" in html.unescape(svg.group(0))


def _spans(url: str, query: str, secret: str | None) -> tuple[int, dict]:  # type: ignore[type-arg]
    headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(f"{url}/spans{query}", headers=headers), timeout=10
        ) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_a_nodes_spans_endpoint_needs_the_secret_and_a_trace_id(traced: Traced) -> None:
    rid = request(traced)
    console = Console(traced.gateway.url, ADMIN_KEY)
    page = trace_page(console, rid, "prefill.compute")
    trace_id = re.search(r"Trace <code>([0-9a-f]{32})</code>", page)
    assert trace_id, page
    tid = trace_id.group(1)
    p = traced.prefill.url
    # the cluster secret, as every internal endpoint: nothing without it, nor with a wrong one
    assert _spans(p, f"?trace_id={tid}", None)[0] == 401
    assert _spans(p, f"?trace_id={tid}", secrets.token_urlsafe(32))[0] == 401
    # a trace id is 32 lower-case hex digits, not all zero
    for bad in (
        "",
        "?trace_id=",
        "?trace_id=xyz",
        f"?trace_id={tid[:-1]}",
        f"?trace_id={tid.upper()}",
        f"?trace_id={'0' * 32}",
        f"?trace_id={tid}00",
        "?trace_id=" + "g" * 32,
    ):
        status, body = _spans(p, bad, traced.secret)
        assert status == 400 and body["error"]["param"] == "trace_id", (bad, status, body)
    # only that trace's spans; a trace it does not hold is an empty answer
    status, body = _spans(p, f"?trace_id={tid}", traced.secret)
    assert status == 200 and body["node_id"] == "prefill-0" and body["kept"] is True
    assert {s["trace_id"] for s in body["spans"]} == {tid}
    assert {"prefill.queue", "prefill.compute", "prefill.hold"} <= {
        s["name"] for s in body["spans"]
    }
    other = secrets.token_hex(16)
    assert _spans(p, f"?trace_id={other}", traced.secret) == (
        200,
        {"node_id": "prefill-0", "kept": True, "spans": [], "truncated": False},
    )
    # reading the ring adds nothing to it (the endpoint is not traced)
    assert _spans(p, f"?trace_id={tid}", traced.secret)[1]["spans"] == body["spans"]


def test_a_team_key_does_not_see_another_teams_trace(traced: Traced) -> None:
    rid = request(traced)  # the `observe` team's request
    admin = Console(traced.gateway.url, ADMIN_KEY)
    trace_page(admin, rid, "prefill.compute")
    other = Console(traced.gateway.url, make_team(traced.gateway.url, "spans-other"))
    status, body = other.get(f"/console/requests/{rid}")
    assert status == 404 and "prefill.compute" not in body
    own = Console(traced.gateway.url, traced.key)
    assert own.get(f"/console/requests/{rid}")[0] == 200


# --- a node gone or silent ----------------------------------------------------------------------
@pytest.fixture
def lone(tiny_llama: Path, tmp_path: Path) -> Iterator[PDCluster]:
    """A traced P/D cluster of this test's own (it stops and kills its nodes): spans in the
    rings only, no exporter."""
    secret = secrets.token_urlsafe(32)
    env = {"DUET_TRACING": "1", "DUET_CLUSTER_SECRET": secret}
    with EtcdServer(tmp_path / "etcd") as etcd:
        port = free_port()
        coord = Proc(
            [
                sys.executable,
                "-m",
                "duet",
                "coordinator",
                "--etcd",
                etcd.url,
                "--port",
                str(port),
                "--local-prefill-tokens",
                str(LOCAL_PREFILL_TOKENS),
            ],
            port,
            tmp_path / "coordinator.log",
            env=env,
        )
        p = duet_node(
            "prefill",
            str(tiny_llama),
            tmp_path,
            *TINY_NODE_ARGS,
            "--etcd",
            etcd.url,
            "--node-id",
            "prefill-0",
            env=env,
        )
        d = duet_node(
            "decode",
            str(tiny_llama),
            tmp_path,
            *TINY_NODE_ARGS,
            "--etcd",
            etcd.url,
            "--node-id",
            "decode-0",
            env=env,
        )
        gport = free_port()
        cfg = write_config(
            tmp_path / "gateway.toml",
            {MODEL: cluster_model(tiny_llama)},
            server={"port": gport},
            store={"url": f"sqlite://{tmp_path / 'gateway.db'}"},
            routing={"coordinator": [coord.url], "etcd": etcd.url},
        )
        g = Proc(
            [sys.executable, "-m", "duet", "gateway", "--config", str(cfg)],
            gport,
            tmp_path / "gateway.log",
            env={"DUET_ADMIN_KEY": ADMIN_KEY, **env},
        )
        with running(coord, p, d, g):
            c = PDCluster(
                etcd=etcd,
                coordinator=coord,
                prefill=p,
                decode=d,
                gateway=g,
                key=make_team(g.url, "lone"),
                model_dir=tiny_llama,
                tmp=tmp_path,
                secret=secret,
            )
            wait_for(lambda: {"prefill-0", "decode-0"} <= c.ready_nodes(), 60, "both nodes ready")
            try:
                yield c
            finally:  # a stopped node resumes, so `running` stops it as any other
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(d.proc.pid, signal.SIGCONT)


def test_a_silent_or_dead_node_leaves_the_trace_page_rendering(lone: PDCluster) -> None:
    rid = request(lone)
    console = Console(lone.gateway.url, ADMIN_KEY)
    trace_page(console, rid, *NODE_SPANS)
    # D stopped: the console's request to it is accepted by the kernel and never answered
    os.killpg(lone.decode.proc.pid, signal.SIGSTOP)
    status, page = console.get(f"/console/requests/{rid}")
    assert status == 200, page
    assert re.search(
        r"The spans of node decode-0 \(http://127\.0\.0\.1:\d+\) are unavailable: no answer within",
        html.unescape(page),
    ), page
    names = {(r.name, r.process.split(" ")[0]) for r in rows(page)}
    assert ("gateway.decode_leg", "duet-gateway") in names and (
        "prefill.compute",
        "prefill-0",
    ) in names
    assert not any(n.startswith("decode.") for n, _ in names), names
    os.killpg(lone.decode.proc.pid, signal.SIGCONT)
    # P gone: its address refuses; the page still shows the gateway's and D's spans
    lone.prefill.kill()
    status, page = console.get(f"/console/requests/{rid}")
    assert status == 200, page
    text = html.unescape(page)
    assert "The spans of node prefill-0" in text and "are unavailable" in text, page
    assert "The spans of node decode-0" not in text
    table = rows(page)
    assert not any(r.process.startswith("prefill-0") for r in table)
    d_server = one(table, "POST /v1/completions", "decode-0")
    assert parent(table, d_server) == one(table, "gateway.decode_leg", "duet-gateway")
    assert "Timeline of" in page
