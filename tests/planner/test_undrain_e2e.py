"""Undoing a drain on real nodes (#27): a drained node goes back into routing.

Real etcd, a coordinator, a prefill and a decode node on the tiny model, all with a cluster
secret. A drained node (by its own `POST /drain`, or by the coordinator's etcd rewrite) is
undone — by `duet drain --undo`, by the coordinator's `DELETE /nodes/{id}/drain`, and by the
Kubernetes actuator whose scale-in failed after the drain: its readiness is 200 again, etcd says
`active`, and the coordinator's `/route` picks it again. A `POST /drain?wait=` still waiting
answers `outcome: cancelled`. Without the secret the undo is 401 and changes nothing; a node
that is stopping (SIGTERM's grace period) refuses with 409 `node_stopping`.

Every assertion that the node serves again fails on the code before the undo existed (no
`DELETE /drain`: 405, and the node stayed drained until it went away).
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.coordinator.conftest import http
from tests.procs import Proc, running, secured_plane
from tests.wait import until, wait_for

NODE_ARGS = ("--dtype", "float32", "--kv-blocks", "128", "--max-model-len", "512", "--transport", "tcp")
SECRET = secrets.token_urlsafe(32)
AUTH = {"Authorization": f"Bearer {SECRET}"}
P_ID, D_ID = "prefill-0", "decode-0"


@dataclass
class Cluster:
    coordinator: Proc
    prefill: Proc
    decode: Proc
    etcd: str
    model: str
    secret_file: Path


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # --local-prefill-tokens 8: a prompt of 64 tokens goes to a prefill node when one is routable
    with secured_plane(tmp_path_factory.mktemp("undrain"), SECRET, "--local-prefill-tokens", "8") as plane:
        # a long hold lease: a prefill leg's KV stays held (the node busy) until the test ends it
        p = plane.node("prefill", tiny_llama, *NODE_ARGS, "--lease-seconds", "120", node_id=P_ID)
        d = plane.node("decode", tiny_llama, *NODE_ARGS, node_id=D_ID)
        with running(plane.coordinator, p, d):
            c = Cluster(plane.coordinator, p, d, plane.etcd, tiny_llama.name, plane.secret_file)
            wait_for(lambda: _routed(c, P_ID, D_ID), 60, "the coordinator to route to both nodes")
            yield c


def _route(c: Cluster) -> tuple[int, Any]:
    body = {"model": c.model, "block_hashes": [], "num_prompt_tokens": 64, "max_tokens": 2}
    return http("POST", c.coordinator.url + "/route", body, headers=AUTH)


def _routed(c: Cluster, prefill: str | None, decode: str) -> bool:
    """The coordinator's answer for a 64-token prompt names these nodes."""
    status, r = _route(c)
    return status == 200 and (r["prefill"] or {}).get("node_id") == prefill and r["decode"]["node_id"] == decode


def _status_in_coordinator(c: Cluster, node_id: str) -> str | None:
    status, body = http("GET", c.coordinator.url + "/cluster", headers=AUTH)
    assert status == 200, body
    return next((n["status"] for n in body["nodes"] if n["node_id"] == node_id), None)


def _ready(node: Proc) -> int:
    return http("GET", node.url + "/health?probe=ready")[0]


def _undo_cli(c: Cluster, node_id: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "duet", "drain", "--undo", node_id, "--etcd", c.etcd, *extra],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


