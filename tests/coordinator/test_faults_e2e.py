"""Faults on a real cluster: etcd stopped and restarted empty, a coordinator replica SIGKILLed
(failover and a new leader), drain with and without exit, and bad input that must get a 4xx
while the coordinator keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp

from coordinator.client import RouteClient, RouteError, replica_urls
from coordinator.etcd_server import EtcdServer
from coordinator.etcd_store import EtcdStore
from protocol.cluster import nodes_prefix
from protocol.route import RouteRequest
from tests.coordinator.conftest import (
    cluster_node,
    coordinator,
    get,
    http,
    metric,
    node,
    node_id_of,
    wait_ready,
)
from tests.procs import running
from tests.wait import wait_for


def short_route(model: str) -> dict:
    return {"model": model, "block_hashes": [], "num_prompt_tokens": 20, "max_tokens": 4}


def registered_ids(etcd_url: str) -> set[str]:
    async def ids() -> set[str]:
        store = EtcdStore(etcd_url)
        try:
            kvs, _ = await store.get_prefix(nodes_prefix("default"))
            return {kv.key.rsplit("/", 1)[-1] for kv in kvs}
        finally:
            await store.close()

    return asyncio.run(ids())


def test_etcd_restart_nodes_reregister_and_routing_resumes(
    tiny_llama: Path, tmp_path: Path, etcd: EtcdServer
) -> None:
    n = node("both", tiny_llama, tmp_path, etcd.url)
    coord = coordinator(tmp_path, etcd.url)
    with running(n, coord):
        nid = node_id_of(n)
        wait_ready(coord.url, [nid])
        model = cluster_node(coord.url, nid)["model"]
        assert http("POST", coord.url + "/route", short_route(model))[0] == 200

        etcd.stop()
        # The node notices, says so in its metrics, and keeps serving; the coordinator keeps
        # routing on its last view.
        wait_for(
            lambda: metric(n.url, "duet:etcd_registered") == 0, 30, "the node to report etcd down"
        )
        status, body = http(
            "POST", n.url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}
        )
        assert status == 200, body
        assert http("POST", coord.url + "/route", short_route(model))[0] == 200
        wait_for(
            lambda: not get(coord.url + "/cluster")["etcd_connected"],
            30,
            "the coordinator to see etcd down",
        )

        etcd.restart(wipe=True)  # same port, no keys, no leases: the node must register again
        wait_for(lambda: nid in registered_ids(etcd.url), 30, "the node to register again")
        wait_for(
            lambda: http("POST", coord.url + "/route", short_route(model))[0] == 200,
            30,
            "routing to resume",
        )
        # the node writes its key, then marks itself registered (node/registration.py: attach, then
        # on_up): the key can be seen a moment before the gauge says 1
        wait_for(
            lambda: metric(n.url, "duet:etcd_registered") == 1, 30, "the node to report etcd up"
        )
        assert "etcd unreachable" in n.log()
        wait_for(
            lambda: get(coord.url + "/cluster")["is_leader"], 30, "the coordinator to lead again"
        )


def test_a_frozen_node_gets_no_routes_while_etcd_still_lists_it(
    tiny_llama: Path, tmp_path: Path, etcd: EtcdServer
) -> None:
    """A SIGSTOPped node keeps its sockets and its etcd key (for a lease TTL) but sends nothing:
    the coordinator finds it by the silence of its event stream (no load frame for
    --stale-load-s) and routes only to the other node, then to it again once it is continued."""
    a = node("both", tiny_llama, tmp_path, etcd.url)
    b = node("both", tiny_llama, tmp_path, etcd.url)
    coord = coordinator(tmp_path, etcd.url, "--stale-load-s", "1")
    with running(a, b, coord):
        ida, idb = node_id_of(a), node_id_of(b)
        wait_ready(coord.url, [ida, idb])
        model = cluster_node(coord.url, ida)["model"]

        def routed() -> set[str]:
            out = set()
            for _ in range(8):
                status, body = http("POST", coord.url + "/route", short_route(model))
                assert status == 200, body
                out.add(body["decode"]["node_id"])
            return out

        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            frozen = time.monotonic()
            wait_for(
                lambda: not (cluster_node(coord.url, ida) or {}).get("ready"),
                8,
                "the coordinator to find the frozen node silent",
            )
            assert time.monotonic() - frozen < 8 and ida in registered_ids(etcd.url), (
                "the node left etcd before routing avoided it: the silence was not what found it"
            )
            assert all(routed() == {idb} for _ in range(3))
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        wait_for(lambda: ida in routed(), 30, "the continued node to be routed again")


BAD_ROUTES: list[tuple[bytes, dict[str, str], int, str]] = [
    (b"{not json", {}, 400, "not valid JSON"),
    (b"[]", {}, 400, "invalid route request"),
    (json.dumps({"model": "m"}).encode(), {}, 400, "missing required field"),
    (
        json.dumps(
            {"model": "m", "block_hashes": ["x"], "num_prompt_tokens": 5, "max_tokens": 1}
        ).encode(),
        {},
        400,
        "block_hashes",
    ),
    (
        json.dumps(
            {
                "model": "m",
                "block_hashes": [],
                "num_prompt_tokens": 5,
                "max_tokens": 1,
                "tier": "gold",
            }
        ).encode(),
        {},
        400,
        "tier",
    ),
    (
        json.dumps(
            {"model": "m", "block_hashes": [2**70], "num_prompt_tokens": 5, "max_tokens": 1}
        ).encode(),
        {},
        400,
        "",
    ),
    (b"{}", {"Content-Type": "text/plain"}, 415, "application/json"),
]


def test_replica_failover_leader_election_and_bad_input(
    tiny_llama: Path, tmp_path: Path, etcd: EtcdServer
) -> None:
    ttl = 5
    n = node("both", tiny_llama, tmp_path, etcd.url)
    c1 = coordinator(tmp_path, etcd.url, "--ttl", str(ttl), "--replica-id", "c1")
    c2 = coordinator(tmp_path, etcd.url, "--ttl", str(ttl), "--replica-id", "c2")
    with running(n, c1, c2):
        nid = node_id_of(n)
        for c in (c1, c2):
            wait_ready(c.url, [nid])
        model = cluster_node(c1.url, nid)["model"]
        wait_for(lambda: get(c1.url + "/cluster")["leader"] in ("c1", "c2"), 30, "a leader")
        leader = get(c1.url + "/cluster")["leader"]
        assert get(c2.url + "/cluster")["leader"] == leader
        lead, follow = (c1, c2) if leader == "c1" else (c2, c1)

        # Bad input: a 4xx with an OpenAI error body, and the replica keeps serving.
        for raw, headers, status, text in BAD_ROUTES:
            got, body = http("POST", lead.url + "/route", raw=raw, headers=headers)
            assert got == status, (raw, body)
            assert (
                set(body["error"]) == {"message", "type", "param", "code"}
                and text in body["error"]["message"]
            )
        for path, status in (("/nodes/nope/drain", 404), ("/nodes/bad%20id/drain", 400)):
            assert http("POST", lead.url + path)[0] == status
        assert http("GET", lead.url + "/nope")[0] == 404
        for q, status in (("", 400), ("?since=-3", 400), ("?since=x", 400), ("?since=99999", 410)):
            got, body = http("GET", n.url + "/kv/events" + q)
            assert got == status and body["error"]["message"], (q, body)
        assert http("POST", lead.url + "/route", short_route(model))[0] == 200
        assert get(lead.url + "/health")["status"] == "ok"

        async def route_via_client() -> str:
            async with aiohttp.ClientSession() as session:
                client = RouteClient([lead.url, follow.url], session, timeout=2.0)
                req = RouteRequest(model=model, block_hashes=[], num_prompt_tokens=20, max_tokens=4)
                resp = await client.route(req)
                try:
                    await client.route(
                        RouteRequest(
                            model="nope", block_hashes=[], num_prompt_tokens=20, max_tokens=4
                        )
                    )
                except RouteError as e:  # an answer, not a failure: no failover
                    assert e.status == 404 and e.code == "model_not_found"
                return resp.decode.node_id

        assert asyncio.run(route_via_client()) == nid

        async def replicas() -> list[str]:
            store = EtcdStore(etcd.url)
            try:
                return await replica_urls(store, "default")
            finally:
                await store.close()

        assert asyncio.run(replicas()) == sorted([c1.url, c2.url])
        t0 = time.monotonic()
        lead.proc.send_signal(signal.SIGKILL)
        assert asyncio.run(route_via_client()) == nid  # fails over to the other replica
        # Within the lease TTL (plus etcd's expiry tick and the watch round trip).
        wait_for(
            lambda: get(follow.url + "/cluster")["is_leader"], ttl + 1.5, "the follower to lead"
        )
        assert time.monotonic() - t0 <= ttl + 1.5
        assert metric(follow.url, "duet:coordinator_is_leader") == 1


def test_drain(tiny_llama: Path, tmp_path: Path, etcd: EtcdServer) -> None:
    a = node("both", tiny_llama, tmp_path, etcd.url, "--exit-when-drained")
    b = node("both", tiny_llama, tmp_path, etcd.url)
    coord = coordinator(tmp_path, etcd.url)
    with running(a, b, coord):
        aid, bid = node_id_of(a), node_id_of(b)
        wait_ready(coord.url, [aid, bid])
        model = cluster_node(coord.url, aid)["model"]

        # Through the coordinator: B gets no new routes, but keeps running.
        status, body = http("POST", coord.url + f"/nodes/{bid}/drain")
        assert status == 200 and body == {"node_id": bid, "status": "draining"}
        wait_for(lambda: cluster_node(coord.url, bid)["status"] == "draining", 30, "B draining")
        for _ in range(5):
            status, body = http("POST", coord.url + "/route", short_route(model))
            assert status == 200 and body["decode"]["node_id"] == aid
        # the node learns it from its own etcd watch, a moment after the coordinator may
        wait_for(lambda: metric(b.url, "duet:node_draining") == 1, 30, "B to see itself draining")
        assert b.proc.poll() is None

        # With the CLI, on a node with --exit-when-drained and a request in flight.
        result: dict = {}
        first_chunk = threading.Event()

        def stream() -> None:
            body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}
            req = urllib.request.Request(
                a.url + "/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                lines = []
                for line in r:
                    lines.append(line)
                    first_chunk.set()
                result["text"] = b"".join(lines).decode()

        t = threading.Thread(target=stream)
        t.start()
        assert first_chunk.wait(60)
        drain = subprocess.run(
            [
                sys.executable,
                "-m",
                "duet",
                "drain",
                aid,
                "--etcd",
                etcd.url,
                "--wait",
                "--timeout",
                "120",
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        t.join(60)
        assert drain.returncode == 0, drain.stderr
        assert f"{aid}: draining" in drain.stdout and f"{aid}: left the cluster" in drain.stdout
        assert '"finish_reason":"length"' in result["text"] and "[DONE]" in result["text"]
        assert a.proc.wait(60) == 0
        wait_for(lambda: cluster_node(coord.url, aid) is None, 30, "A to leave")
        status, body = http("POST", coord.url + "/route", short_route(model))
        assert status == 503 and body["error"]["code"] == "no_capacity"
        assert (
            subprocess.run(
                [sys.executable, "-m", "duet", "drain", "nope", "--etcd", etcd.url],
                capture_output=True,
                text=True,
            ).returncode
            == 1
        )
