"""Undoing a drain on real nodes: a drained node goes back into routing.

Real etcd, a coordinator, a prefill and a decode node on the tiny model, all with a cluster
secret. A drained node (by its own `POST /drain`, or by the coordinator's etcd rewrite) is
undone — by `duet drain --undo`, by the coordinator's `DELETE /nodes/{id}/drain`, and by the
Kubernetes and the local actuator whose scale-in failed after the drain: its readiness is 200
again, etcd says `active`, and the coordinator's `/route` picks it again. The local actuator's
`duet up` is a stand-in (DuetUpStandIn) on the control endpoint's wire types whose stop is
refused, fails, drops its connection or finds nothing listening. A `POST /drain?wait=` still
waiting answers `outcome: cancelled`. Without the secret the undo is 401 and changes nothing; a
node that is stopping (SIGTERM's grace period) refuses with 409 `node_stopping`.

Every assertion that the node serves again fails on the code before the undo existed (no
`DELETE /drain`: 405, and the node stayed drained until it went away).
"""

from __future__ import annotations

import asyncio
import enum
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from coordinator.drain import find_node
from coordinator.etcd_store import EtcdStore
from planner.actuator import ActResult, Outcome, Victim
from planner.drain import DrainEnd, Drainer
from planner.local import ControlError, LocalActuator, NodeStopped
from planner.pools import PoolKey
from protocol.cluster import NodeStatus
from tests.coordinator.conftest import http
from tests.procs import Proc, free_port, running, secured_plane
from tests.wait import until, wait_for

NODE_ARGS = (
    "--dtype",
    "float32",
    "--kv-blocks",
    "128",
    "--max-model-len",
    "512",
    "--transport",
    "tcp",
)
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
    with secured_plane(
        tmp_path_factory.mktemp("undrain"), SECRET, "--local-prefill-tokens", "8"
    ) as plane:
        # a long hold lease: a prefill leg's KV stays held (the node busy) until the module's last
        # test, which kills P. 120 s ran out once under `-n 2` (the module took longer), so the
        # lease is far longer than any module run; nothing waits for it to expire
        p = plane.node("prefill", tiny_llama, *NODE_ARGS, "--lease-seconds", "1800", node_id=P_ID)
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
    return (
        status == 200
        and (r["prefill"] or {}).get("node_id") == prefill
        and r["decode"]["node_id"] == decode
    )


def _status_in_coordinator(c: Cluster, node_id: str) -> str | None:
    status, body = http("GET", c.coordinator.url + "/cluster", headers=AUTH)
    assert status == 200, body
    return next((n["status"] for n in body["nodes"] if n["node_id"] == node_id), None)


def _ready(node: Proc) -> int:
    return http("GET", node.url + "/health?probe=ready")[0]


