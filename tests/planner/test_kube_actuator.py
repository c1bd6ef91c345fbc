"""The Kubernetes actuator against a local server speaking the Deployment scale subresource as
the API server does (tests/planner/fake_kube.py, built on the official client's models): the
scale patch, the drain before the replica count drops, and refused patches (409, 403).

The victim "node" here is a stand-in serving only `GET|POST|DELETE /drain` (busy for a few
polls, then idle), so the order can be checked exactly; the real node's drain is
tests/planner/test_drain_e2e.py, and a failed scale-in undoing a real node's drain
tests/planner/test_undrain_e2e.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web
from kubernetes import client

from planner.actuator import Outcome, Victim
from planner.drain import Drainer
from planner.kube import DELETION_COST, KubernetesActuator
from planner.pools import PoolKey
from runtime.ports import free_port
from tests.planner.fake_kube import FakeKube, FakePod

D = PoolKey("decode", "smollm2-135m", "shared")
P_BATCH = PoolKey("prefill", "smollm2-135m", "batch")


class DrainingNode:
    """A node's drain endpoint: busy for `busy_polls` reads after the drain was asked."""

    def __init__(self, busy_polls: int, ready_follows_drain: bool = True) -> None:
        self.busy_polls = busy_polls
        self.draining = False
        self.ready_follows_drain = ready_follows_drain
        self.log: list[str] = []

    async def health(self, request: web.Request) -> web.Response:
        """Readiness as node/app.py answers it: 503 once drained (unless told to stay Ready)."""
        drained = (
            self.draining and self.ready_follows_drain and request.query.get("probe") == "ready"
        )
        return web.json_response(
            {"status": "draining" if drained else "ok"}, status=503 if drained else 200
        )

    def _status(self) -> dict:
        idle = self.draining and self.busy_polls <= 0
        outcome = "idle" if idle else "draining" if self.draining else "active"
        return {
            "node_id": "duet-decode-7f9c",
            "role": "decode",
            "draining": self.draining,
            "inflight": 0 if idle else 1,
            "held": 0,
            "idle": idle,
            "outcome": outcome,
        }

    async def post(self, _: web.Request) -> web.Response:
        self.draining = True
        self.log.append("POST /drain")
        return web.json_response(self._status())

    async def get(self, _: web.Request) -> web.Response:
        self.busy_polls -= 1
        self.log.append("GET /drain")
        return web.json_response(self._status())

    async def delete(self, _: web.Request) -> web.Response:
        outcome = "undrained" if self.draining else "not_draining"
        self.draining = False
        self.log.append("DELETE /drain")
        return web.json_response(
            {"node_id": "duet-decode-7f9c", "role": "decode", "outcome": outcome}
        )


@asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def cluster(
    kube: FakeKube, node: DrainingNode
) -> AsyncIterator[tuple[KubernetesActuator, str]]:
    node_app = web.Application()
    node_app.router.add_post("/drain", node.post)
    node_app.router.add_get("/drain", node.get)
    node_app.router.add_delete("/drain", node.delete)
    node_app.router.add_get("/health", node.health)
    async with serve(kube.app()) as api, serve(node_app) as node_url, aiohttp.ClientSession() as s:
        kube.node_urls = {"duet-decode-7f9c": node_url}
        conf = client.Configuration(host=api)
        act = KubernetesActuator(
            "duet",
            Drainer(s, poll_s=0.05, deadline_s=10),
            api_client=client.ApiClient(conf),
            ready_wait_s=5,
            poll_s=0.05,
        )
        try:
            yield act, node_url
        finally:
            await act.close()


def test_scale_out_patches_the_scale_subresource() -> None:
    async def go() -> None:
        kube = FakeKube(replicas={"duet-decode": 1, "duet-prefill-batch": 1})
        async with cluster(kube, DrainingNode(0)) as (act, _):
            r = await act.scale_out(D, 2)
            assert (r.outcome, r.replicas) == (Outcome.DONE, 2), r
            assert kube.replicas == {"duet-decode": 2, "duet-prefill-batch": 1}
            patch = [c for c in kube.calls if c[0] == "PATCH"]
            assert patch == [
                (
                    "PATCH",
                    "deployments/duet-decode/scale",
                    {"body": {"spec": {"replicas": 2}}, "dry_run": False},
                )
            ]
            # the batch P pool is its own Deployment
            assert (await act.scale_out(P_BATCH, 2)).replicas == 2
            assert kube.replicas["duet-prefill-batch"] == 2
            # already there: nothing patched
            before = len(kube.calls)
            assert (await act.scale_out(D, 2)).outcome == Outcome.DONE
            assert [c[0] for c in kube.calls[before:]] == ["GET"]

    asyncio.run(go())


