"""Drain-safe removal of a node, shared by the local and Kubernetes actuators.

1. `POST {node}/drain`: the node marks itself draining in etcd, so every coordinator replica
   stops routing to it (the etcd key is rewritten by the node itself; no race with its own
   re-registration);
2. poll `GET {node}/drain` until it is idle: no request in flight (a P's prefills, a D's
   streams) and no KV held for a decode node (each hold ends when D pulled it or its lease —
   30 s by default — ran out); a node that stops answering after it said draining has exited
   on its own (`--exit-when-drained`) and counts as drained;
3. past `deadline_s` the caller stops it anyway: the node's SIGTERM grace period ends its
   remaining streams with an error event and the gateway migrates them to another decode node
   (gateway/backends/cluster/backend.py::_migrate), so the client's stream goes on.

How it ended is a `DrainEnd`. CANCELLED: someone undid the drain meanwhile (`duet drain --undo`,
the node's `DELETE /drain`): the node serves again and the caller must not stop it.
`undrain(url)` is what an actuator calls when its scale-in fails after the drain (the platform
refused the removal): the node goes back into routing instead of staying drained, serving
nothing, until someone removes it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Mapping

import aiohttp
import msgspec

from protocol.drain import DrainStatus, UndrainStatus

log = logging.getLogger("duet.planner")
_decode = msgspec.json.Decoder(DrainStatus)
_decode_undrain = msgspec.json.Decoder(UndrainStatus)


class DrainError(Exception):
    pass


class DrainEnd(enum.StrEnum):
    """How `Drainer.drain` ended."""

    #: idle: nothing in flight nor held — stop it
    IDLE = "idle"
    #: it stopped answering after it said draining: it exited on its own (--exit-when-drained)
    EXITED = "exited"
    #: the deadline passed with work left: stop it anyway (its streams migrate)
    DEADLINE = "deadline"
    #: the drain was undone meanwhile: the node serves again — do not stop it
    CANCELLED = "cancelled"

    @property
    def drained(self) -> bool:
        return self in (DrainEnd.IDLE, DrainEnd.EXITED)


class Drainer:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        auth: Mapping[str, str] | None = None,
        poll_s: float = 0.5,
        deadline_s: float = 120.0,
        owner: str = "",
        lease_s: float = 60.0,
    ) -> None:
        """`owner`: the drains are this planner's (node/drain.py): each lapses, and its node
        undoes it, once `lease_s` passes without this drainer's poll — the owner died, was cut
        off, or stopped acting — so no scale-in leaves a node draining forever."""
        self.session = session
        self.owner, self.lease_s = owner, lease_s
        #: the cluster secret's header (runtime/cluster_secret.py): a node's /drain requires it
        self.headers = dict(auth or {})
        self.poll_s = poll_s
        self.deadline_s = deadline_s

    async def _call(self, method: str, url: str) -> bytes:
        params = {"owner": self.owner, "lease_s": f"{self.lease_s:g}"} if self.owner else None
        async with self.session.request(
            method,
            url + "/drain",
            headers=self.headers,
            params=params if method != "DELETE" else None,
            timeout=aiohttp.ClientTimeout(total=10),
        ) as r:
            body = await r.read()
            if r.status != 200:
                raise DrainError(f"{method} {url}/drain answered {r.status}: {body[:200]!r}")
            return body

    async def drain(self, url: str) -> DrainEnd:
        """Ask `url` to drain and wait until it is idle, it exited, the drain was undone, or the
        deadline passed."""
        t0 = time.monotonic()
        status = _decode.decode(await self._call("POST", url))
        log.info(
            "draining %s (%s): %d in flight, %d KV holds",
            status.node_id,
            status.role,
            status.inflight,
            status.held,
        )
        while not status.idle:
            if time.monotonic() - t0 > self.deadline_s:
                log.warning(
                    "%s not drained after %.0f s (%d in flight, %d holds): stopping it; its "
                    "streams migrate",
                    status.node_id,
                    self.deadline_s,
                    status.inflight,
                    status.held,
                )
                return DrainEnd.DEADLINE
            await asyncio.sleep(self.poll_s)
            try:
                status = _decode.decode(await self._call("GET", url))
            except (aiohttp.ClientConnectionError, TimeoutError):
                log.info("%s stopped answering while draining: it exited on its own", url)
                return DrainEnd.EXITED
            if not status.draining:
                log.warning(
                    "%s: its drain was undone while the planner waited: it serves again, not "
                    "stopped",
                    status.node_id,
                )
                return DrainEnd.CANCELLED
        log.info("%s drained in %.1f s", status.node_id, time.monotonic() - t0)
        return DrainEnd.IDLE

    async def undrain(self, url: str) -> UndrainStatus:
        """Undo `url`'s drain (`DELETE /drain`): it is routed again. Raises DrainError when the
        node refuses (409: it is stopping) or fails, aiohttp.ClientError when it cannot be
        reached."""
        status = _decode_undrain.decode(await self._call("DELETE", url))
        log.info("%s: drain undone (%s)", status.node_id, status.outcome)
        return status

    async def undo_after_failure(self, url: str, node_id: str) -> str:
        """A scale-in failed after its drain: undo it so the pool keeps the node's capacity.
        Never raises; returns what happened, for the actuator's detail."""
        try:
            await self.undrain(url)
        except (DrainError, aiohttp.ClientError, OSError, TimeoutError, msgspec.DecodeError) as e:
            log.warning(
                "%s: its drain could not be undone after the failed scale-in: %s", node_id, e
            )
            return f"{node_id}'s drain could not be undone ({e}): it stays drained, no routes"
        return f"{node_id} undrained: it serves again"
