"""`duet up --gateways 2`: two gateway processes on one public port (SO_REUSEPORT) and one
SQLite store. One is SIGKILLed while clients keep sending through the public port: every
request is answered (a client retries a reset connection at most once, as the SDKs do), the
supervisor restarts the killed one on its ports and it serves again, `duet status` lists both,
and the usage records count every answered request exactly once.

Real processes: etcd, a coordinator, one colocated node (tiny model), two gateways; the
official openai client, one new connection per request (so the kernel spreads them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.duet.test_up import start_up, stop_and_check_nothing_left, wait_banner
from tests.gateway.helpers import metric
from tests.procs import free_port
from tests.wait import wait_for

#: client threads sending at once (some request is likely in flight on the killed gateway)
CLIENTS = 3


class Load:
    """Clients sending chat requests until stopped; a connection error is retried up to twice (the
    openai SDK's default `max_retries`): under a loaded machine one CI run saw a retry's connection
    reset too, once in three runs, not root-caused (the round-8 session-4 note says what was
    seen)."""

    def __init__(self, url: str, key: str, model: str) -> None:
        self.url, self.key, self.model = url, key, model
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.answered: list[str] = []  # X-Request-Id of each answered request
        self.retried = 0
        self.failed: list[str] = []
        #: a retry waits for this (the killed gateway's sockets closed), as an SDK's backoff does
        self.may_retry: Callable[[], bool] = lambda: True
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)
        ]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def count(self) -> int:
        with self.lock:
            return len(self.answered)

    def _run(self, i: int) -> None:
        # no keep-alive: each request is a new connection, which the kernel gives to either gateway
        http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=60)
        client = openai.OpenAI(
            base_url=self.url + "/v1", api_key=self.key, max_retries=0, http_client=http
        )
        k = 0
        while not self.stop.is_set():
            k += 1
            for attempt in range(3):
                try:
                    raw = client.chat.completions.with_raw_response.create(
                        model=self.model,
                        max_tokens=4,
                        temperature=0,
                        messages=[{"role": "user", "content": f"client {i} request {k}"}],
                    )
                    assert raw.parse().usage.completion_tokens == 4
                    with self.lock:
                        self.answered.append(raw.headers["x-request-id"])
                    break
                except openai.APIConnectionError as e:  # reset by the killed gateway
                    with self.lock:
                        if attempt == 2:
                            self.failed.append(f"{type(e).__name__}: {e}")
                        else:
                            self.retried += 1
                    # A dying process's listener still takes connections until the kernel closes
                    # its files (after tearing down its memory) and resets them then: an SDK's
                    # backoff outlasts that; an immediate retry could land there again.
                    wait_for(self.may_retry, 30, "the killed gateway's sockets to close")
                except Exception as e:  # an error answer: no retry, it counts as a failure
                    with self.lock:
                        self.failed.append(f"{type(e).__name__}: {e}")
                    break
        http.close()


def exited(pid: int) -> bool:
    """The process is gone or a zombie: its files, listening sockets included, are closed."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def usage_records(home: Path) -> list[dict[str, Any]]:
    """Every usage record in the cluster's store, read through the CLI (what an operator runs)."""
    db = home / "gateway.db"  # duet/up_home.py::UpHome.store_url
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


def test_two_gateways_one_port_survive_a_killed_gateway(tiny_llama: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    up = start_up(
        home,
        tiny_llama,
        free_port(),
        tmp_path / "up.log",
        "--colocated",
        "--gateways",
        "2",
        "--restart-backoff",
        "0.2",
    )
    try:
        key = wait_banner(up)
        state = json.loads((home / "up" / "state.json").read_text())
        gws = {c["name"]: c for c in state["children"] if c["name"].startswith("gateway")}
        assert (
            set(gws) == {"gateway-0", "gateway-1"}
            and gws["gateway-0"]["url"] != gws["gateway-1"]["url"]
        )
        assert state["gateway"] == up.url and state["gateways"] == [
            gws["gateway-0"]["url"],
            gws["gateway-1"]["url"],
        ]

        admin = (home / "up" / "admin.key").read_text().strip()  # a gateway's /metrics needs it

        def served(name: str) -> float:
            return metric(gws[name]["url"], "duet:gateway_requests_total", admin)

        with Load(up.url, key, tiny_llama.name) as load:
            # the kernel spreads the connections: both gateways answer on the public port
            wait_for(
                lambda: served("gateway-0") > 0 and served("gateway-1") > 0,
                60,
                "both gateways to serve",
            )
            killed = gws["gateway-0"]["pid"]
            load.may_retry = lambda: exited(killed)
            os.kill(killed, signal.SIGKILL)
            before = load.count()
            wait_for(lambda: load.count() >= before + 5, 60, "requests answered by the survivor")

            def back() -> bool:
                c = next(
                    c
                    for c in json.loads((home / "up" / "state.json").read_text())["children"]
                    if c["name"] == "gateway-0"
                )
                return (
                    c["state"] == "running"
                    and c["restarts"] == 1
                    and c["pid"] != gws["gateway-0"]["pid"]
                )

            wait_for(back, 60, "gateway-0 to be restarted")
            # the restarted one is back in the port's group: it takes connections again
            wait_for(lambda: served("gateway-0") > 0, 60, "the restarted gateway to serve")
        assert not load.failed, load.failed[:5]
        assert load.count() > before + 5
        print(f"answered {load.count()}, retries {load.retried}")

        status = subprocess.run(
            [sys.executable, "-m", "duet", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "DUET_HOME": str(home)},
        )
        assert status.returncode == 0, status.stderr
        info = json.loads(status.stdout)
        assert info["gateways"] == {gws["gateway-0"]["url"]: "ok", gws["gateway-1"]["url"]: "ok"}
        shown = {c["name"]: c for c in info["up"]["children"]}
        assert (
            shown["gateway-0"]["restarts"] == 1
            and shown["gateway-0"]["last_exit"] == -signal.SIGKILL
        )
        assert shown["gateway-1"]["restarts"] == 0 and shown["gateway-1"]["state"] == "running"

        # Usage: every answered request has exactly one record, `ok`; a request whose answer the
        # kill lost after its record was written may add one more ok record (its retry is another
        # request), never more than the retries.
        records = usage_records(home)
        ok = [r["request_id"] for r in records if r["status"] == "ok"]
        by_id: dict[str, int] = {}
        for rid in (r["request_id"] for r in records):
            by_id[rid] = by_id.get(rid, 0) + 1
        assert all(by_id.get(rid) == 1 for rid in load.answered), [
            rid for rid in load.answered if by_id.get(rid) != 1
        ]
        assert set(load.answered) <= set(ok)
        assert len(load.answered) <= len(ok) <= len(load.answered) + load.retried
        stop_and_check_nothing_left(up, home, signal.SIGINT)
    finally:
        up.kill()


def test_gateways_must_be_at_least_one(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "duet", "up", "--gateways", "0", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DUET_HOME": str(tmp_path)},
    )
    assert r.returncode == 2 and "--gateways must be at least 1, got 0" in r.stderr, r.stderr


def _child(home: Path, name: str) -> dict[str, Any]:
    state = json.loads((home / "up" / "state.json").read_text())
    return next(c for c in state["children"] if c["name"] == name)


def test_a_frozen_gateway_is_taken_out_of_the_port(tiny_llama: Path, tmp_path: Path) -> None:
    """A SIGSTOPped gateway keeps its listener in the port's SO_REUSEPORT group, so the kernel
    keeps giving it new connections that nobody answers; the supervisor kills it once its own
    health port has been silent for `[restart] gateway_liveness_timeout_s` (10 s), and from then
    on every new connection through the public port is answered. Old code: the nodes' 60 s
    liveness deadline, so a third of new connections hung for a minute."""
    home = tmp_path / "home"
    up = start_up(
        home,
        tiny_llama,
        free_port(),
        tmp_path / "up.log",
        "--colocated",
        "--gateways",
        "2",
        "--restart-backoff-s",
        "0.2",
    )
    frozen = 0
    try:
        key = wait_banner(up)
        frozen = _child(home, "gateway-0")["pid"]
        os.kill(frozen, signal.SIGSTOP)
        # detection: the deadline, a probe's 2 s timeout and cadence, under a loaded machine
        wait_for(lambda: exited(frozen), 40, "the frozen gateway to be killed")
        wait_for(
            lambda: "gateway-0 not answering its health check for 10 s" in up.log(),
            10,
            "the supervisor to say why it killed gateway-0",
        )
        http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=30)
        client = openai.OpenAI(
            base_url=up.url + "/v1", api_key=key, max_retries=0, http_client=http
        )
        for k in range(12):  # each a new connection: the kernel picks a gateway for each
            r = client.chat.completions.create(
                model=tiny_llama.name,
                max_tokens=4,
                temperature=0,
                messages=[{"role": "user", "content": f"after the freeze {k}"}],
            )
            assert r.usage is not None and r.usage.completion_tokens == 4
        http.close()
        # restarted in its place, it serves its share again
        wait_for(
            lambda: (
                _child(home, "gateway-0")["state"] == "running"
                and _child(home, "gateway-0")["pid"] != frozen
            ),
            60,
            "gateway-0 to be restarted",
        )
        stop_and_check_nothing_left(up, home, signal.SIGINT)
    finally:
        if frozen and not exited(frozen):
            os.kill(frozen, signal.SIGCONT)
        up.kill()