def test_scale_in_drains_the_victim_before_the_replica_count_drops() -> None:
    async def go() -> None:
        kube = FakeKube(replicas={"duet-decode": 3})
        node = DrainingNode(busy_polls=4)
        async with cluster(kube, node) as (act, url):
            r = await act.scale_in(D, Victim("duet-decode-7f9c", url), 2)
            assert (r.outcome, r.replicas, r.drained) == (Outcome.DONE, 2, True), r
            assert kube.replicas["duet-decode"] == 2
            # order: dry run, drain asked, polled until idle, victim marked, then the real patch
            kinds = [(c[1], c[2].get("dry_run")) for c in kube.calls if c[0] == "PATCH"]
            assert kinds == [
                ("deployments/duet-decode/scale", True),
                ("pods/duet-decode-7f9c", None),
                ("deployments/duet-decode/scale", False),
            ]
            assert node.log[0] == "POST /drain" and node.log.count("GET /drain") >= 4
            assert "DELETE /drain" not in node.log  # scaled in: the drain stands
            assert kube.drain_at_patch and all(s["idle"] for s in kube.drain_at_patch), (
                kube.drain_at_patch
            )
            assert kube.annotations["duet-decode-7f9c"][DELETION_COST] == "-2147483647"

    asyncio.run(go())


def test_a_refused_patch_is_reported_not_raised() -> None:
    async def go() -> None:
        kube = FakeKube(replicas={"duet-decode": 2}, refuse=409)
        node = DrainingNode(0)
        async with cluster(kube, node) as (act, url):
            r = await act.scale_out(D, 3)
            assert r.outcome == Outcome.REFUSED and "409" in r.detail and "Conflict" in r.detail, r
            assert kube.replicas["duet-decode"] == 2
            # 403 on the dry run: refused before the node is drained for nothing
            kube.refuse, kube.refuse_dry_run = 403, True
            r = await act.scale_in(D, Victim("duet-decode-7f9c", url), 1)
            assert (
                r.outcome == Outcome.REFUSED and "403" in r.detail and "cannot patch" in r.detail
            ), r
            assert node.log == [] and kube.replicas["duet-decode"] == 2
            # 409 on the real patch, after the drain: refused, and the drain undone
            kube.refuse, kube.refuse_dry_run = 409, False
            r = await act.scale_in(D, Victim("duet-decode-7f9c", url), 1)
            assert r.outcome == Outcome.REFUSED and "409" in r.detail and "undrained" in r.detail, r
            assert (
                node.log[0] == "POST /drain"
                and node.log[-1] == "DELETE /drain"
                and not node.draining
            )
            assert (
                kube.replicas["duet-decode"] == 2
                and DELETION_COST not in kube.annotations["duet-decode-7f9c"]
            )
            # a Deployment that does not exist is a failure, not a refusal
            r = await act.scale_out(PoolKey("decode", "m", "interactive"), 1)
            assert r.outcome == Outcome.FAILED and "404" in r.detail

    asyncio.run(go())


def test_scale_in_removes_only_the_drained_victim() -> None:
    """The Deployment holds a pod the planner does not count (starting, crash-looping): the
    planner asks for 1 where the Deployment has 3. One pod goes — the drained victim — not two,
    one of them undrained. The actuator patched to the planner's figure."""

    async def go() -> None:
        kube = FakeKube(replicas={"duet-decode": 3})
        async with cluster(kube, DrainingNode(0)) as (act, url):
            r = await act.scale_in(D, Victim("duet-decode-7f9c", url), 1)
            assert (r.outcome, r.replicas, r.drained) == (Outcome.DONE, 2, True), r
            assert kube.replicas["duet-decode"] == 2
            patches = [
                c[2]["body"] for c in kube.calls if c[0] == "PATCH" and c[1].endswith("/scale")
            ]
            assert patches == [{"spec": {"replicas": 2}}] * 2, (
                patches
            )  # the dry run, then the patch

    asyncio.run(go())


