"""Leases on held prefill blocks: a finished prefill's KV stays pinned until a decode node
pulls it and calls /kv/release, or until the lease runs out (DESIGN §1: default 30 s).

Invariant: each held request is released exactly once — by release() or by its timer,
whichever comes first; the other finds nothing to do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("duet.prefill.leases")


class LeaseManager:
    def __init__(self, release: Callable[[str], Awaitable[bool]]) -> None:
        self._release = release
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._releasing: set[asyncio.Future[bool]] = set()  # strong refs until done
        self.expired = 0

    def hold(self, request_id: str, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self._timers[request_id] = loop.call_later(seconds, self._expire, request_id)

    def _expire(self, request_id: str) -> None:
        if self._timers.pop(request_id, None) is not None:
            self.expired += 1
            log.info("lease of %s expired: freeing its blocks", request_id)
            task = asyncio.ensure_future(self._release(request_id))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def release(self, request_id: str) -> bool:
        """Release now; False if there was no live lease."""
        timer = self._timers.pop(request_id, None)
        if timer is None:
            return False
        timer.cancel()
        return await self._release(request_id)

    async def release_all(self) -> None:
        for rid in list(self._timers):
            await self.release(rid)