def _undo_cli(c: Cluster, node_id: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "duet", "drain", "--undo", node_id, "--etcd", c.etcd, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def _hold_kv(s: aiohttp.ClientSession, p_url: str) -> dict[str, Any]:
    """A prefill leg whose KV no decode node pulls: P stays busy (held = 1) while draining."""
    leg = {
        "prompt": [(7 + i * 31) % 380 + 1 for i in range(64)],
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
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
            await until(
                lambda: _status_in_coordinator(c, P_ID) == "draining",
                10,
                "P draining in the coordinator",
            )
            assert _ready(p) == 503
            assert _routed(c, None, D_ID), _route(c)  # no route to P: the prompt is prefilled on D

            # without the secret: 401, and nothing changed
            async with aiohttp.ClientSession() as bare, bare.delete(p.url + "/drain") as r:
                assert r.status == 401, await r.text()
                assert (await r.json())["error"]["code"] == "cluster_secret_required"
            assert _undo_cli(c, P_ID).returncode == 1  # the CLI without the secret: refused
            assert _ready(p) == 503 and not waiter.done()

            out = await asyncio.to_thread(
                _undo_cli, c, P_ID, "--cluster-secret-file", str(c.secret_file)
            )
            assert out.returncode == 0, out.stderr
            assert f"{P_ID}: undrained: routed again" in out.stdout, out.stdout
            # the waiting drain call answers at once: its drain was called off
            status, answer = await asyncio.wait_for(waiter, 5)
            assert status == 200, answer
            return answer

    answer = asyncio.run(go())
    assert (
        answer["outcome"] == "cancelled" and answer["draining"] is False and not answer["idle"]
    ), answer
    assert _ready(p) == 200
    status, now = http("GET", p.url + "/drain", headers=AUTH)
    assert status == 200 and now["outcome"] == "active" and now["held"] == 1, now
    wait_for(lambda: _status_in_coordinator(c, P_ID) == "active", 10, "P active in the coordinator")
    wait_for(lambda: _routed(c, P_ID, D_ID), 10, "the coordinator to route a prefill to P again")
    # undo is idempotent
    out = _undo_cli(c, P_ID, "--cluster-secret-file", str(c.secret_file))
    assert out.returncode == 0 and f"{P_ID}: was not draining" in out.stdout, (
        out.stdout,
        out.stderr,
    )


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

    status, body = http(
        "DELETE", url, headers={"Authorization": "Bearer " + secrets.token_urlsafe(32)}
    )
    assert status == 401 and _ready(d) == 503, body
    status, body = http("DELETE", url, headers=AUTH)
    assert status == 200 and body == {"node_id": D_ID, "role": "decode", "outcome": "undrained"}, (
        body
    )
    assert _ready(d) == 200
    wait_for(lambda: _routed(c, P_ID, D_ID), 10, "the coordinator to route to D again")
    status, body = http("DELETE", url, headers=AUTH)
    assert status == 200 and body["outcome"] == "not_draining", body
    status, body = http("DELETE", c.coordinator.url + "/nodes/no-such-node/drain", headers=AUTH)
    assert status == 404 and body["error"]["code"] == "node_not_found", body
    # still routed a while later: no stale `draining` event drained it again
    wait_for(
        lambda: _status_in_coordinator(c, D_ID) == "active" and _routed(c, P_ID, D_ID),
        5,
        "D routed",
    )
    assert _ready(d) == 200


def test_a_planner_drain_whose_owner_stops_renewing_it_lapses_and_the_node_serves_again(
    cluster: Cluster,
) -> None:
    """A scale-in never leaves its victim in between: the planner's drain is owned and renewed
    by its polls; when they stop — the leader SIGKILLed, partitioned, stopped or no longer
    leading half-way through — the node undoes the drain itself once its lease runs out: active
    in etcd, Ready, routed. While renewed it stays drained; an operator's drain never lapses.
    On the code before (no owner), the owned drain stayed: the node served nothing until it
    went away."""
    c, d = cluster, cluster.decode
    owner = "planner/coordinator-9"

    async def drain_then_vanish() -> None:
        async with aiohttp.ClientSession() as session:
            drainer = Drainer(session, auth=AUTH, owner=owner, lease_s=3, deadline_s=4)
            # renewed by the drainer's own polls until it is idle
            assert await drainer.drain(d.url) in (DrainEnd.IDLE, DrainEnd.DEADLINE)

    asyncio.run(drain_then_vanish())
    assert _ready(d) == 503 and _status_in_coordinator(c, D_ID) == "draining"
    # the owner is gone: nobody renews; past its 3 s lease the node undoes the drain
    wait_for(lambda: _ready(d) == 200, 15, "the lapsed drain to be undone by the node")
    wait_for(lambda: _status_in_coordinator(c, D_ID) == "active", 10, "etcd to say active")
    wait_for(lambda: _routed(c, P_ID, D_ID), 10, "the coordinator to route to D again")

    # an operator's drain (no owner) does not lapse
    status, body = http("POST", d.url + "/drain", {}, headers=AUTH)
    assert status == 200 and body["draining"], body
    with pytest.raises(AssertionError, match="timed out"):
        wait_for(lambda: _ready(d) == 200, 6, "an operator's drain to lapse (it must not)")
    status, body = http("DELETE", d.url + "/drain", headers=AUTH)
    assert status == 200 and body["outcome"] == "undrained", body
    status, body = http("GET", d.url + "/drain?owner=x&lease_s=0", headers=AUTH)
    assert status == 400 and body["error"]["param"] == "lease_s", body
    wait_for(lambda: _routed(c, P_ID, D_ID), 10, "the coordinator to route to D again")


def test_a_kubernetes_scale_in_that_fails_after_the_drain_leaves_the_node_serving(
    cluster: Cluster,
) -> None:
    """The FAILED-after-drain case of planner/kube.py on a real node: another pod is not Ready
    and the drained victim never reads not Ready (its kubelet does not probe within
    ready_wait_s), so the Deployment is not patched — and the victim is undrained, not left
    serving nothing."""
    from kubernetes import client

    from planner.kube import DELETION_COST, KubernetesActuator
    from tests.planner.fake_kube import FakeKube, FakePod
    from tests.planner.test_kube_actuator import serve

    c, d = cluster, cluster.decode

    async def go() -> None:
        pods = [
            FakePod(D_ID, "duet-decode"),
            FakePod("duet-decode-starting", "duet-decode", ready=False),
        ]
        kube = FakeKube(replicas={"duet-decode": 2}, pods=pods, kubelet_period_s=3600)
        async with serve(kube.app()) as api, aiohttp.ClientSession() as s:
            act = KubernetesActuator(
                "duet",
                Drainer(s, auth=AUTH, poll_s=0.1, deadline_s=30),
                api_client=client.ApiClient(client.Configuration(host=api)),
                ready_wait_s=0.5,
                poll_s=0.1,
            )
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
    wait_for(
        lambda: _status_in_coordinator(c, D_ID) == "active" and _routed(c, P_ID, D_ID),
        10,
        "the coordinator to route to D again",
    )


class StopAnswer(enum.StrEnum):
    """How the stand-in for `duet up` fails the stop that follows the drain."""

    #: 409 last_node (REFUSED): another node went between the dry run and the stop
    REFUSED = "refused"
    #: 503 busy: the supervisor did not retire the node within its wait
    BUSY = "busy"
    #: 500 with no ControlError body (a crash page)
    ERROR = "error"
    #: the connection closed with no answer: the endpoint's handler died (http.server does that)
    DROPPED = "dropped"
    #: duet up went away after the dry run: the stop's connection is refused
    GONE = "gone"


class DuetUpStandIn:
    """`duet up`'s control endpoint (duet/up_autoscale.py::serve_control) as the local actuator
    meets it, on its wire types (planner/local.py): the cluster secret required, the dry run
    answered yes (NodeStopped), the stop itself failed as `answer` says. When the stop comes it
    reads the victim's readiness, so the test sees the drain came first."""

    def __init__(self, answer: StopAnswer, victim_url: str) -> None:
        self.answer = answer
        self.victim_url = victim_url
        self.calls: list[str] = []
        self.ready_at_stop: int | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    @staticmethod
    def _send(status: int, body: msgspec.Struct, close: bool = False) -> web.Response:
        r = web.Response(
            status=status, body=msgspec.json.encode(body), content_type="application/json"
        )
        if close:
            r.force_close()
        return r

    async def stop(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != AUTH["Authorization"]:
            return self._send(
                401,
                ControlError(
                    message="duet up's control endpoint needs the cluster secret",
                    code="cluster_secret_required",
                ),
            )
        node_id = request.match_info["node_id"]
        if request.query.get("dry_run") == "1":
            self.calls.append("dry_run")
            gone = self.answer == StopAnswer.GONE
            if gone:  # stop listening before answering: the next connection is refused for certain
                assert self._site is not None
                await self._site.stop()
            return self._send(
                200, NodeStopped(node_id=node_id, exit_code=None, nodes=2), close=gone
            )
        self.calls.append("stop")
        async with (
            aiohttp.ClientSession() as s,
            s.get(self.victim_url + "/health", params={"probe": "ready"}) as r,
        ):
            self.ready_at_stop = r.status
        if self.answer == StopAnswer.REFUSED:
            return self._send(
                409, ControlError(message="the last node is not stopped", code="last_node")
            )
        if self.answer == StopAnswer.BUSY:
            return self._send(
                503,
                ControlError(message="the supervisor is busy (starting or stopping)", code="busy"),
            )
        if self.answer == StopAnswer.ERROR:
            return web.Response(status=500, text="500 Internal Server Error")
        assert self.answer == StopAnswer.DROPPED and request.transport is not None
        request.transport.close()
        return web.Response()  # never written: the connection is closed

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_post("/nodes/{node_id}/stop", self.stop)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        self._site = web.TCPSite(self._runner, "127.0.0.1", port)
        await self._site.start()
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *_: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


#: per failed stop: the actuator's outcome and what its detail names
STOP_FAILURES = {
    StopAnswer.REFUSED: (Outcome.REFUSED, "duet up answered 409 last_node"),
    StopAnswer.BUSY: (Outcome.FAILED, "duet up answered 503 busy"),
    StopAnswer.ERROR: (Outcome.FAILED, "duet up answered 500: b'500 Internal Server Error'"),
    StopAnswer.DROPPED: (Outcome.FAILED, "duet up's control endpoint: ServerDisconnectedError"),
    StopAnswer.GONE: (Outcome.FAILED, "duet up's control endpoint: ClientConnectorError"),
}


async def _etcd_status(c: Cluster, node_id: str) -> str | None:
    """The node's status in its etcd registration (what every coordinator replica reads)."""
    store = EtcdStore(c.etcd)
    try:
        rec = await find_node(store, "default", node_id)
    finally:
        await store.close()
    return None if rec is None else rec.info.status


@pytest.mark.parametrize("answer", list(StopAnswer))
def test_a_local_scale_in_whose_stop_fails_after_the_drain_leaves_the_node_serving(
    cluster: Cluster, answer: StopAnswer
) -> None:
    """The local actuator (`duet up --autoscale`, planner/local.py) on a real node: the dry run
    says yes, the drain finishes (D is idle), then duet up refuses or fails the stop, or cannot
    be reached — and the actuator undoes its drain: D is `active` in etcd, Ready, and routed."""
    c, d = cluster, cluster.decode
    want, said = STOP_FAILURES[answer]

    async def go() -> ActResult:
        duet_up = DuetUpStandIn(answer, d.url)
        async with duet_up as control, aiohttp.ClientSession(headers=AUTH) as s:
            # the session carries the secret, as `duet coordinator`'s plane session does
            # (planner/cli.py)
            act = LocalActuator(control, Drainer(s, poll_s=0.1, deadline_s=30), s)
            r = await act.scale_in(PoolKey("decode", c.model, "shared"), Victim(D_ID, d.url), 0)
        assert duet_up.calls == (
            ["dry_run"] if answer == StopAnswer.GONE else ["dry_run", "stop"]
        ), duet_up.calls
        if answer != StopAnswer.GONE:
            assert duet_up.ready_at_stop == 503  # drained when the stop was asked
        return r

    r = asyncio.run(go())
    assert r.outcome == want and said in r.detail, r
    assert r.drained is True and f"{D_ID} undrained: it serves again" in r.detail, r
    assert asyncio.run(_etcd_status(c, D_ID)) == NodeStatus.ACTIVE
    assert _ready(d) == 200
    wait_for(
        lambda: _status_in_coordinator(c, D_ID) == "active" and _routed(c, P_ID, D_ID),
        10,
        "the coordinator to route to D again",
    )


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
