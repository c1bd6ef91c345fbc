"""A node's and a coordinator's listener have the gateway's read deadlines
(runtime/read_deadlines.py): a request whose headers are not complete within
`--header-timeout-s`, or whose body stalls past `--body-timeout-s`, is answered 408 and its
connection closed. Before, a node or coordinator held a trickled request's headers until
aiohttp's idle timer (75 s), and a body that stopped halfway for ever, with its handler.

Real parts: etcd, a coordinator and a colocated node (tiny model) as processes with the cluster
secret — the body deadline guards handlers that run only after authentication — and raw TCP
sockets.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import TINY_NODE_ARGS, Proc, duet_node, running, secured_plane
from tests.raw_http import RawConn, assert_timed_out

SECRET = secrets.token_urlsafe(32)
DEADLINES = ("--header-timeout-s", "2", "--body-timeout-s", "2")
#: what the tests wait for a 2 s deadline (generous; aiohttp's idle timer alone is 75 s)
WITHIN_S = 30.0


@pytest.fixture(scope="module")
def servers(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Proc]]:
    with secured_plane(tmp_path_factory.mktemp("internal-deadlines"), SECRET, *DEADLINES) as plane:
        # a node of no etcd: only its listener is under test
        node = duet_node(
            "both", str(tiny_llama), plane.tmp, *TINY_NODE_ARGS, *plane.flag, *DEADLINES
        )
        with running(plane.coordinator, node):
            yield {"coordinator": plane.coordinator, "node": node}


#: per server: an authenticated POST whose handler reads the body
POSTS = {"node": "/v1/completions", "coordinator": "/route"}


@pytest.mark.parametrize("which", ["node", "coordinator"])
def test_trickled_headers_are_answered_408(servers: dict[str, Proc], which: str) -> None:
    c = RawConn(servers[which].port)
    try:
        c.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the blank line never comes
        assert_timed_out(c, "the request's headers did not arrive within 2 s", WITHIN_S)
    finally:
        c.close()


@pytest.mark.parametrize("which", ["node", "coordinator"])
def test_a_stalled_body_is_answered_408(servers: dict[str, Proc], which: str) -> None:
    c = RawConn(servers[which].port)
    try:
        c.send(
            f"POST {POSTS[which]} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n"
            'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model": '.encode()
        )
        assert_timed_out(c, "the request body arrived slower than 4096 bytes/s", WITHIN_S)
    finally:
        c.close()


def test_unusable_deadlines_are_refused_at_start(tmp_path: Path) -> None:
    """A negative or non-finite deadline is the operator's error, named, before anything runs:
    the gateway's `[server]` settings at config load, a coordinator's flags at exit 2."""
    from gateway.config import ConfigError, parse_config

    models = {"m": {"kind": "external", "provider": "openai", "max_model_len": 1024}}
    for key, value in (
        ("body_timeout_s", -1.0),
        ("header_timeout_s", float("nan")),
        ("body_min_rate_bytes_s", 0),
    ):
        with pytest.raises(ConfigError, match=f"\\[server\\] {key} must be"):
            parse_config({"models": models, "server": {key: value}})
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "duet",
            "coordinator",
            "--etcd",
            "http://127.0.0.1:9",
            "--body-timeout-s",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "--body-timeout-s must be a finite number of seconds >= 0" in run.stderr, run.stderr
