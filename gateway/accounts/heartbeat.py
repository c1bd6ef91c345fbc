"""This gateway's life in the store: its heartbeat, and the reclaim of dead gateways' bookings.

Every `[quotas] heartbeat_s`: the heartbeat row (which renews this gateway's own reservations,
so a request outliving the TTL still counts, and reports the tokens each stream has sent,
which a booking bills if this gateway dies: `Books.streamed_report`), the reclaim of dead
gateways' reservations (a killed gateway's, its own previous life's included), and the expiry
of lapsed ones. A failed beat is logged and the next one tries again.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.accounts.ledger import Books

log = logging.getLogger("duet.gateway")

#: a gateway whose heartbeat is this many heartbeats old is dead (its reservations reclaimed)
DEAD_AFTER_HEARTBEATS = 2.5


async def beat(books: Books) -> None:
    """One heartbeat: renew, report, reclaim, expire."""
    q, store = books.quotas, books.store
    report = books.streamed_report()
    await store.heartbeat(books.gateway_id, q.reservation_ttl_s, streamed=report)
    books.streamed_reported(report)
    n = await store.reclaim(DEAD_AFTER_HEARTBEATS * q.heartbeat_s)
    if n:
        log.warning(
            "reclaimed %d reservations of a gateway that stopped (billed at their prompt and "
            "what they had streamed)",
            n,
        )
    n = await store.expire_reservations()
    if n:
        log.warning("expired %d stale quota reservations", n)


async def run(books: Books) -> None:
    """The heartbeat, for as long as the gateway serves (cancel it to stop)."""
    while True:
        try:
            await beat(books)
        except Exception:
            log.exception("the reservation heartbeat failed")
        await asyncio.sleep(books.quotas.heartbeat_s)


async def reclaim_previous_life(books: Books, instance: str) -> None:
    """A restart of a named gateway frees its dead life's team slots at once."""
    n = await books.store.reclaim_previous(instance, books.gateway_id)
    if n:
        log.warning(
            "reclaimed %d reservations of this gateway's previous life (%s; billed at their "
            "prompt and what they had streamed)",
            n,
            instance,
        )
