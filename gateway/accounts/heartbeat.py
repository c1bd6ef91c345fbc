"""This gateway's life in the store: its heartbeat, and the reclaim of dead gateways' bookings.

Invariants: a gateway never reclaims its own bookings, and a heartbeat that itself came late
(longer than a gateway takes to look dead) reclaims nothing that round: the stall it waited
out may have held the other gateways' heartbeats too. The store writes a heartbeat's time when
it lands, so a beat that waited is not stale.

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
    dead_after_s = DEAD_AFTER_HEARTBEATS * q.heartbeat_s
    gap = await store.heartbeat(books.gateway_id, q.reservation_ttl_s, streamed=report)
    books.streamed_reported(report)
    if gap is not None and gap > dead_after_s:
        # This gateway could not beat for as long as it takes a gateway for dead: the store (a
        # held lock, a full pool) or this process stalled, and another gateway's heartbeat may
        # be waiting just as this one was. It is judged by the next beat, not on this evidence.
        log.warning(
            "this gateway's heartbeat came %.1f s after the last one; reclaiming no other "
            "gateway until the next",
            gap,
        )
    else:
        await _reclaim(books, dead_after_s)
    n = await store.expire_reservations()
    if n:
        log.warning("expired %d stale quota reservations", n)


async def _reclaim(books: Books, dead_after_s: float) -> None:
    # never its own bookings: a gateway that reclaims is alive, however late its heartbeat
    n = await books.store.reclaim(dead_after_s, gateway_id=books.gateway_id)
    if n:
        log.warning(
            "reclaimed %d reservations of a gateway that stopped (billed at their prompt and "
            "what they had streamed)",
            n,
        )


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
