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
   (gateway/cluster.py::_migrate), so the client's stream goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import aiohttp
import msgspec

from protocol.drain import DrainStatus

log = logging.getLogger("duet.planner")
_decode = msgspec.json.Decoder(DrainStatus)


class DrainError(Exception):
    pass


class Drainer:
    def __init__(self, session: aiohttp.ClientSession, *, auth: Mapping[str, str] | None = None, poll_s: float = 0.5,
                 deadline_s: float = 120.0) -> None:  # fmt: skip
        self.session = session
        #: the cluster secret's header (protocol/cluster_secret.py): a node's /drain requires it
        self.headers = dict(auth or {})
        self.poll_s = poll_s
        self.deadline_s = deadline_s

    async def _call(self, method: str, url: str) -> DrainStatus:
        async with self.session.request(method, url + "/drain", headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=10)) as r:  # fmt: skip
            body = await r.read()
            if r.status != 200:
                raise DrainError(f"{method} {url}/drain answered {r.status}: {body[:200]!r}")
            return _decode.decode(body)

    async def drain(self, url: str) -> bool:
        """Ask `url` to drain and wait until it is idle (True) or the deadline passed (False)."""
        t0 = time.monotonic()
        status = await self._call("POST", url)
        log.info("draining %s (%s): %d in flight, %d KV holds", status.node_id, status.role, status.inflight, status.held)
        while not status.idle:
            if time.monotonic() - t0 > self.deadline_s:
                log.warning("%s not drained after %.0f s (%d in flight, %d holds): stopping it; its streams migrate",
                            status.node_id, self.deadline_s, status.inflight, status.held)  # fmt: skip
                return False
            await asyncio.sleep(self.poll_s)
            try:
                status = await self._call("GET", url)
            except (aiohttp.ClientConnectionError, TimeoutError):
                log.info("%s stopped answering while draining: it exited on its own", url)
                return True
        log.info("%s drained in %.1f s", status.node_id, time.monotonic() - t0)
        return True
