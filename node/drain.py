"""The node's drain endpoint: `POST /drain[?wait=S]` asks for a drain, `GET /drain` reads it
(protocol/drain.py::DrainStatus). Called by the planner's actuators and a pod's preStop hook.

A drain asked here is the drain `duet drain` writes in etcd: registration (node/registration.py)
sees `state.drain_requested` on its next tick (≤ 250 ms) and publishes `status: draining`, so
routers stop sending work; the node finishes its prefills and streams and keeps held KV until
it is pulled or its lease ends; with `--exit-when-drained` it then deregisters and exits 0.
`idle` is the actuators' "safe to stop": the drain is published (in etcd) since at least
`SETTLE_S` — a route decided just before routers saw it has arrived by then — and nothing is in
flight nor held.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
from aiohttp import web

from protocol.drain import DrainStatus
from protocol.openai import APIError

#: the longest a `POST /drain?wait=` may hold its connection (a preStop hook's budget)
MAX_WAIT_S = 3600.0
#: how long after routers were told (etcd) a route decided before may still arrive: the
#: gateway's route → leg hop is milliseconds; a second covers a loaded machine
SETTLE_S = 1.0


def drain_status(state) -> DrainStatus:  # state: node.state.NodeState
    held = int(state.engine.stats().get("num_requests_held", 0))
    draining = state.drain_requested or state.draining
    if draining and not state.drain_via_etcd and state.drain_published_at is None:
        state.drain_published_at = time.monotonic()  # no routers to tell: published as asked
    published = state.drain_published_at
    settled = published is not None and time.monotonic() - published >= SETTLE_S
    return DrainStatus(node_id=state.node_id, role=state.config.role, draining=draining, inflight=state.inflight,
                       held=held, idle=draining and settled and state.inflight == 0 and held == 0)  # fmt: skip


def _answer(status: DrainStatus) -> web.Response:
    return web.Response(body=msgspec.json.encode(status), content_type="application/json")


async def handle_get_drain(state, request: web.Request) -> web.Response:
    return _answer(drain_status(state))


async def handle_post_drain(state, request: web.Request) -> web.Response:
    raw = request.query.get("wait", "0")
    try:
        wait = float(raw)
    except ValueError:
        raise APIError(400, f"wait must be a number of seconds, not {raw[:40]!r}", param="wait") from None
    if not 0 <= wait <= MAX_WAIT_S:
        raise APIError(400, f"wait must be between 0 and {MAX_WAIT_S:g} seconds", param="wait")
    state.drain_requested = True
    deadline = time.monotonic() + wait
    status = drain_status(state)
    while not status.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.25)  # the registration tick; holds end on the engine thread
        status = drain_status(state)
    return _answer(status)
