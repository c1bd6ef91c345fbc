"""The planner's recent decisions over the coordinator's API (`GET /planner`, protocol/planner.py):
a replica driven through a scale-out (the virtual actuator) serves the step with its reason,
from → to, inputs and the actuator's outcome, and the cold-start holds after it as one entry,
not one per tick; behind the cluster secret like `/cluster`; 404 `planner_off` without a planner.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
from aiohttp import web

from coordinator.app import make_app
from coordinator.service import Coordinator, CoordinatorConfig
from planner.config import PlannerConfig
from planner.loop import PlannerLoop
from planner.virtual import VirtualActuator
from protocol.planner import PlannerReport
from runtime.cluster_secret import ClusterSecret
from runtime.plane import PlaneSecurity
from runtime.ports import free_port
from tests.planner.test_loop import Clock, coordinator_with, frame, info, refresh

SECRET = "planner-history-secret-0123456789abcdef"


def _get(url: str, secret: str | None) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {secret}"} if secret else {}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def _serve(c: Coordinator) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(make_app(c.config, coordinator=c))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_a_scale_out_shows_up_in_get_planner(tmp_path: Path) -> None:
    clock = Clock()
    old = clock.t - 3600
    c = coordinator_with(
        {
            "p0": (info("p0", "prefill", old), frame(6000)),
            "d0": (info("d0", "decode", old), frame(0, 2)),
        }
    )
    c.config.security = PlaneSecurity(secret=ClusterSecret(SECRET, "the test"))
    loop = PlannerLoop(
        c,
        PlannerConfig(interval_s=5, window_s=10, cooldown_s=30, cold_start_s=60),
        VirtualActuator(tmp_path / "decision.json"),
        clock=clock,
    )
    c.election.won, c.election.valid_until = True, float("inf")

    async def go() -> None:
        t0 = clock.t
        for _ in range(6):
            refresh(c)
            await loop.tick()
            await asyncio.gather(*loop.busy.values())
            clock.t += 5
        runner, base = await _serve(c)
        try:
            status, body = await asyncio.to_thread(_get, base + "/planner", SECRET)
            assert status == 200, body
            report = msgspec.json.decode(body, type=PlannerReport)
            assert report.is_leader and report.actuator == "virtual" and report.mode == "load"
            assert report.last_tick is not None and report.last_tick >= t0
            prefill = [d for d in report.decisions if d.role == "prefill"]
            # newest first: the out, then the cold-start holds while the new node is expected — one
            # entry
            assert [(d.direction, d.reason, d.current, d.desired) for d in reversed(prefill)] == [
                ("out", "ttft", 1, 2),
                ("hold", "cold_start", 2, 2),
            ], prefill
            out = prefill[-1]
            assert (
                out.outcome == "done" and "decision.json" in out.detail and out.model == "smollm2"
            )
            assert out.tier == "shared" and t0 <= out.at <= clock.t
            # the figures it decided on: the queue behind the prompt and the TTFT it predicted past
            # the SLO
            assert out.inputs.load is not None and out.inputs.load.queued_prefill_tokens == 6000
            assert out.inputs.at_n is not None and out.inputs.slo is not None
            assert out.inputs.at_n.ttft_s > out.inputs.slo.ttft_s and out.inputs.bounds == (1, 4)
            assert {(p.role, p.current) for p in report.pools} == {("prefill", 2), ("decode", 1)}
            assert [d.seq for d in report.decisions] == sorted(
                (d.seq for d in report.decisions), reverse=True
            )
            # the internal plane's secret guards it like /cluster
            assert (await asyncio.to_thread(_get, base + "/planner", None))[0] == 401
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_a_replica_without_a_planner_answers_404() -> None:
    c = Coordinator(CoordinatorConfig(), store=None)  # type: ignore[arg-type]  # nothing here touches etcd

    async def go() -> None:
        runner, base = await _serve(c)
        try:
            status, body = await asyncio.to_thread(_get, base + "/planner", None)
        finally:
            await runner.cleanup()
        assert status == 404 and b"planner_off" in body

    asyncio.run(go())


def test_the_ring_keeps_steps_and_one_entry_per_run_of_holds() -> None:
    from planner.actuator import ActResult, Outcome
    from planner.decide import Decision, Direction, Reason
    from planner.history import DecisionLog
    from planner.pools import PoolKey

    pool = PoolKey("decode", "m", "batch")
    log = DecisionLog(maxlen=4)

    def d(direction: Direction, reason: Reason, current: int = 1) -> Decision:
        return Decision(
            pool,
            current,
            current + (direction == Direction.OUT),
            direction,
            reason,
            inputs={
                "replicas": current,
                "warm": current,
                "bounds": [1, 4],
                "budget": {"total": 3, "limit": 3},
                "blocked": "out",
                "a figure the wire does not know": 1.5,
            },
        )

    for t, (direction, reason) in enumerate(
        [(Direction.HOLD, Reason.BUDGET)] * 3
        + [
            (Direction.HOLD, Reason.STEADY),
            (Direction.HOLD, Reason.BUDGET),
            (Direction.OUT, Reason.KV_CACHE),
        ]
    ):
        log.tick(float(t), [d(direction, reason)])
    got = [(e.at, e.direction, e.reason) for e in log.newest()]
    # three budget holds are one entry; a steady tick ends the run, so the next budget hold is a new
    # one
    assert got == [(5.0, "out", "kv_cache"), (4.0, "hold", "budget"), (0.0, "hold", "budget")], got
    assert log.newest()[1].inputs.budget is not None and log.newest()[1].inputs.blocked == "out"
    log.acted(pool, ActResult(Outcome.REFUSED, "403 from the API server"))
    assert (log.newest()[0].outcome, log.newest()[0].detail) == (
        "refused",
        "403 from the API server",
    )
    assert log.newest()[1].outcome is None  # a hold has no outcome
    for t in range(6, 12):  # bounded: the oldest go
        log.tick(float(t), [d(Direction.IN, Reason.HEADROOM, 2)])
    assert [e.at for e in log.newest()] == [11.0, 10.0, 9.0, 8.0]
    assert log.pools[pool].reason == "headroom" and log.last_tick == 11.0