async def _hold_kv(s: aiohttp.ClientSession, p_url: str) -> dict[str, Any]:
    """A prefill leg whose KV no decode node pulls: P stays busy (held = 1) while draining."""
    leg = {"prompt": [(7 + i * 31) % 380 + 1 for i in range(64)], "max_tokens": 1,
           "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    async with s.post(p_url + "/v1/completions", json=leg) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["kv_transfer_params"]


def test_duet_drain_undo_puts_a_draining_prefill_node_back_into_routing(cluster: Cluster) -> None:
    c, p = cluster, cluster.prefill

    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession(headers=AUTH) as s:
            await _hold_kv(s, p.url)
            # a drain call waiting for completion (a preStop hook's): P cannot go idle (KV held)
            async def drain_and_wait() -> tuple[int, dict[str, Any]]:
                async with s.post(p.url + "/drain", params={"wait": "60"}) as r:
                    return r.status, await r.json()

            waiter = asyncio.create_task(drain_and_wait())
            await until(lambda: _status_in_coordinator(c, P_ID) == "draining", 10, "P draining in the coordinator")
            assert _ready(p) == 503
            assert _routed(c, None, D_ID), _route(c)  # no route to P: the prompt is prefilled on D

            # without the secret: 401, and nothing changed
            async with aiohttp.ClientSession() as bare, bare.delete(p.url + "/drain") as r:
                assert r.status == 401, await r.text()
                assert (await r.json())["error"]["code"] == "cluster_secret_required"
            assert _undo_cli(c, P_ID).returncode == 1  # the CLI without the secret: refused
            assert _ready(p) == 503 and not waiter.done()

            out = await asyncio.to_thread(_undo_cli, c, P_ID, "--cluster-secret-file", str(c.secret_file))
            assert out.returncode == 0, out.stderr
            assert f"{P_ID}: undrained: routed again" in out.stdout, out.stdout
            # the waiting drain call answers at once: its drain was called off
            status, answer = await asyncio.wait_for(waiter, 5)
            assert status == 200, answer
            return answer

    answer = asyncio.run(go())
    assert answer["outcome"] == "cancelled" and answer["draining"] is False and not answer["idle"], answer
    assert _ready(p) == 200
    status, now = http("GET", p.url + "/drain", headers=AUTH)
    assert status == 200 and now["outcome"] == "active" and now["held"] == 1, now
    wait_for(lambda: _status_in_coordinator(c, P_ID) == "active", 10, "P active in the coordinator")
    wait_for(lambda: _routed(c, P_ID, D_ID), 10, "the coordinator to route a prefill to P again")
    # undo is idempotent
    out = _undo_cli(c, P_ID, "--cluster-secret-file", str(c.secret_file))
    assert out.returncode == 0 and f"{P_ID}: was not draining" in out.stdout, (out.stdout, out.stderr)


def test_the_coordinators_undo_reverses_its_own_etcd_drain(cluster: Cluster) -> None:
    """The coordinator drains by rewriting the node's registration in etcd; its undo goes to the
    node, which writes `active` itself — and the late echo of the earlier `draining` events must
    not drain it again."""
    c, d = cluster, cluster.decode
    url = c.coordinator.url + f"/nodes/{D_ID}/drain"
    status, body = http("POST", url, {}, headers=AUTH)
    assert status == 200 and body["status"] == "draining", body
    wait_for(lambda: _ready(d) == 503, 10, "D to read its drain from etcd")
    wait_for(lambda: _route(c)[0] == 503, 10, "no route: the only decode node is drained")

    status, body = http("DELETE", url, headers={"Authorization": "Bearer " + secrets.token_urlsafe(32)})
    assert status == 401 and _ready(d) == 503, body
    status, body = http("DELETE", url, headers=AUTH)
    assert status == 200 and body == {"node_id": D_ID, "role": "decode", "outcome": "undrained"}, body
    assert _ready(d) == 200
    wait_for(lambda: _routed(c, P_ID, D_ID), 10, "the coordinator to route to D again")
    status, body = http("DELETE", url, headers=AUTH)
    assert status == 200 and body["outcome"] == "not_draining", body
    status, body = http("DELETE", c.coordinator.url + "/nodes/no-such-node/drain", headers=AUTH)
    assert status == 404 and body["error"]["code"] == "node_not_found", body
    # still routed a while later: no stale `draining` event drained it again
    wait_for(lambda: _status_in_coordinator(c, D_ID) == "active" and _routed(c, P_ID, D_ID), 5, "D routed")
    assert _ready(d) == 200


def test_a_kubernetes_scale_in_that_fails_after_the_drain_leaves_the_node_serving(cluster: Cluster) -> None:
    """The FAILED-after-drain case of planner/kube.py on a real node: another pod is not Ready
    and the drained victim never reads not Ready (its kubelet does not probe within
    ready_wait_s), so the Deployment is not patched — and the victim is undrained, not left
    serving nothing."""
    from kubernetes import client

    from planner.actuator import Outcome, Victim
    from planner.drain import Drainer
    from planner.kube import DELETION_COST, KubernetesActuator
    from planner.pools import PoolKey
    from tests.planner.fake_kube import FakeKube, FakePod
    from tests.planner.test_kube_actuator import serve

    c, d = cluster, cluster.decode

    async def go() -> None:
        pods = [FakePod(D_ID, "duet-decode"), FakePod("duet-decode-starting", "duet-decode", ready=False)]
        kube = FakeKube(replicas={"duet-decode": 2}, pods=pods, kubelet_period_s=3600)
        async with serve(kube.app()) as api, aiohttp.ClientSession() as s:
            act = KubernetesActuator("duet", Drainer(s, auth=AUTH, poll_s=0.1, deadline_s=30),
                                     api_client=client.ApiClient(client.Configuration(host=api)),
                                     ready_wait_s=0.5, poll_s=0.1)  # fmt: skip
            try:
                r = await act.scale_in(PoolKey("decode", c.model, "shared"), Victim(D_ID, d.url), 1)
            finally:
                await act.close()
        assert r.outcome == Outcome.FAILED and "still reads Ready" in r.detail, r
        assert f"{D_ID} undrained: it serves again" in r.detail, r
        assert kube.replicas["duet-decode"] == 2 and kube.deleted == []
        assert DELETION_COST not in kube.annotations.get(D_ID, {}), kube.annotations

    asyncio.run(go())
    assert _ready(d) == 200
    wait_for(lambda: _status_in_coordinator(c, D_ID) == "active" and _routed(c, P_ID, D_ID), 10,
             "the coordinator to route to D again")  # fmt: skip


def test_a_node_that_is_stopping_refuses_the_undo(cluster: Cluster) -> None:
    """SIGTERM's grace period (P waits for its held KV): 409 node_stopping from the node, the
    coordinator and the CLI. (Last in this module: P is stopped.)"""
    c, p = cluster, cluster.prefill
    status, held = http("GET", p.url + "/drain", headers=AUTH)
    assert status == 200 and held["held"] >= 1, held  # the first test's leg, still unpulled
    p.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: http("GET", p.url + "/drain", headers=AUTH)[1]["draining"], 10, "P stopping")
    try:
        status, body = http("DELETE", p.url + "/drain", headers=AUTH)
        assert status == 409 and body["error"]["code"] == "node_stopping", body
        status, body = http("DELETE", c.coordinator.url + f"/nodes/{P_ID}/drain", headers=AUTH)
        assert status == 409 and body["error"]["code"] == "node_stopping", body
        out = _undo_cli(c, P_ID, "--cluster-secret-file", str(c.secret_file))
        assert out.returncode == 1 and "409" in out.stderr and "stopping" in out.stderr, out.stderr
        assert _ready(p) == 503 and p.proc.poll() is None
    finally:
        p.kill()
