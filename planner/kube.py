"""The Kubernetes actuator: one Deployment per pool (P and D apart, interactive and batch apart),
resized through its `scale` subresource with the official `kubernetes` client.

- out: `PATCH .../deployments/NAME/scale` {"spec": {"replicas": to}} as a JSON merge patch;
- in: a dry-run of that patch first (so an RBAC 403 or a 409 is found before a node is drained
  for nothing), then the drain (planner/drain.py, the node's `POST /drain`; the pod's preStop
  hook calls the same endpoint when Kubernetes stops it), then the victim pod's
  `controller.kubernetes.io/pod-deletion-cost` set very low so the ReplicaSet removes *that*
  pod, then the patch.

The ReplicaSet ranks pods before it reads their deletion cost: unscheduled and Pending pods go
first, then not-Ready ones. So: a Deployment holding a Pending pod shrinks by that pod, with no
drain (it serves nothing; the planner asks again after its cool-down if it still wants fewer
nodes); and when another pod is Running but not Ready (starting, crash-looping), the patch waits
until the drained victim reads not Ready too (the node's readiness probe, `/health?probe=ready`,
fails from the moment it is drained), where its deletion cost puts it first.

Invariants: the replica count never drops before the victim was drained (or its drain deadline
passed: its streams then migrate when the pod's SIGTERM grace period ends them); a refused patch
is `Outcome.REFUSED` with the API server's message, never an exception. A scale-in that fails
after the drain (the victim still reads Ready past `ready_wait_s` while another pod is not
Ready, the patch refused) undoes it before it reports: the victim's `DELETE /drain` (it is
routed again, its readiness passes) and its deletion cost taken off — a drained pod left in
the Deployment would serve nothing until it went away. A drain undone by someone else while it
ran (`duet drain --undo`) is `Outcome.REFUSED`: the victim serves again and nothing is patched. Node
ids are pod names (deploy/ sets `--node-id $(POD_NAME)`); nodes in Kubernetes run without
`--exit-when-drained` (a Deployment would restart a container that exits).

The client is synchronous (urllib3): its calls run in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from planner.actuator import ActResult, Outcome, Victim
from planner.drain import DrainEnd, Drainer, DrainError
from planner.pools import PoolKey

log = logging.getLogger("duet.planner")
MERGE_PATCH = "application/merge-patch+json"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass(frozen=True)
class PodState:
    """What the ReplicaSet's ranking reads of a pod."""

    name: str
    #: not scheduled or not Running yet: the ReplicaSet removes it before any Running pod
    pending: bool
    ready: bool

    @staticmethod
    def of(pod: Any) -> PodState:  # a kubernetes.client.V1Pod
        status = pod.status
        ready = (
            any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))
            if status
            else False
        )
        running = bool(status and status.phase == "Running")
        scheduled = bool(pod.spec and pod.spec.node_name)
        return PodState(pod.metadata.name, pending=not (running and scheduled), ready=ready)


def default_deployment(pool: PoolKey) -> str:
    """duet-prefill, duet-decode-batch, ... (deploy/'s names); the model is not in the name: one
    model per Deployment is the convention, override per pool with `deployments`."""
    return f"duet-{pool.role}" + ("" if pool.tier == "shared" else f"-{pool.tier}")


