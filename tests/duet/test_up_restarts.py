"""`duet up` heals itself, with real processes: a SIGKILLed etcd, coordinator replica, node or
gateway is restarted alone (same port, same data, registered again) while the others keep
their pids and the cluster keeps answering; a node that crash-loops (its port taken) is left
down after the limit while the rest serve and the coordinators drop it within 2 × its lease
TTL; Ctrl-C still stops everything, the restarted processes included.

Every component survives its peers' restarts (each pair, and the test that shows it):
- gateway × node: `..._a_killed_node_comes_back...` (D), `..._prefill_node_gone...` (P: the
  gateway prefills on D meanwhile and uses P again once it is back), the crash loop (no
  request fails on the node left down);
- gateway × coordinator: `..._killed_coordinator_rejoins...` (fails over to the other
  replica), `..._both_coordinators_gone...` (routes on etcd's view, then through them again);
- gateway × etcd: `..._killed_etcd_comes_back...` (answers while etcd is down and after);
- coordinator × etcd: the same test (both replicas reconnect, agree on a leader, see every node);
- coordinator × node: the restarted D is followed as a new engine by both replicas; a node
  left down leaves their view within 2 × TTL; the restarted coordinator's prefix index,
  rebuilt from the nodes' snapshots, equals the other replica's;
- node × etcd: nodes stay registered across etcd's restart (ready in both replicas);
- node × coordinator: the restarted replica streams every node's events (ready in its view).
(With etcd restarted *empty*, nodes register again: tests/coordinator/test_faults_e2e.py.)

One cluster for the module (2 coordinator replicas, 1 prefill, 2 decode nodes on the tiny
model, every request disaggregated): the tests run in file order and each leaves it whole,
except the crash loop (which leaves decode-1 down) and the last one (which stops it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from coordinator.etcd_store import EtcdStore
from tests.duet.test_up import alive, group_alive, start_up, wait_banner
from tests.gateway import helpers
from tests.procs import Proc, free_port
from tests.wait import wait_for

#: node lease TTL in this cluster (DUET_NODE_TTL_S): short, so a dead node's routes go fast
NODE_TTL_S = 3
MAX_RESTARTS = 2
CLUSTER_TOML = f"""
[coordinator]
replicas = 2
args = ["--ttl", "3", "--stale-load-s", "3", "--local-prefill-tokens", "0"]
[restart]
max_restarts = {MAX_RESTARTS}
backoff_s = 0.2
backoff_max_s = 1.0
startup_timeout_s = 120.0
[[nodes]]
role = "prefill"
[[nodes]]
role = "decode"
count = 2
"""


@dataclass
class Up:
    proc: Proc
    home: Path
    key: str
    model: str

    def state(self) -> dict[str, Any]:
        return json.loads((self.home / "up" / "state.json").read_text())

    def child(self, name: str) -> dict[str, Any]:
        return next(c for c in self.state()["children"] if c["name"] == name)

    def pids(self) -> dict[str, int]:
        return {c["name"]: c["pid"] for c in self.state()["children"]}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.proc.url + "/v1", api_key=self.key, max_retries=0, timeout=60
        )

    def ask(self, n: int = 3) -> None:
        """`n` chat requests through the gateway, each answered in full (prompts of a few
        blocks, so the prefix caches and the coordinators' index have something to hold)."""
        for i in range(n):
            text = f"hello {i}: " + "the quick brown fox jumps over the lazy dog " * 4
            r = self.client().chat.completions.create(
                model=self.model,
                max_tokens=4,
                temperature=0,
                messages=[{"role": "user", "content": text}],
            )
            assert r.usage.completion_tokens == 4, r

    def metric(self, url: str, name: str) -> float:
        """Sum of a Prometheus metric over its labels (a gateway's needs duet up's admin key)."""
        return helpers.metric(url, name, (self.home / "up" / "admin.key").read_text().strip())

    @property
    def auth(self) -> dict[str, str]:
        """The cluster secret `duet up` generated: the internal endpoints need it."""
        return {
            "Authorization": f"Bearer {(self.home / 'up' / 'cluster.secret').read_text().strip()}"
        }

    def cluster(self, url: str | None = None) -> dict[str, Any]:
        req = urllib.request.Request(
            (url or self.state()["coordinators"][0]) + "/cluster", headers=self.auth
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def status(self) -> tuple[int, dict[str, Any]]:
        r = subprocess.run(
            [sys.executable, "-m", "duet", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "DUET_HOME": str(self.home)},
        )
        return r.returncode, json.loads(r.stdout)


@pytest.fixture(scope="module")
def up(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("up-restarts")
    (tmp / "cluster.toml").write_text(CLUSTER_TOML)
    os.environ["DUET_NODE_TTL_S"] = str(NODE_TTL_S)  # read by the nodes `duet up` starts
    try:
        p = start_up(
            tmp / "home",
            tiny_llama,
            free_port(),
            tmp / "up.log",
            "--config",
            str(tmp / "cluster.toml"),
        )
    finally:
        del os.environ["DUET_NODE_TTL_S"]
    try:
        yield Up(p, tmp / "home", wait_banner(p), tiny_llama.name)
    finally:
        p.kill()


def kill_and_wait_back(up: Up, name: str, restarts: int = 1) -> dict[str, Any]:
    """SIGKILL child `name`; wait until the supervisor has it running again. Its new status."""
    before = up.child(name)
    others = {k: v for k, v in up.pids().items() if k != name}
    os.kill(before["pid"], signal.SIGKILL)
    after = wait_for(
        lambda: (c := up.child(name))["state"] == "running" and c["restarts"] == restarts and c,
        120,
        f"{name} to be restarted",
    )
    assert after["pid"] != before["pid"] and after["url"] == before["url"]  # same port
    assert after["last_exit"] == -signal.SIGKILL and "killed by SIGKILL" in after["last_cause"]
    assert {k: v for k, v in up.pids().items() if k != name} == others  # nobody else touched
    assert all(alive(p) for p in others.values())
    return after


def test_a_killed_node_comes_back_on_its_port_registered_and_serving(up: Up) -> None:
    engine_before = next(
        n["engine_id"] for n in up.cluster()["nodes"] if n["node_id"] == "decode-0"
    )
    after = kill_and_wait_back(up, "decode-0")
    # Registered again, as a new engine, and every replica streams its events (index rebuilt).
    for url in up.state()["coordinators"]:
        wait_for(
            lambda u=url: any(
                n["node_id"] == "decode-0" and n["ready"] and n["engine_id"] != engine_before
                for n in up.cluster(u)["nodes"]
            ),
            60,
            "decode-0 ready again",
        )
    # It serves on its old port, and the gateway answers.
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    req = urllib.request.Request(
        after["url"] + "/v1/completions", body, {"Content-Type": "application/json", **up.auth}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert json.loads(r.read())["usage"]["completion_tokens"] == 2
    up.ask()
    rc, info = up.status()
    assert rc == 0
    shown = next(c for c in info["up"]["children"] if c["name"] == "decode-0")
    assert shown["restarts"] == 1 and shown["last_exit"] == -9 and shown["state"] == "running"
    assert (
        "decode-0 killed by SIGKILL after" in up.proc.log()
        and "restarting decode-0 (restart 1" in up.proc.log()
    )


def test_a_killed_etcd_comes_back_with_its_data(up: Up) -> None:
    etcd_url = up.state()["etcd"]

    async def put_get(value: bytes | None) -> bytes | None:
        store = EtcdStore(etcd_url)
        try:
            if value is not None:
                await store.put("/duet/test/marker", value)
            kvs, _ = await store.get_prefix("/duet/test/marker")
            return kvs[0].value if kvs else None
        finally:
            await store.close()

    assert asyncio.run(put_get(b"kept")) == b"kept"
    pid = up.child("etcd")["pid"]
    os.kill(pid, signal.SIGKILL)
    up.ask(1)  # the gateway and the coordinators do not need etcd to serve
    wait_for(
        lambda: (c := up.child("etcd"))["state"] == "running" and c["restarts"] == 1,
        120,
        "etcd back",
    )
    assert asyncio.run(put_get(None)) == b"kept"  # same data directory
    # Both replicas are connected again, agree on a leader and see every node; the gateway serves.
    coords = up.state()["coordinators"]

    def healed() -> bool:
        views = [up.cluster(u) for u in coords]
        return (
            all(
                v["etcd_connected"]
                and {n["node_id"] for n in v["nodes"] if n["ready"]}
                == {"prefill-0", "decode-0", "decode-1"}
                for v in views
            )
            and len({v["leader"] for v in views}) == 1
            and views[0]["leader"] is not None
        )

    wait_for(healed, 60, "the coordinators to see etcd and every node again")
    up.ask()


def test_a_killed_coordinator_rejoins_the_election(up: Up) -> None:
    coords = up.state()["coordinators"]
    leader = up.cluster(coords[0])["leader"]
    name = leader if len(coords) > 1 else "coordinator"
    # The gateway serves while the leading replica is down (it fails over to the other).
    before = up.child(name)
    os.kill(before["pid"], signal.SIGKILL)
    up.ask(2)
    after = wait_for(
        lambda: (c := up.child(name))["state"] == "running" and c["restarts"] == 1 and c,
        120,
        f"{name} to be restarted",
    )
    assert after["url"] == before["url"] and after["pid"] != before["pid"]

    def agreed() -> bool:
        views = [up.cluster(u) for u in coords]
        leaders = {v["leader"] for v in views}
        return (
            len(leaders) == 1
            and None not in leaders
            and sum(v["is_leader"] for v in views) == 1
            and all(sum(n["ready"] for n in v["nodes"]) == 3 for v in views)
        )

    wait_for(agreed, 60, "one leader that both replicas agree on, every node ready in both")
    # The restarted replica rebuilt its prefix index from the nodes' snapshots.
    up.ask()
    views = [{n["node_id"]: n["indexed_blocks"] for n in up.cluster(u)["nodes"]} for u in coords]
    assert views[0] == views[1] and views[0]["prefill-0"] > 0, views


def test_both_coordinators_gone_the_gateway_routes_on_its_own_then_through_them(up: Up) -> None:
    gw = up.state()["gateway"]
    fallbacks = up.metric(gw, "duet:route_fallback_total")
    names = [c["name"] for c in up.state()["children"] if c["name"].startswith("coordinator")]
    restarts = {n: up.child(n)["restarts"] for n in names}
    for n in names:
        os.kill(up.child(n)["pid"], signal.SIGKILL)
    up.ask(2)  # no replica answers: the gateway routes on etcd's view of the nodes
    assert up.metric(gw, "duet:route_fallback_total") >= fallbacks + 2
    for n in names:
        wait_for(
            lambda n=n: (
                (c := up.child(n))["state"] == "running" and c["restarts"] == restarts[n] + 1
            ),
            120,
            f"{n} back",
        )
    for u in up.state()["coordinators"]:
        wait_for(
            lambda u=u: sum(n["ready"] for n in up.cluster(u)["nodes"]) == 3, 60, "every node ready"
        )
    fallbacks = up.metric(gw, "duet:route_fallback_total")
    up.ask(2)
    assert up.metric(gw, "duet:route_fallback_total") == fallbacks  # through the coordinators again


def test_prefill_node_gone_the_gateway_prefills_on_d_then_uses_it_again(up: Up) -> None:
    p = up.child("prefill-0")
    os.kill(p["pid"], signal.SIGKILL)
    up.ask(2)  # P is dead (the coordinator may not know yet): prefilled on a decode node instead
    wait_for(
        lambda: (c := up.child("prefill-0"))["state"] == "running" and c["restarts"] == 1,
        120,
        "P back",
    )
    for u in up.state()["coordinators"]:
        wait_for(
            lambda u=u: any(
                n["node_id"] == "prefill-0" and n["ready"] for n in up.cluster(u)["nodes"]
            ),
            60,
            "prefill-0 ready again",
        )
    served = up.metric(p["url"], "duet:e2e_request_latency_seconds_count")
    up.ask(2)
    assert up.metric(p["url"], "duet:e2e_request_latency_seconds_count") >= served + 2


def test_a_killed_gateway_comes_back_on_its_port_with_its_store(up: Up) -> None:
    usage = up.client().get("/usage", cast_to=object)["data"][0]["requests"]
    kill_and_wait_back(up, "gateway")
    up.ask(1)
    assert up.client().get("/usage", cast_to=object)["data"][0]["requests"] == usage + 1


def test_bench_chaos_against_a_running_up_without_kills(up: Up, tmp_path: Path) -> None:
    """`duet bench chaos --url --home` (the running cluster, its dev key from the home), as a
    baseline: no kill, every request full, the batch once, usage equal to the client's counts."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "duet",
            "bench",
            "chaos",
            "--url",
            up.proc.url,
            "--home",
            str(up.home),
            "--duration",
            "6",
            "--kill-every",
            "0",
            "--streams",
            "2",
            "--plain",
            "1",
            "--batch-lines",
            "3",
            "--max-tokens",
            "4",
            "--settle",
            "30",
            "--out",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["kills"] == [] and s["requests"] > 0 and s["full"] == s["requests"], s["causes"]
    assert (
        s["batch"]["exactly_once"]
        and s["usage"]["requests_match"]
        and s["usage"]["completion_tokens_match"]
    ), s
    assert set(s["kv_blocks_held_after"]) == {"prefill-0", "decode-0", "decode-1"}
    assert not any(s["kv_blocks_held_after"].values())


def test_a_crash_looping_node_is_left_down_and_its_routes_go(up: Up) -> None:
    d1 = up.child("decode-1")
    port = int(d1["url"].rsplit(":", 1)[1])
    blocker = socket.socket()
    # Connections to the dead node linger in TIME_WAIT; a listener (ours) is what makes its
    # restarts fail, as its own socket has SO_REUSEADDR too.
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        os.kill(d1["pid"], signal.SIGKILL)
        # Take its port while it is dead: each restart fails to listen and exits.
        wait_for(lambda: not alive(d1["pid"]), 30, "decode-1 to die")
        wait_for(lambda: _bind(blocker, port), 30, "decode-1's port to be free")
        blocker.listen()
        failed = wait_for(
            lambda: (c := up.child("decode-1"))["state"] == "failed" and c,
            180,
            "decode-1 to be left down",
        )
        assert (
            failed["failures_in_a_row"] == MAX_RESTARTS + 1 and failed["restarts"] == MAX_RESTARTS
        )
        assert "leaving it down (the rest keep serving)" in up.proc.log()
        # The coordinators drop it within 2 × its lease TTL of its death; nothing routes there.
        for url in up.state()["coordinators"]:
            wait_for(
                lambda u=url: "decode-1" not in {n["node_id"] for n in up.cluster(u)["nodes"]},
                2 * NODE_TTL_S + 5,
                "decode-1 to leave the coordinator's view",
            )
        up.ask(4)
        rc, info = up.status()
        shown = next(c for c in info["up"]["children"] if c["name"] == "decode-1")
        assert (
            shown["state"] == "failed" and rc == 1
        )  # a process left down is not a healthy cluster
        text = subprocess.run(
            [sys.executable, "-m", "duet", "status"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "DUET_HOME": str(up.home), "COLUMNS": "200"},
        ).stdout
        assert "crash loop" in text
        # No restart happens any more, even with the port free again.
        blocker.close()
        assert up.child("decode-1")["restarts"] == MAX_RESTARTS
    finally:
        blocker.close()


def _bind(s: socket.socket, port: int) -> bool:
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def test_ctrl_c_stops_everything_restarted_ones_included(up: Up) -> None:
    pids = [c["pid"] for c in up.state()["children"] if c["state"] != "failed"]
    assert len(pids) == 6 and all(alive(p) for p in pids)
    up.proc.proc.send_signal(signal.SIGINT)
    assert up.proc.proc.wait(120) == 0, up.proc.log()[-3000:]
    left = [p for p in pids if alive(p) or group_alive(p)]
    assert not left, (left, up.proc.log()[-3000:])
    assert "duet up: stopped" in up.proc.log()


def test_restart_policy_from_cluster_toml_and_flags() -> None:
    import argparse

    from duet.cmd_up import add_parser, build_config
    from duet.supervisor import RestartPolicy, exit_cause
    from duet.up_config import UpConfig, UpConfigError, parse_cluster_toml

    r = RestartPolicy(backoff_s=1.0, backoff_max_s=5.0)
    assert [r.delay(k) for k in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert exit_cause(-9) == "killed by SIGKILL" and exit_cause(3) == "exited with code 3"
    cfg = parse_cluster_toml({"restart": {"max_restarts": 0, "stable_s": 5}}, UpConfig())
    assert (
        cfg.restart.max_restarts == 0 and cfg.restart.stable_s == 5 and cfg.restart.backoff_s == 1.0
    )
    for bad, msg in [
        ({"restart": {"max_restart": 1}}, "unknown keys: max_restart"),
        ({"restart": {"backoff_s": -1}}, "backoff_s must be a number >= 0"),
        ({"restart": {"max_restarts": 1.5}}, "whole number"),
    ]:
        with pytest.raises(UpConfigError, match=msg):
            parse_cluster_toml(bad, UpConfig())
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    cfg = build_config(p.parse_args(["up", "--max-restarts", "7", "--restart-backoff", "0.5"]))
    assert cfg.restart.max_restarts == 7 and cfg.restart.backoff_s == 0.5


def test_status_table_shows_restarts_last_exit_and_backoff() -> None:
    from rich.console import Console

    from duet.up_status import failed, process_table

    children = [
        {
            "name": "etcd",
            "pid": 10,
            "state": "running",
            "restarts": 0,
            "failures_in_a_row": 0,
            "alive": True,
        },
        {
            "name": "decode-0",
            "pid": 11,
            "state": "backoff",
            "restarts": 2,
            "failures_in_a_row": 2,
            "last_exit": -9,
            "last_cause": "killed by SIGKILL after 3.0 s",
            "next_start": 104.0,
            "alive": False,
        },
        {
            "name": "decode-1",
            "pid": 12,
            "state": "failed",
            "restarts": 5,
            "failures_in_a_row": 6,
            "last_exit": 1,
            "alive": False,
        },
    ]
    con = Console(width=200, record=True)
    con.print(process_table(children, now=100.0))
    text = con.export_text()
    assert "backoff (restart in 4 s)" in text and "killed by SIGKILL after 3.0 s" in text
    assert "failed (crash loop: left down)" in text and "exited with code 1" in text
    assert failed(children) == ["decode-1"]
