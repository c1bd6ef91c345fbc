"""Where the cluster secret comes from, and what a process does without one.

A secret others can read is no secret, a short one can be guessed, and a process that quietly
starts open on a network address because its secret was missing is the hole this closes:
- a secret file readable or writable by group/others, a secret under 32 bytes, an unreadable
  file are refused — never a start without the secret;
- without any secret, a process on loopback starts with a warning; on another address it
  refuses unless `--insecure` (real `duet node` / `duet coordinator` processes: exit 2 before
  anything loads);
- `duet up` generates the secret 0600 under $DUET_HOME, keeps it, and replaces one that is
  not valid.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from duet.up_home import UpHome, cluster_secret
from runtime.cluster_secret import (
    ENV_SECRET,
    ENV_SECRET_FILE,
    ClusterSecret,
    SecretError,
    auth_middleware,
    load_secret,
    write_secret_file,
)
from runtime.log_throttle import ThrottledWarning
from runtime.plane import PlaneSecurity

GOOD = secrets.token_urlsafe(32)


def _file(tmp: Path, value: str, mode: int = 0o600) -> Path:
    p = tmp / "secret"
    write_secret_file(p, value)
    p.chmod(mode)
    return p


def test_a_file_secret_is_read_and_wins_over_the_environment(tmp_path: Path) -> None:
    p = _file(tmp_path, GOOD)
    other = secrets.token_urlsafe(32)
    s = load_secret(str(p), env={ENV_SECRET: other})
    assert s is not None and s.verify(f"Bearer {GOOD}") and not s.verify(f"Bearer {other}")
    s = load_secret(None, env={ENV_SECRET_FILE: str(p), ENV_SECRET: other})
    assert s is not None and s.verify(f"Bearer {GOOD}")
    s = load_secret(None, env={ENV_SECRET: other})
    assert s is not None and s.verify(f"Bearer {other}")
    assert load_secret(None, env={}) is None
    assert GOOD not in repr(s)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o620])
def test_a_file_others_can_reach_is_refused(tmp_path: Path, mode: int) -> None:
    p = _file(tmp_path, GOOD, mode)
    with pytest.raises(SecretError, match="chmod 600"):
        load_secret(str(p), env={})


@pytest.mark.parametrize("value", ["x" * 31, "short", "a b" * 20, "é" * 40])
def test_weak_or_unsendable_secrets_are_refused(tmp_path: Path, value: str) -> None:
    with pytest.raises(SecretError):
        load_secret(str(_file(tmp_path, value)), env={})
    with pytest.raises(SecretError):
        load_secret(None, env={ENV_SECRET: value})


def test_a_configured_but_missing_file_is_an_error_not_an_open_start(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(str(tmp_path / "nope"), env={ENV_SECRET: GOOD})


def test_verification_needs_the_exact_bearer_value() -> None:
    s = ClusterSecret(GOOD, "test")
    assert s.verify(f"Bearer {GOOD}")
    for wrong in (
        None,
        "",
        GOOD,
        f"Bearer {GOOD}x",
        f"Bearer {GOOD[:-1]}",
        f"bearer{GOOD}",
        "Bearer é",
    ):
        assert not s.verify(wrong)


def test_without_a_secret_loopback_warns_and_other_addresses_need_insecure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "duet.security"):
        PlaneSecurity().check_start(["127.0.0.1"], "a node")
    assert "WITHOUT a cluster secret" in caplog.text
    for host in ("0.0.0.0", "10.1.2.3", "::"):
        with pytest.raises(SecretError, match="--insecure"):
            PlaneSecurity().check_start([host], "a node")
    PlaneSecurity(insecure=True).check_start(
        ["0.0.0.0"], "a node"
    )  # the operator's explicit choice
    PlaneSecurity(secret=ClusterSecret(GOOD, "t")).check_start(["0.0.0.0"], "a node")
    with pytest.raises(SecretError, match="--protect-metrics"):
        PlaneSecurity(protect_metrics=True).check_start(["127.0.0.1"], "a node")


@pytest.mark.parametrize(
    "command", [["node", "--role", "decode"], ["coordinator", "--etcd", "http://127.0.0.1:9"]]
)
def test_a_process_on_a_network_address_without_a_secret_refuses_to_start(
    command: list[str], tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SECRET, ENV_SECRET_FILE)}
    r = subprocess.run(
        [sys.executable, "-m", "duet", *command, "--host", "0.0.0.0", "--port", "9"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "without a cluster secret" in r.stderr and "--insecure" in r.stderr


def test_help_says_how_to_run_without_a_secret() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "duet", "node", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    out = " ".join(out.split())  # argparse wraps lines
    assert "--insecure" in out and "--cluster-secret-file" in out and "refuses to start" in out


def test_duet_up_generates_a_private_secret_and_keeps_it(tmp_path: Path) -> None:
    home = UpHome(tmp_path)
    home.prepare()
    path = cluster_secret(home)
    assert path.stat().st_mode & 0o777 == 0o600
    first = path.read_text()
    assert load_secret(str(path), env={}) is not None
    assert cluster_secret(home).read_text() == first  # kept across restarts
    path.chmod(0o644)  # someone loosened it: a new one, private again
    assert cluster_secret(home).read_text() != first
    assert path.stat().st_mode & 0o777 == 0o600


async def test_refusals_cannot_flood_the_log(
    aiohttp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A stranger who reaches an internal port can send refused requests at will; each used to
    log its own warning (a disk filled, the lines that matter buried). Now one line per 10 s at
    most, the next saying how many were held back. Real HTTP to the middleware every internal
    app runs (runtime/cluster_secret.py::auth_middleware)."""

    async def metadata(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application(middlewares=[auth_middleware(ClusterSecret(GOOD, "test"))])
    app.router.add_get("/kv/metadata", metadata)
    server = await aiohttp_server(app, host="127.0.0.1")
    url = str(server.make_url("/kv/metadata"))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="duet.security"):
        async with aiohttp.ClientSession() as s:
            for i in range(200):
                async with s.get(url, headers={"Authorization": f"Bearer wrong-{i}"}) as r:
                    assert r.status == 401
            async with s.get(url, headers={"Authorization": f"Bearer {GOOD}"}) as r:
                assert r.status == 200
    elapsed = time.monotonic() - t0
    lines = [r.getMessage() for r in caplog.records if "no valid cluster secret" in r.getMessage()]
    assert 1 <= len(lines) <= 1 + math.ceil(elapsed / 10), (
        len(lines),
        elapsed,
    )  # the old code: 200
    assert "'/kv/metadata'" in lines[0]  # the path quoted (a client's words cannot forge a line)


