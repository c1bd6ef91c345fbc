"""The Kubernetes actuator: one Deployment per pool (P and D apart, interactive and batch apart),
resized through its `scale` subresource with the official `kubernetes` client.

- out: `PATCH .../deployments/NAME/scale` {"spec": {"replicas": to}} as a JSON merge patch;
- in: a dry-run of that patch first (so an RBAC 403 or a 409 is found before a node is drained
  for nothing), then the drain (planner/drain.py, the node's `POST /drain`; the pod's preStop
  hook calls the same endpoint when Kubernetes stops it), then the victim pod's
  `controller.kubernetes.io/pod-deletion-cost` set very low so the ReplicaSet removes *that*
  pod, then the patch.

Invariants: the replica count never drops before the victim was drained (or its drain deadline
passed: its streams then migrate when the pod's SIGTERM grace period ends them); a refused patch
is `Outcome.REFUSED` with the API server's message, never an exception. Node ids are pod names
(deploy/ sets `--node-id $(POD_NAME)`); nodes in Kubernetes run without `--exit-when-drained`
(a Deployment would restart a container that exits).

The client is synchronous (urllib3): its calls run in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from planner.actuator import ActResult, Outcome, Victim
from planner.drain import Drainer, DrainError
from planner.pools import PoolKey

log = logging.getLogger("duet.planner")
MERGE_PATCH = "application/merge-patch+json"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def default_deployment(pool: PoolKey) -> str:
    """duet-prefill, duet-decode-batch, ... (deploy/'s names); the model is not in the name: one
    model per Deployment is the convention, override per pool with `deployments`."""
    return f"duet-{pool.role}" + ("" if pool.tier == "shared" else f"-{pool.tier}")


class KubernetesActuator:
    name = "kubernetes"

    def __init__(self, namespace: str, drainer: Drainer, *, deployments: dict[str, str] | None = None,
                 api_client: Any = None) -> None:  # fmt: skip
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

    def deployment_of(self, pool: PoolKey) -> str:
        for name in (f"{pool.role}/{pool.model}/{pool.tier}", f"{pool.role}/{pool.tier}", pool.role):
            if name in self.deployments:
                return self.deployments[name]
        return default_deployment(pool)

    # -- API calls (worker thread) ---------------------------------------------------------
    async def _replicas(self, name: str) -> int:
        scale = await asyncio.to_thread(self.apps.read_namespaced_deployment_scale, name, self.namespace)
        return int(scale.spec.replicas or 0)

    async def _patch(self, name: str, to: int, dry_run: bool = False) -> int:
        scale = await asyncio.to_thread(self.apps.patch_namespaced_deployment_scale, name, self.namespace,
                                        {"spec": {"replicas": to}}, dry_run="All" if dry_run else None,
                                        _content_type=MERGE_PATCH)  # fmt: skip
        return int(scale.spec.replicas or 0)

    async def _mark_victim(self, pod: str) -> None:
        body = {"metadata": {"annotations": {DELETION_COST: "-2147483647"}}}
        await asyncio.to_thread(self.core.patch_namespaced_pod, pod, self.namespace, body, _content_type=MERGE_PATCH)

    @staticmethod
    def _refusal(e: Exception, what: str) -> ActResult:
        from kubernetes.client.exceptions import ApiException

        if isinstance(e, ApiException):
            outcome = Outcome.REFUSED if e.status in (403, 409, 422) else Outcome.FAILED
            detail = f"{what}: the API server answered {e.status} {e.reason}: {(e.body or '')[:300]}"
        else:
            outcome, detail = Outcome.FAILED, f"{what}: {type(e).__name__}: {e}"
        log.warning("kubernetes actuator: %s", detail)
        return ActResult(outcome, detail)

    # -- Actuator ----------------------------------------------------------------------------
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
            now = await self._replicas(name)
            if now <= to:
                return ActResult(Outcome.DONE, f"{name} already has {now} replicas", replicas=now)
            # One pod goes: the drained victim. The planner's `to` counts the nodes it sees; a
            # Deployment may hold pods it does not (starting, crash-looping, unregistered), and
            # patching to `to` would then remove them too, undrained, beside the victim.
            to = now - 1
            await self._patch(name, to, dry_run=True)  # refused? then before any drain
        except Exception as e:
            return self._refusal(e, f"scale {self.namespace}/{name} to {to}")
        try:
            drained = await self.drainer.drain(victim.url)
        except (DrainError, OSError, TimeoutError) as e:
            return ActResult(Outcome.FAILED, f"drain of {victim.node_id} failed, left running: {e}")
        try:
            await self._mark_victim(victim.node_id)
            got = await self._patch(name, to)
        except Exception as e:
            r = self._refusal(e, f"scale {self.namespace}/{name} to {to} after draining {victim.node_id}")
            return ActResult(r.outcome, r.detail + " (the node stays drained: no routes)", drained=drained)
        log.info("kubernetes: %s/%s scaled to %d replicas; removed %s (%s)", self.namespace, name, got,
                 victim.node_id, "drained" if drained else "drain deadline passed: its streams migrate")  # fmt: skip
        return ActResult(Outcome.DONE, f"{name} → {got}", replicas=got, drained=drained)

    async def close(self) -> None:
        await asyncio.to_thread(self.api_client.close)
