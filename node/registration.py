"""The node's membership in the cluster: its NodeInfo in etcd, kept alive, and drain.

With `--etcd URL` the node writes `NodeInfo` under `/duet/<cluster>/nodes/<role>/<node_id>`
bound to a lease of `NODE_TTL_S` seconds, refreshed every TTL/3 by coordinator/lease.py's loop
(the one a coordinator replica's election runs on too). If the lease is lost (etcd
restarted empty, a long partition) or the key disappears, it registers again by itself; while
etcd is unreachable it keeps serving what it has, logs that once per outage and exports
`duet:etcd_registered 0`.

Drain: `duet drain` (or the coordinator) rewrites the key with `status: draining`; the node
watches its own key, keeps that status across re-registrations, and with `--exit-when-drained`
waits until no request is in flight and no KV is held for a decode node, deletes its key and
exits 0 through the same path as SIGTERM. On SIGTERM the node marks itself draining at once
(so coordinators stop routing to it during the grace period) and deletes its key on exit.

Undrain (`DELETE /drain`, node/drain.py): `undrain` writes `status: active` first and only then
ends the drain on the node, so a failed write leaves the node drained as etcd says. Every drain
event written before that write (our own `draining`, a `duet drain`) is superseded by it: the
watcher skips events at or below the revision of our last write, so a late-delivered one cannot
drain the node again. Writes (publish, undrain) hold one lock, so they land in the order taken.
A node that is stopping — SIGTERM's grace period, or drained and exiting — is never undrained.

`DUET_NODE_TTL_S` overrides the lease TTL (seconds) for experiments; operators keep 10.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import Gauge

from coordinator.lease import LeaseHolder, Watcher
from coordinator.store import Store, StoreError
from protocol.cluster import NODE_TTL_S, NodeInfo, NodeStatus, NodeTask, node_key

log = logging.getLogger("duet.node")
#: how often a status change (drain, shutdown) is published and a drained node checked
_WATCH_TICK_S = 0.25


@dataclass(frozen=True)
class DrainHooks:
    """What registration asks the node about draining."""

    #: a request in flight, or KV held for a decode node
    is_busy: Callable[[], bool]
    #: SIGTERM's grace period has begun
    shutting_down: Callable[[], bool]
    #: `--exit-when-drained`: exit once a drain finds the node idle
    exit_when_drained: bool = False
    #: a drain asked on the node itself (`POST /drain`, node/drain.py)
    requested: Callable[[], bool] = lambda: False
    #: told when a drain starts, whoever asked (so `GET /drain` says draining)
    on_drain: Callable[[], None] = lambda: None
    #: told once `status: draining` is written in etcd (routers stop from then on)
    on_published: Callable[[], None] = lambda: None
    #: told when a drain is undone, once `status: active` is written in etcd
    on_undrain: Callable[[], None] = lambda: None
    #: the owner of the drain (NodeInfo.drain_owner)
    owner: Callable[[], str] = lambda: ""
    #: the owner of a drain it stopped renewing (node/drain.py::lapsed_owner): undo it
    lapsed: Callable[[], str | None] = lambda: None


class Registration(LeaseHolder):
    def __init__(
        self,
        store: Store,
        info: NodeInfo,
        cluster: str,
        ttl: int,
        drain: DrainHooks,
        registry: Any = None,
    ) -> None:
        self.key = node_key(cluster, info.role, info.node_id)
        super().__init__(store, ttl, self.key, tick_s=_WATCH_TICK_S)
        self.info = info
        self.is_busy = drain.is_busy
        self.shutting_down = drain.shutting_down
        self.exit_when_drained = drain.exit_when_drained
        self.drain_asked = drain.requested
        self.drain_started = drain.on_drain
        self.drain_published = drain.on_published
        self.drain_undone = drain.on_undrain
        self.drain_owner = drain.owner
        self.drain_lapsed = drain.lapsed
        self.registered = False
        self.drain_requested = False
        #: drained with --exit-when-drained: the SIGTERM is sent, nothing may undrain it
        self.exiting = False
        #: the etcd revision of our last write: watch events at or below it are superseded
        self._own_rev = 0
        self._write_lock = asyncio.Lock()
        self._published = NodeStatus.ACTIVE
        self._outage_since: float | None = None
        self._encoder = msgspec.json.Encoder()
        self._g_registered = Gauge(
            "duet:etcd_registered",
            "1 while this node's etcd registration is alive",
            registry=registry,
        )
        self._g_draining = Gauge(
            "duet:node_draining", "1 once this node was asked to drain", registry=registry
        )

    @property
    def status(self) -> NodeStatus:
        return (
            NodeStatus.DRAINING
            if self.drain_requested or self.shutting_down()
            else NodeStatus.ACTIVE
        )

    def _set_registered(self, ok: bool) -> None:
        self.registered = ok
        self._g_registered.set(1 if ok else 0)

    async def _publish(self) -> None:
        async with self._write_lock:
            await self._write(self.status)

    async def _write(self, status: NodeStatus) -> None:
        self._published = status
        owner = self.drain_owner() if status == NodeStatus.DRAINING else ""
        info = msgspec.structs.replace(self.info, status=status, drain_owner=owner)
        self._own_rev = max(
            self._own_rev, await self.store.put(self.key, self._encoder.encode(info), self.lease)
        )
        if status == NodeStatus.DRAINING:
            self.drain_published()

    async def undrain(self) -> bool:
        """Undo a drain: `status: active` in etcd, then `on_undrain`. False, and the drain stays,
        when the node is stopping; raises StoreError when etcd cannot take the write (the drain
        stays: etcd still says draining, and a re-registration would keep it)."""
        async with self._write_lock:
            if self.exiting or self.shutting_down():
                return False
            if not self.registered or not self.lease:
                raise StoreError(
                    f"{self.key} is not registered in etcd right now (etcd unreachable?)"
                )
            await self._write(NodeStatus.ACTIVE)
            if (
                self.exiting or self.shutting_down()
            ):  # stopped while we wrote: tick republishes draining
                return False
            self.drain_requested = False
            self._g_draining.set(0)
            self.drain_undone()
        log.info("drain undone: routed again (%s written at revision %d)", self.key, self._own_rev)
        return True

    def _on_drain(self, why: str) -> None:
        if not self.drain_requested:
            self.drain_requested = True
            self.drain_started()
            self._g_draining.set(1)
            log.info(
                "drain requested (%s): no new routes; finishing in-flight work%s",
                why,
                ", then exiting" if self.exit_when_drained else "",
            )

    def _drained(self) -> bool:
        return self.drain_requested and self.exit_when_drained and not self.is_busy()

    # -- one registration (a LeaseHolder session) ------------------------------------------
    async def attach(self) -> list[Watcher]:
        """Write our key under the fresh lease; watch it from the revision written."""
        old = await self.store.get(self.key)
        if old is not None:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                prev = msgspec.json.decode(old.value, type=NodeInfo)
                # A drain of this very process survives re-registration; a dead predecessor's not.
                if prev.engine_id == self.info.engine_id and prev.status == NodeStatus.DRAINING:
                    self._on_drain("kept across re-registration")
        await self._publish()
        kv = await self.store.get(self.key)
        return [self._watch_own_key((kv.mod_revision if kv else 0) + 1)]

    def on_up(self) -> None:
        self._set_registered(True)
        if self._outage_since is not None:
            log.info(
                "etcd reachable again after %.1fs; registered as %s",
                time.monotonic() - self._outage_since,
                self.key,
            )
        else:
            log.info(
                "registered in etcd as %s (lease TTL %ds, pool %s)",
                self.key,
                self.ttl,
                self.info.pool,
            )
        self._outage_since = None

    def on_down(self, error: Exception) -> None:
        self._set_registered(False)
        if self._outage_since is None and isinstance(error, StoreError):
            self._outage_since = time.monotonic()
            log.warning(
                "etcd unreachable (%s): still serving in-flight and direct requests; "
                "retrying registration",
                error,
            )

    def finished(self) -> bool:
        return self._drained()

    async def _watch_own_key(self, revision: int) -> None:
        async for ev in self.store.watch_prefix(self.key, revision):
            if ev.key != self.key:  # a prefix watch also sees keys that merely start with ours
                continue
            if ev.kind == "delete":
                log.warning(
                    "registration %s was deleted (lease expired?); registering again", self.key
                )
                return
            if ev.mod_revision and ev.mod_revision <= self._own_rev:
                continue  # superseded by our own later write (an undrain must not be drained again)
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                info = msgspec.json.decode(ev.value, type=NodeInfo)
                ours = info.engine_id == self.info.engine_id
                if info.status == NodeStatus.DRAINING and ours and not self.shutting_down():
                    self._on_drain("status set to draining in etcd")

    async def tick(self) -> bool:
        if self.drain_asked() and not self.drain_requested:
            self._on_drain("POST /drain")
        if self.drain_requested and (owner := self.drain_lapsed()) is not None:
            log.warning(
                "the drain %s asked lapsed: it stopped renewing it (gone, cut off, or no longer "
                "leading); undoing it: routed again",
                owner,
            )
            with contextlib.suppress(StoreError):  # etcd unreachable: the next tick tries again
                await self.undrain()
        if self.status != self._published:  # drain or shutdown: tell the routers now
            await self._publish()
        if self._drained():
            log.info("drained: deregistering and exiting")
            self.exiting = True
            # The signal first: deregistering deletes our key, which ends the watcher task,
            # which cancels this one — a kill sent after the await could be lost, leaving a
            # drained node running (seen in test_drain under load).
            os.kill(os.getpid(), signal.SIGTERM)  # the operator's graceful-stop path
            await self.deregister()
            return True
        return False

    async def deregister(self) -> None:
        """Delete our key now (revoking the lease), so no router waits for the TTL."""
        self._set_registered(False)
        await self.release()


def node_info(state: Any, pool: str) -> NodeInfo:
    cfg = state.config
    eng = state.engine
    stats = eng.stats()
    return NodeInfo(
        node_id=state.node_id,
        role=cfg.role,
        url=f"{cfg.security.own_scheme}://{cfg.public_host}:{cfg.port}",
        model=eng.model_name,
        engine_id=state.engine_id,
        engine_kind=cfg.engine_kind,
        block_size=eng.kv_layout.block_size,
        kv_layout_hash=eng.kv_layout.compat_hash,
        kv_capacity_blocks=int(stats.get("kv_blocks_total", eng.kv_layout.num_blocks)),
        max_model_len=eng.max_model_len,
        pool=pool,
        started_at=state.started_at,
        quantization=eng.kv_layout.weights or None,
        task=NodeTask(cfg.task),
        max_loras=int(getattr(eng, "max_loras", 0) or 0),
    )


def registration_ctx(state: Any) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context that registers the node in etcd while the app runs (append it after
    the one that starts the engine). Reads `state.config.etcd/cluster/pool/exit_when_drained`."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        from coordinator.etcd_store import EtcdStore
        from node.drain import end_drain, lapsed_owner

        cfg = state.config
        store = EtcdStore(cfg.etcd)
        ttl = int(os.environ.get("DUET_NODE_TTL_S", NODE_TTL_S))

        def busy() -> bool:
            return state.inflight > 0 or state.engine.stats().get("num_requests_held", 0) > 0

        def started() -> None:
            state.drain_requested = True

        def published() -> None:
            if state.drain_published_at is None:
                state.drain_published_at = time.monotonic()

        drain = DrainHooks(
            is_busy=busy,
            shutting_down=lambda: state.draining or state.shutdown.is_set(),
            exit_when_drained=cfg.exit_when_drained,
            requested=lambda: state.drain_requested,
            on_drain=started,
            on_published=published,
            on_undrain=lambda: end_drain(state),
            owner=lambda: state.drain_owner,
            lapsed=lambda: lapsed_owner(state),
        )
        state.drain_via_etcd = True
        reg = Registration(
            store,
            node_info(state, cfg.pool),
            cfg.cluster,
            ttl,
            drain,
            registry=state.metrics.registry,
        )
        state.undrain_registered = reg.undrain
        task = asyncio.create_task(reg.run(), name="etcd-registration")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await reg.deregister()
        await store.close()

    return ctx