def test_a_throttled_warning_counts_what_it_held_back(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    w = ThrottledWarning(
        logging.getLogger("duet.test.throttle"), every_s=10.0, clock=lambda: now[0]
    )
    with caplog.at_level(logging.WARNING, logger="duet.test.throttle"):
        assert w.warning("refused %s", "a")
        for t in (1.0, 2.0, 9.9):
            now[0] = t
            assert not w.warning("refused %s", "b")
        now[0] = 12.0
        assert w.warning("refused %s", "c")
        now[0] = 30.0
        assert w.warning("refused %s", "d")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a",
        "refused c (and 3 more like it in the 12 s before, not logged one by one)",
        "refused d",
    ]


def test_duet_ups_control_endpoint_needs_the_secret() -> None:
    """`duet up --autoscale`'s control endpoint starts and stops nodes: without the cluster
    secret it answers 401 and does nothing (it had no auth: any local user could stop nodes).
    Here duet up is still starting, so an authorized request gets that 503, not the 401."""
    import json
    import types
    import urllib.error
    import urllib.request

    from duet.up_autoscale import serve_control

    secret = ClusterSecret(secrets.token_urlsafe(32), "test")
    server = serve_control(types.SimpleNamespace(sup=None), secret)  # type: ignore[arg-type]
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        # the stop, and the readiness the planner asks before deciding (GET /ready)
        for method, path, data in (
            ("POST", "/nodes/decode-0/stop", b"{}"),
            ("GET", "/ready", None),
        ):
            for headers, status, code in (
                ({}, 401, "cluster_secret_required"),
                ({"Authorization": "Bearer " + "x" * 43}, 401, "cluster_secret_required"),
                (secret.headers, 503, "starting"),
            ):
                req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
                with pytest.raises(urllib.error.HTTPError) as e:
                    urllib.request.urlopen(req, timeout=10)
                assert e.value.code == status and json.loads(e.value.read())["code"] == code, (
                    method,
                    path,
                )
    finally:
        server.shutdown()
        server.server_close()