class KubernetesActuator:
    name = "kubernetes"

    def __init__(
        self,
        namespace: str,
        drainer: Drainer,
        *,
        deployments: dict[str, str] | None = None,
        api_client: Any = None,
        ready_wait_s: float = 30.0,
        poll_s: float = 1.0,
    ) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.api_client = api_client
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.drainer = drainer
        self.deployments = deployments or {}
        #: how long a drained victim may take to read not Ready (readinessProbe 5 s × 3 failures)
        self.ready_wait_s = ready_wait_s
        self.poll_s = poll_s

    def deployment_of(self, pool: PoolKey) -> str:
        for name in (
            f"{pool.role}/{pool.model}/{pool.tier}",
            f"{pool.role}/{pool.tier}",
            pool.role,
        ):
            if name in self.deployments:
                return self.deployments[name]
        return default_deployment(pool)

    # -- API calls (worker thread) ---------------------------------------------------------
    async def _replicas(self, name: str) -> int:
        return (await self._scale(name))[0]

    async def _scale(self, name: str) -> tuple[int, str]:
        """The Deployment's replica count and its pods' label selector (the Scale's status)."""
        scale = await asyncio.to_thread(
            self.apps.read_namespaced_deployment_scale, name, self.namespace
        )
        return int((scale.spec and scale.spec.replicas) or 0), str(
            (scale.status and scale.status.selector) or ""
        )

    async def _pods(self, selector: str) -> list[PodState]:
        """The Deployment's pods not already being deleted (none when the selector is unknown)."""
        if not selector:
            return []
        pods = await asyncio.to_thread(
            self.core.list_namespaced_pod, self.namespace, label_selector=selector
        )
        return [
            PodState.of(p) for p in pods.items if not (p.metadata and p.metadata.deletion_timestamp)
        ]

    async def _not_ready(self, pod: str) -> bool:
        """Wait until `pod` reads not Ready (its readiness probe saw the drain); False on
        timeout."""
        deadline = time.monotonic() + self.ready_wait_s
        while True:
            state = PodState.of(
                await asyncio.to_thread(self.core.read_namespaced_pod, pod, self.namespace)
            )
            if not state.ready:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(self.poll_s)  # kubelet probes every few seconds; nothing to wait on

    async def _patch(self, name: str, to: int, dry_run: bool = False) -> int:
        scale = await asyncio.to_thread(
            self.apps.patch_namespaced_deployment_scale,
            name,
            self.namespace,
            {"spec": {"replicas": to}},
            dry_run="All" if dry_run else None,
            _content_type=MERGE_PATCH,
        )
        return int((scale.spec and scale.spec.replicas) or 0)

    async def _mark_victim(self, pod: str, mark: bool = True) -> None:
        """Put the victim first in the ReplicaSet's ranking (`mark`), or take that off (a merge
        patch's null deletes the annotation)."""
        body = {"metadata": {"annotations": {DELETION_COST: "-2147483647" if mark else None}}}
        await asyncio.to_thread(
            self.core.patch_namespaced_pod, pod, self.namespace, body, _content_type=MERGE_PATCH
        )

    async def _undo(self, victim: Victim, marked: bool) -> str:
        """The scale-in failed after the drain: the victim serves again (and is no longer ranked
        first for removal). What happened, for the detail."""
        said = await self.drainer.undo_after_failure(victim.url, victim.node_id)
        if marked:
            try:
                await self._mark_victim(victim.node_id, mark=False)
            except Exception as e:
                said += f"; its {DELETION_COST} stays ({type(e).__name__}: {e})"
        return said

    @staticmethod
    def _refusal(e: Exception, what: str) -> ActResult:
        from kubernetes.client.exceptions import ApiException

        if isinstance(e, ApiException):
            outcome = Outcome.REFUSED if e.status in (403, 409, 422) else Outcome.FAILED
            detail = (
                f"{what}: the API server answered {e.status} {e.reason}: {(e.body or '')[:300]}"
            )
        else:
            outcome, detail = Outcome.FAILED, f"{what}: {type(e).__name__}: {e}"
        log.warning("kubernetes actuator: %s", detail)
        return ActResult(outcome, detail)

    # -- Actuator ----------------------------------------------------------------------------
    async def ready(self) -> str | None:
        return None  # nothing of its own to wait for

    async def scale_out(self, pool: PoolKey, to: int) -> ActResult:
        name = self.deployment_of(pool)
        try:
            now = await self._replicas(name)
            if now >= to:
                return ActResult(Outcome.DONE, f"{name} already has {now} replicas", replicas=now)
            got = await self._patch(name, to)
        except Exception as e:
            return self._refusal(e, f"scale {self.namespace}/{name} to {to}")
        log.info("kubernetes: %s/%s scaled to %d replicas", self.namespace, name, got)
        return ActResult(Outcome.DONE, f"{name} → {got}", replicas=got)

    async def scale_in(self, pool: PoolKey, victim: Victim, to: int) -> ActResult:
        name = self.deployment_of(pool)
        try:
            now, selector = await self._scale(name)
            if now <= to:
                return ActResult(Outcome.DONE, f"{name} already has {now} replicas", replicas=now)
            # One pod goes: the drained victim. The planner's `to` counts the nodes it sees; a
            # Deployment may hold pods it does not (starting, crash-looping, unregistered), and
            # patching to `to` would then remove them too, undrained, beside the victim.
            to = now - 1
            await self._patch(name, to, dry_run=True)  # refused? then before any drain
            others = [p for p in await self._pods(selector) if p.name != victim.node_id]
            pending = [p.name for p in others if p.pending]
            if pending:  # the ReplicaSet removes that one whatever the victim's deletion cost
                got = await self._patch(name, to)
                log.info(
                    "kubernetes: %s/%s scaled to %d replicas by a pending pod (%s); "
                    "nothing drained",
                    self.namespace,
                    name,
                    got,
                    pending[0],
                )
                return ActResult(
                    Outcome.DONE,
                    f"{name} → {got}: the ReplicaSet removes pending pod {pending[0]} "
                    "first (it serves nothing); no node drained",
                    replicas=got,
                )
        except Exception as e:
            return self._refusal(e, f"scale {self.namespace}/{name} to {to}")
        try:
            end = await self.drainer.drain(victim.url)
        except (
            DrainError,
            OSError,
            TimeoutError,
        ) as e:  # a drain asked, then its poll failed: undo it
            undone = await self._undo(victim, marked=False)
            return ActResult(
                Outcome.FAILED, f"drain of {victim.node_id} failed, left running: {e}; {undone}"
            )
        if end == DrainEnd.CANCELLED:
            return ActResult(
                Outcome.REFUSED,
                f"the drain of {victim.node_id} was undone while it ran "
                "(duet drain --undo): it serves again; not scaled in",
            )
        drained, marked = end.drained, False
        try:
            await self._mark_victim(victim.node_id)
            marked = True
            unready = [p.name for p in others if not p.ready]
            if unready and not await self._not_ready(victim.node_id):
                undone = await self._undo(victim, marked)
                detail = (
                    f"{victim.node_id} still reads Ready {self.ready_wait_s:g}s after its drain, "
                    f"and the ReplicaSet would remove not-ready {unready[0]} before it: not scaled "
                    f"in; {undone}"
                )
                log.warning("kubernetes actuator: %s", detail)
                return ActResult(Outcome.FAILED, detail, drained=drained)
            got = await self._patch(name, to)
        except Exception as e:
            r = self._refusal(
                e, f"scale {self.namespace}/{name} to {to} after draining {victim.node_id}"
            )
            return ActResult(
                r.outcome, f"{r.detail}; {await self._undo(victim, marked)}", drained=drained
            )
        log.info(
            "kubernetes: %s/%s scaled to %d replicas; removed %s (%s)",
            self.namespace,
            name,
            got,
            victim.node_id,
            "drained" if drained else "drain deadline passed: its streams migrate",
        )
        return ActResult(Outcome.DONE, f"{name} → {got}", replicas=got, drained=drained)

    async def close(self) -> None:
        await asyncio.to_thread(self.api_client.close)
