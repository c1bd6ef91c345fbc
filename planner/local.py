"""The local actuator: `duet up --autoscale` starts and stops node processes for the planner.

`duet up` owns the processes (its supervisor); the planner runs in the coordinator it supervises.
The two speak over `duet up`'s control endpoint on loopback (duet/up_autoscale.py):
- `POST /nodes` ScaleOut{role, model, pool} → NodeStarted{name, node_id, url}: one more node
  like the layout's nodes of that role; 409 when `--max-nodes` (bounded by the machine's CPUs)
  is reached;
- `POST /nodes/{node_id}/stop` → NodeStopped{node_id, exit_code}: SIGTERM, wait for the exit,
  and take it off supervision (a stopped node is not restarted); `?dry_run=1` only checks;
- `GET /ready` → ControlReady once duet up is all up, 503 `starting` before: `ready()` asks it
  before the planner decides anything (planner/loop.py), until it said yes once.

scale_in asks with a dry run first (so a node is never drained that could then not be removed:
duet up still starting, the last node), then drains (planner/drain.py) — only an idle node (or
one past the drain deadline) is stopped. 503 (duet up starting or busy) is a failure the
planner retries after its cool-down; on a stop it means nothing was stopped and nothing will be
(duet/up_autoscale.py cancels a stop its supervisor did not take in time, and waits for one it
took), so undoing the drain cannot put back into routing a node that is then stopped. A stop
refused or failed after the drain undoes it (the
node's `DELETE /drain`): the node serves again rather than sit drained under supervision; a
drain undone by someone else while it ran (`duet drain --undo`) is REFUSED, nothing stopped.
"""

from __future__ import annotations

import aiohttp
import msgspec

from planner.actuator import ActResult, Outcome, Victim
from planner.drain import DrainEnd, Drainer, DrainError
from planner.pools import PoolKey


class ScaleOut(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    model: str
    pool: str = "shared"


class NodeStarted(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    node_id: str
    url: str
    nodes: int  # nodes under supervision now


class NodeStopped(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    exit_code: int | None
    nodes: int


class ControlReady(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /ready` once duet up is up (before: 503 ControlError `starting`)."""

    max_nodes: int


class ControlError(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    code: str


class LocalActuator:
    name = "local"

    def __init__(self, control_url: str, drainer: Drainer, session: aiohttp.ClientSession) -> None:
        self.url = control_url.rstrip("/")
        self.drainer = drainer
        self.session = session
        self._ready = False

    async def ready(self) -> str | None:
        """None once duet up can start and stop nodes (asked until it says so once: it never
        goes back to starting); else why not. The planner decides nothing meanwhile: every step
        would be answered 503 `starting` and recorded failed."""
        if self._ready:
            return None
        try:
            async with self.session.get(
                self.url + "/ready", timeout=aiohttp.ClientTimeout(total=10)
            ) as r:
                status, raw = r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            return f"duet up's control endpoint: {type(e).__name__}: {e}"
        if status != 200:
            return self._error(status, raw, "GET /ready").detail
        self._ready = True
        return None

    async def _post(self, path: str, body: object, timeout: float) -> tuple[int, bytes]:
        async with self.session.post(
            self.url + path,
            data=msgspec.json.encode(body),
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as r:
            return r.status, await r.read()

    @staticmethod
    def _error(status: int, raw: bytes, what: str) -> ActResult:
        try:
            err = msgspec.json.decode(raw, type=ControlError)
            detail = f"{what}: duet up answered {status} {err.code}: {err.message}"
        except (msgspec.DecodeError, msgspec.ValidationError):
            detail = f"{what}: duet up answered {status}: {raw[:200]!r}"
        return ActResult(Outcome.REFUSED if status in (403, 409) else Outcome.FAILED, detail)

    async def scale_out(self, pool: PoolKey, to: int) -> ActResult:
        try:
            status, raw = await self._post(
                "/nodes", ScaleOut(role=pool.role, model=pool.model, pool=pool.tier), 60
            )
        except (aiohttp.ClientError, TimeoutError) as e:
            return ActResult(Outcome.FAILED, f"duet up's control endpoint: {type(e).__name__}: {e}")
        if status != 200:
            return self._error(status, raw, f"start a {pool.role} node")
        started = msgspec.json.decode(raw, type=NodeStarted)
        return ActResult(Outcome.DONE, f"started {started.node_id} at {started.url}", replicas=to)

    async def scale_in(self, pool: PoolKey, victim: Victim, to: int) -> ActResult:
        try:
            status, raw = await self._post(f"/nodes/{victim.node_id}/stop?dry_run=1", {}, 30)
        except (aiohttp.ClientError, TimeoutError) as e:
            return ActResult(Outcome.FAILED, f"duet up's control endpoint: {type(e).__name__}: {e}")
        if status != 200:
            return self._error(status, raw, f"stop {victim.node_id} (asked before draining it)")
        try:
            end = await self.drainer.drain(victim.url)
        except (
            DrainError,
            aiohttp.ClientError,
            TimeoutError,
        ) as e:  # a drain asked, then its poll failed
            undone = await self.drainer.undo_after_failure(victim.url, victim.node_id)
            return ActResult(
                Outcome.FAILED, f"drain of {victim.node_id} failed, left running: {e}; {undone}"
            )
        if end == DrainEnd.CANCELLED:
            return ActResult(
                Outcome.REFUSED,
                f"the drain of {victim.node_id} was undone while it ran "
                "(duet drain --undo): it serves again; not stopped",
            )
        drained = end.drained
        try:
            status, raw = await self._post(f"/nodes/{victim.node_id}/stop", {}, 120)
        except (aiohttp.ClientError, TimeoutError) as e:
            undone = await self.drainer.undo_after_failure(victim.url, victim.node_id)
            return ActResult(
                Outcome.FAILED,
                f"duet up's control endpoint: {type(e).__name__}: {e}; {undone}",
                drained=drained,
            )
        if status != 200:
            r = self._error(status, raw, f"stop {victim.node_id}")
            if status != 404:  # 404: no longer under supervision — nothing left to undo
                r = ActResult(
                    r.outcome,
                    f"{r.detail}; "
                    f"{await self.drainer.undo_after_failure(victim.url, victim.node_id)}",
                )
            return ActResult(r.outcome, r.detail, drained=drained)
        stopped = msgspec.json.decode(raw, type=NodeStopped)
        return ActResult(
            Outcome.DONE,
            f"stopped {victim.node_id} (exit {stopped.exit_code}, "
            f"{'drained' if drained else 'drain deadline passed'})",
            replicas=to,
            drained=drained,
        )

    async def close(self) -> None:
        return None
