"""The node's drain endpoint: `POST /drain[?wait=S]` asks for a drain, `GET /drain` reads it
(protocol/drain.py::DrainStatus), `DELETE /drain` undoes it (UndrainStatus). Called by the
planner's actuators, a pod's preStop hook, `duet drain --undo` and the coordinator's
`DELETE /nodes/{id}/drain`; the cluster secret guards all three (the app's auth middleware).

A drain asked here is the drain `duet drain` writes in etcd: registration (node/registration.py)
sees `state.drain_requested` on its next tick (≤ 250 ms) and publishes `status: draining`, so
routers stop sending work; the node finishes its prefills and streams and keeps held KV until
it is pulled or its lease ends; with `--exit-when-drained` it then deregisters and exits 0.
`idle` is the actuators' "safe to stop": the drain is published (in etcd) since at least
`SETTLE_S` — a route decided just before routers saw it has arrived by then — and nothing is in
flight nor held.

An owned drain (`?owner=NAME&lease_s=S`, what the planner's actuators send) lapses when its
owner stops renewing it — a `GET` or `POST /drain?owner=NAME` renews it — for S seconds: the
node then undoes it itself (registration's tick), so a scale-in whose owner died, was cut off
or lost leadership half-way never leaves the node draining, serving nothing, forever. The first
asker owns a drain; a planner re-asking takes it over; an operator's drain (no owner) is never
owned, and an operator's `POST /drain` on an owned one makes it the operator's.

Undo: a drain in progress or finished (the process not stopped) is called off — with --etcd,
registration writes `status: active` first (node/registration.py::Registration.undrain), then
`end_drain` clears it here: routers route to the node again, `GET /health?probe=ready` is 200
again, and a `POST /drain?wait=` still waiting answers `outcome: cancelled` (its caller must not
stop the node). A node that is stopping (SIGTERM's grace period, or drained and exiting with
--exit-when-drained) answers 409 `node_stopping`; etcd unreachable: 503, the drain stays.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web

from coordinator.store import StoreError
from protocol.drain import DrainOutcome, DrainStatus, UndrainOutcome, UndrainStatus
from protocol.openai import APIError

log = logging.getLogger("duet.node")

#: the longest a `POST /drain?wait=` may hold its connection (a preStop hook's budget)
MAX_WAIT_S = 3600.0
#: an owned drain's life without a renewal, unless `lease_s` says otherwise
DEFAULT_LEASE_S = 60.0
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
    idle = draining and settled and state.inflight == 0 and held == 0
    outcome = (
        DrainOutcome.IDLE if idle else DrainOutcome.DRAINING if draining else DrainOutcome.ACTIVE
    )
    return DrainStatus(
        node_id=state.node_id,
        role=state.config.role,
        draining=draining,
        inflight=state.inflight,
        held=held,
        idle=idle,
        outcome=outcome,
    )


def stopping(state) -> bool:
    """SIGTERM's grace period (or an engine failure) has begun: the process is on its way out."""
    return state.draining or state.shutdown.is_set()


def end_drain(state) -> None:
    """Call the drain off on the node (registration wrote `status: active` first, with --etcd)."""
    state.drain_owner = ""
    state.drain_requested = False
    state.drain_published_at = None
    state.drain_epoch += 1


def lapsed_owner(state) -> str | None:
    """The owner of a drain it stopped renewing past its lease (the node undoes it), or None."""
    if not state.drain_requested or not state.drain_owner or stopping(state):
        return None
    if time.monotonic() - state.drain_renewed_at <= state.drain_lease_s:
        return None
    return state.drain_owner


def _claim(state, request: web.Request) -> None:
    """Ownership of the drain by `?owner=` (see the module docstring); a renewal when it owns."""
    owner = request.query.get("owner", "")
    if len(owner) > 200:
        raise APIError(400, "owner must be at most 200 characters", param="owner")
    raw = request.query.get("lease_s", str(DEFAULT_LEASE_S))
    try:
        lease = float(raw)
    except ValueError:
        raise APIError(
            400, f"lease_s must be a number, not {raw[:40]!r}", param="lease_s"
        ) from None
    if not 1 <= lease <= MAX_WAIT_S:
        raise APIError(400, f"lease_s must be between 1 and {MAX_WAIT_S:g}", param="lease_s")
    fresh = not (state.drain_requested or state.draining)
    if request.method == "POST" and (fresh or state.drain_owner):
        state.drain_owner, state.drain_lease_s = owner, lease  # "" : now the operator's
    if owner and owner == state.drain_owner:
        state.drain_renewed_at = time.monotonic()


def _answer(status: msgspec.Struct) -> web.Response:
    return web.Response(body=msgspec.json.encode(status), content_type="application/json")


async def handle_get_drain(state, request: web.Request) -> web.Response:
    _claim(state, request)
    return _answer(drain_status(state))


async def handle_post_drain(state, request: web.Request) -> web.Response:
    raw = request.query.get("wait", "0")
    try:
        wait = float(raw)
    except ValueError:
        raise APIError(
            400, f"wait must be a number of seconds, not {raw[:40]!r}", param="wait"
        ) from None
    if not 0 <= wait <= MAX_WAIT_S:
        raise APIError(400, f"wait must be between 0 and {MAX_WAIT_S:g} seconds", param="wait")
    _claim(state, request)
    state.drain_requested = True
    epoch = state.drain_epoch
    deadline = time.monotonic() + wait
    status = drain_status(state)
    while not status.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.25)  # the registration tick; holds end on the engine thread
        if state.drain_epoch != epoch:  # undone while we waited: this drain is over, not done
            return _answer(
                msgspec.structs.replace(drain_status(state), outcome=DrainOutcome.CANCELLED)
            )
        status = drain_status(state)
    return _answer(status)


def _node_stopping(state, why: str) -> APIError:
    return APIError(
        409,
        f"node {state.node_id} is stopping ({why}): its drain cannot be undone; start another "
        "node instead",
        code="node_stopping",
    )


async def handle_delete_drain(state, request: web.Request) -> web.Response:
    if stopping(state):
        raise _node_stopping(state, "SIGTERM's grace period")
    if not state.drain_requested:
        return _answer(
            UndrainStatus(
                node_id=state.node_id, role=state.config.role, outcome=UndrainOutcome.NOT_DRAINING
            )
        )
    if state.undrain_registered is None:  # no etcd: no router to tell but the gateway's static list
        end_drain(state)
    else:
        try:
            undone = await state.undrain_registered()
        except StoreError as e:
            raise APIError(
                503,
                f"cannot write node {state.node_id}'s status to etcd ({e}); it stays drained",
                type_="service_unavailable",
                code="etcd_unavailable",
                retry_after_s=1,
            ) from None
        if not undone:
            raise _node_stopping(state, "drained and exiting, or SIGTERM's grace period")
    log.info("drain undone (DELETE /drain): routed again")
    return _answer(
        UndrainStatus(
            node_id=state.node_id, role=state.config.role, outcome=UndrainOutcome.UNDRAINED
        )
    )