VICTIM = "duet-decode-7f9c"


def test_a_not_ready_pod_does_not_go_in_the_drained_victims_place() -> None:
    """The ReplicaSet removes a not-Ready pod before a Ready one, whatever their deletion costs:
    with a starting pod in the Deployment, a patch sent while the drained victim still reads
    Ready (kubelet probes every period) removes the starting pod and leaves the victim drained,
    serving nothing. The patch waits until the victim reads not Ready, then the victim goes."""

    async def go() -> None:
        pods = [
            FakePod(VICTIM, "duet-decode"),
            FakePod("duet-decode-ready", "duet-decode"),
            FakePod("duet-decode-starting", "duet-decode", ready=False),
        ]
        kube = FakeKube(replicas={"duet-decode": 3}, pods=pods)
        async with cluster(kube, DrainingNode(0)) as (act, url):
            r = await act.scale_in(D, Victim(VICTIM, url), 2)
            assert (r.outcome, r.replicas, r.drained) == (Outcome.DONE, 2, True), r
            assert kube.deleted == [VICTIM]

    asyncio.run(go())


def test_a_victim_that_stays_ready_is_not_scaled_in_past_a_not_ready_pod() -> None:
    async def go() -> None:
        pods = [
            FakePod(VICTIM, "duet-decode"),
            FakePod("duet-decode-starting", "duet-decode", ready=False),
        ]
        kube = FakeKube(replicas={"duet-decode": 2}, pods=pods)
        node = DrainingNode(0, ready_follows_drain=False)
        async with cluster(kube, node) as (act, url):
            act.ready_wait_s = 1.0
            r = await act.scale_in(D, Victim(VICTIM, url), 1)
            assert r.outcome == Outcome.FAILED and "still reads Ready" in r.detail, r
            assert kube.replicas["duet-decode"] == 2 and kube.deleted == []
            # not scaled in, so not left drained: the drain is undone (the victim serves again)
            # and it is no longer ranked first for removal
            assert node.log[-1] == "DELETE /drain" and not node.draining, node.log
            assert "undrained: it serves again" in r.detail, r
            assert DELETION_COST not in kube.annotations.get(VICTIM, {}), kube.annotations

    asyncio.run(go())


def test_a_pending_pod_is_removed_first_and_nothing_is_drained() -> None:
    """A Pending pod (unscheduled: no room on the cluster) goes before any Running pod; draining
    the victim as well would leave it drained and serving nothing."""

    async def go() -> None:
        pods = [
            FakePod(VICTIM, "duet-decode"),
            FakePod(
                "duet-decode-new", "duet-decode", phase="Pending", ready=False, scheduled=False
            ),
        ]
        kube = FakeKube(replicas={"duet-decode": 2}, pods=pods)
        node = DrainingNode(0)
        async with cluster(kube, node) as (act, url):
            r = await act.scale_in(D, Victim(VICTIM, url), 1)
            assert (r.outcome, r.replicas) == (
                Outcome.DONE,
                1,
            ) and "pending pod duet-decode-new" in r.detail, r
            assert kube.deleted == ["duet-decode-new"]
            assert "POST /drain" not in node.log, "the victim was drained for nothing"

    asyncio.run(go())


def test_a_drain_undone_while_it_runs_is_not_scaled_in() -> None:
    """An operator's `duet drain --undo` during the scale-in's drain: the node serves again, so
    the actuator must not go on to remove it when the deadline passes."""

    async def go() -> None:
        kube = FakeKube(replicas={"duet-decode": 2})
        node = DrainingNode(busy_polls=10**6)  # never idle by itself

        async def operator_undoes() -> None:
            while node.log.count("GET /drain") < 2:
                await asyncio.sleep(0.01)
            node.draining = False  # what the node's DELETE /drain leaves

        async with cluster(kube, node) as (act, url):
            undo = asyncio.create_task(operator_undoes())
            r = await act.scale_in(D, Victim(VICTIM, url), 1)
            await undo
            assert r.outcome == Outcome.REFUSED and "undone" in r.detail, r
            assert kube.replicas["duet-decode"] == 2
            assert [c for c in kube.calls if c[0] == "PATCH" and not c[2].get("dry_run")] == []

    asyncio.run(go())
