"""A local HTTP server that speaks the part of the Kubernetes API the planner's actuator uses, as
the API server does: `GET`/`PATCH /apis/apps/v1/namespaces/NS/deployments/NAME/scale` (an
autoscaling/v1 Scale; PATCH takes `application/merge-patch+json`, `?dryRun=All` changes
nothing), `PATCH /api/v1/namespaces/NS/pods/NAME` (a metadata merge patch: a null annotation
is deleted, as RFC 7386 says), and `GET` of the pods
(a list by label selector, one by name) with their phase and Ready condition. Bodies are built
and read with the official client's models (V1Scale, V1Pod), so a field the real API would not
accept fails here too. Refusals answer a v1 Status as the API server does (403 Forbidden, 409
Conflict).

Pods (`pods`, optional): when a scale PATCH lowers the count, the fake deletes pods as the
ReplicaSet controller ranks them (kubernetes' controller.ActivePodsWithRanks, the part that
matters here): unscheduled before scheduled, Pending before Running, not Ready before Ready,
then the lower `pod-deletion-cost`. A pod with a node URL gets its Ready condition as kubelet
sets it: probed (`GET /health?probe=ready` → 200) every `kubelet_period_s`, so it lags its node.

Every call is recorded with, for a real scale PATCH, what the victim node's `GET /drain`
said at that instant (`drain_at_patch`), so a test can check the order drain → scale-down.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from kubernetes.client import (
    ApiClient,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodSpec,
    V1PodStatus,
    V1Scale,
    V1ScaleSpec,
    V1ScaleStatus,
)

MERGE_PATCH = "application/merge-patch+json"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass
class FakePod:
    name: str
    deployment: str
    phase: str = "Running"  # Pending | Running
    #: the Ready condition of a pod without a node URL (one with a URL is probed)
    ready: bool = True
    scheduled: bool = True


@dataclass
class FakeKube:
    namespace: str = "duet"
    replicas: dict[str, int] = field(default_factory=dict)
    annotations: dict[str, dict[str, str]] = field(default_factory=dict)
    calls: list[tuple[str, str, dict]] = field(default_factory=list)
    #: answer every real (not dry-run) scale PATCH with this status (403, 409); None: accept
    refuse: int | None = None
    refuse_dry_run: bool = False
    #: node URL per pod, to read its drain state when the replica count drops
    node_urls: dict[str, str] = field(default_factory=dict)
    drain_at_patch: list[dict] = field(default_factory=list)
    pods: list[FakePod] = field(default_factory=list)
    #: pods the scale-downs removed, in order
    deleted: list[str] = field(default_factory=list)
    kubelet_period_s: float = 0.5

    async def _ready(self, pod: FakePod) -> bool:
        return pod.ready and pod.phase == "Running"

    async def _kubelet(self, _: web.Application):  # an aiohttp cleanup context
        async def probe_loop() -> None:
            async with aiohttp.ClientSession() as s:
                while True:
                    await asyncio.sleep(self.kubelet_period_s)  # kubelet's probe period
                    for pod in list(self.pods):
                        url = self.node_urls.get(pod.name)
                        if url is not None:
                            async with s.get(url + "/health", params={"probe": "ready"}) as r:
                                pod.ready = r.status == 200

        task = asyncio.create_task(probe_loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _v1pod(self, pod: FakePod) -> V1Pod:
        ready = await self._ready(pod)
        return V1Pod(
            api_version="v1",
            kind="Pod",
            metadata=V1ObjectMeta(
                name=pod.name,
                namespace=self.namespace,
                labels={"app": pod.deployment},
                annotations=self.annotations.get(pod.name),
            ),
            spec=V1PodSpec(containers=[], node_name="node-a" if pod.scheduled else None),
            status=V1PodStatus(
                phase=pod.phase, conditions=[V1PodCondition(type="Ready", status=str(ready))]
            ),
        )

    async def _remove(self, name: str, n: int) -> None:
        """Delete `n` pods of Deployment `name` as the ReplicaSet controller ranks them."""
        ranked = []
        for pod in [p for p in self.pods if p.deployment == name]:
            cost = int(self.annotations.get(pod.name, {}).get(DELETION_COST, "0"))
            ranked.append(
                ((pod.scheduled, pod.phase == "Running", await self._ready(pod), cost), pod)
            )
        for _, pod in sorted(ranked, key=lambda r: r[0])[:n]:
            self.pods.remove(pod)
            self.deleted.append(pod.name)

    async def list_pods(self, request: web.Request) -> web.Response:
        selector = request.query.get("labelSelector", "")
        self.calls.append(("GET", "pods", {"labelSelector": selector}))
        want = dict(kv.split("=", 1) for kv in selector.split(",") if kv)
        pods = [
            await self._v1pod(p) for p in self.pods if want.items() <= {"app": p.deployment}.items()
        ]
        return web.json_response(
            ApiClient().sanitize_for_serialization(
                V1PodList(api_version="v1", kind="PodList", items=pods)
            )
        )

    async def get_pod(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.calls.append(("GET", f"pods/{name}", {}))
        pod = next((p for p in self.pods if p.name == name), None)
        if pod is None:
            return self._status(404, "NotFound", f'pods "{name}" not found')
        return web.json_response(ApiClient().sanitize_for_serialization(await self._v1pod(pod)))

    def _scale(self, name: str) -> dict:
        n = self.replicas[name]
        s = V1Scale(
            api_version="autoscaling/v1",
            kind="Scale",
            metadata=V1ObjectMeta(
                name=name, namespace=self.namespace, resource_version=str(len(self.calls))
            ),
            spec=V1ScaleSpec(replicas=n),
            status=V1ScaleStatus(replicas=n, selector=f"app={name}"),
        )
        return ApiClient().sanitize_for_serialization(s)

    @staticmethod
    def _status(code: int, reason: str, message: str) -> web.Response:
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        }
        return web.json_response(body, status=code)

    async def get_scale(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        self.calls.append(("GET", f"deployments/{name}/scale", {}))
        if ns != self.namespace or name not in self.replicas:
            return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
        return web.json_response(self._scale(name))

    async def patch_scale(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        if request.content_type != MERGE_PATCH:
            return self._status(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - "
                f"accepted media types include: {MERGE_PATCH}",
            )
        body = await request.json()
        dry = request.query.get("dryRun") == "All"
        self.calls.append(("PATCH", f"deployments/{name}/scale", {"body": body, "dry_run": dry}))
        if ns != self.namespace or name not in self.replicas:
            return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
        merged = V1Scale.from_dict(
            {**self._scale(name), "spec": {**self._scale(name)["spec"], **body.get("spec", {})}}
        )
        assert merged is not None and merged.spec is not None
        if self.refuse is not None and (not dry or self.refuse_dry_run):
            if self.refuse == 403:
                return self._status(
                    403,
                    "Forbidden",
                    f'deployments.apps "{name}" is forbidden: User '
                    '"system:serviceaccount:duet:planner" cannot patch resource '
                    '"deployments/scale" in API group "apps"',
                )
            return self._status(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on deployments.apps "{name}": '
                "the object has been modified; please apply your changes to "
                "the latest version and try again",
            )
        if not dry:
            if merged.spec.replicas is not None and merged.spec.replicas < self.replicas[name]:
                async with aiohttp.ClientSession() as s:
                    for pod, url in self.node_urls.items():
                        async with s.get(url + "/drain") as r:
                            self.drain_at_patch.append({"pod": pod, **(await r.json())})
                await self._remove(name, self.replicas[name] - int(merged.spec.replicas or 0))
            self.replicas[name] = int(merged.spec.replicas or 0)
        return web.json_response(
            self._scale(name) if not dry else {**self._scale(name), "spec": merged.spec.to_dict()}
        )

    async def patch_pod(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if request.content_type != MERGE_PATCH:
            return self._status(415, "UnsupportedMediaType", "use a merge patch")
        body = await request.json()
        self.calls.append(("PATCH", f"pods/{name}", {"body": body}))
        ann = self.annotations.setdefault(name, {})
        for key, value in body.get("metadata", {}).get("annotations", {}).items():
            if value is None:
                ann.pop(key, None)
            else:
                ann[key] = value
        pod = V1Pod(
            api_version="v1",
            kind="Pod",
            metadata=V1ObjectMeta(name=name, namespace=self.namespace, annotations=ann),
        )
        return web.json_response(ApiClient().sanitize_for_serialization(pod))

    def app(self) -> web.Application:
        app = web.Application()
        app.cleanup_ctx.append(self._kubelet)
        base = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
        app.router.add_get(base, self.get_scale)
        app.router.add_patch(base, self.patch_scale)
        app.router.add_patch("/api/v1/namespaces/{ns}/pods/{name}", self.patch_pod)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self.list_pods)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", self.get_pod)
        return app
