"""Sleep mode on a node (vLLM's endpoints, behind the cluster secret): an idle node releases its
weights and KV pool and keeps everything else — its registration in etcd, its HTTP server, its
event stream to the coordinators (which see the prefix cache cleared, and `sleeping` in its load
frames), its LoRA adapters.

- `POST /sleep` (vLLM's `?level=` is accepted; both levels drop the weights): 200
  `{"is_sleeping": true}`; 409 while the engine holds requests (queued, running, or prefilled
  blocks held for a decode node's pull).
- `POST /wake_up`: rebuilds the weights; 200 with the seconds it took.
- `GET /is_sleeping`: `{"is_sleeping", "last_wake_s", "wakes"}`.
- A request (completion, chat, embedding, either P/D leg) to a sleeping node wakes it: the
  engine rebuilds its weights before admitting it, and the request waits that long (the wake
  time: `duet:engine_last_wake_seconds`, logged).
- `NodeConfig.sleep_after_idle_s`: the node puts itself to sleep once no request has been in
  flight for that long (checked about once a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import msgspec
from aiohttp import web

from node.engine_api import EngineBusy, NodeEngine, SleepingEngine
from node.state import NodeState
from protocol.node_api import SleepState
from protocol.openai import APIError

log = logging.getLogger("duet.node")


def sleeping_engine(engine: NodeEngine) -> SleepingEngine | None:
    return engine if isinstance(engine, SleepingEngine) else None


def _engine(state: NodeState) -> SleepingEngine:
    eng = sleeping_engine(state.engine)
    if eng is None:
        raise APIError(400, "this node's engine has no sleep mode", code="sleep_unsupported")
    return eng


def _state(eng: SleepingEngine) -> web.Response:
    body = SleepState(
        is_sleeping=eng.is_sleeping,
        last_wake_s=eng.last_wake_s,
        wakes=int(getattr(eng, "wakes", 0) or 0),
    )
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def put_to_sleep(state: NodeState) -> None:
    """Sleep the engine (EngineBusy when requests are in flight on the node or in the engine)."""
    eng = _engine(state)
    if state.inflight:
        raise EngineBusy(f"{state.inflight} request(s) in flight on this node")
    await eng.sleep()
    log.info("node asleep: weights and KV pool released, registration kept")


async def handle_sleep(state: NodeState, request: web.Request) -> web.Response:
    level = request.query.get("level", "1")
    if level not in ("1", "2"):
        raise APIError(400, f"level must be 1 or 2, not {level[:20]!r}", param="level")
    try:
        await put_to_sleep(state)
    except EngineBusy as e:
        raise APIError(409, f"cannot sleep now: {e}", code="engine_busy") from None
    return _state(_engine(state))


async def handle_wake_up(state: NodeState, request: web.Request) -> web.Response:
    eng = _engine(state)
    seconds = await eng.wake_up()
    if seconds:
        log.info("node awake: weights rebuilt in %.2f s", seconds)
    return _state(eng)


async def handle_is_sleeping(state: NodeState, request: web.Request) -> web.Response:
    return _state(_engine(state))


def add_sleep_routes(app: web.Application, bind: Callable) -> None:
    app.router.add_post("/sleep", bind(handle_sleep))
    app.router.add_post("/wake_up", bind(handle_wake_up))
    app.router.add_get("/is_sleeping", bind(handle_is_sleeping))


def idle_sleep_ctx(state: NodeState) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context that sleeps the engine after `sleep_after_idle_s` without requests."""

    async def watch() -> None:
        idle_s = state.config.sleep_after_idle_s
        assert idle_s is not None
        eng = _engine(state)
        quiet_since = time.monotonic()
        while True:
            await asyncio.sleep(min(1.0, idle_s / 4))
            busy = state.inflight or eng.is_sleeping or state.draining
            if busy:
                quiet_since = time.monotonic()
                continue
            if time.monotonic() - quiet_since >= idle_s:
                with contextlib.suppress(EngineBusy):  # a request arrived meanwhile
                    await put_to_sleep(state)

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(watch(), name="idle-sleep")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return ctx
