"""The planner with the local actuator decides nothing while `duet up` is still starting.

`duet up --autoscale` starts its coordinator (and the planner in it) before the nodes and the
gateway; on a loaded machine the gateway's start can outlast the planner's window. The planner
then judged the idle pool, decided a scale-in, and the local actuator's dry run was answered
503 `starting`: the step was recorded `failed` and the pool cooled down, so the real step came
a cool-down late. Now the planner asks the actuator first (`ready()`, duet up's `GET /ready`)
and holds every pool until duet up is all up, saying why on `GET /planner` and the console;
then the step is taken and done.

The real control endpoint, Autoscale and Supervisor (three plain processes as its nodes; the
test's thread plays the supervision thread, as in tests/duet/test_up_autoscale_control.py), the
real LocalActuator and Drainer, and a PlannerLoop in a coordinator whose node views are set by
the test (tests/planner/test_loop.py's way). The prefill nodes' drain endpoint is a stand-in
speaking protocol/drain.py's wire (an idle node: drained at once); real nodes drain in
tests/planner/test_drain_e2e.py, and the whole under a real `duet up --autoscale` is
tests/observe/test_console_autoscale_up.py.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import pytest
from aiohttp import web
from prometheus_client import generate_latest

from duet.supervisor import Child, Supervisor
from duet.up_autoscale import Autoscale, serve_control
from duet.up_config import UpConfig, layout_from_flags
from gateway.console.autoscaler import render
from planner.actuator import Outcome
from planner.config import PlannerConfig
from planner.drain import Drainer
from planner.local import LocalActuator
from planner.loop import PlannerLoop
from protocol.drain import DrainStatus
from runtime.cluster_secret import ClusterSecret
from tests.planner.test_loop import Clock, coordinator_with, frame, info, refresh

SECRET = ClusterSecret(secrets.token_urlsafe(32), "test")
NODES = ("prefill-0", "prefill-1", "decode-0")
#: bounds on waiting for something that must happen (not timing assumptions)
WAIT_S = 30.0


@dataclass
class UpStandIn:
    """What `duet up --autoscale` runs, still starting (`sup.ready` not set): the supervisor
    with its nodes, Autoscale, the control endpoint."""

    sup: Supervisor
    nodes: dict[str, Child]
    url: str


@pytest.fixture
def up(tmp_path: Path) -> Iterator[UpStandIn]:
    sup = Supervisor([[]], tail=False, stop_timeout=WAIT_S)
    nodes = {
        name: Child(
            name, [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / f"{name}.log"
        )
        for name in NODES
    }
    for c in nodes.values():  # no supervision thread yet: the test's thread is it
        sup.add(0, c)
    auto = Autoscale(
        UpConfig(nodes=layout_from_flags(2, 1, None)),
        tmp_path,
        "http://127.0.0.1:1",
        max_nodes=3,
        threads=1,
        stage=0,
        served={},
    )
    auto.sup = sup
    server = serve_control(auto, SECRET)
    done = threading.Event()

    def supervision() -> None:  # Supervisor.run's loop, off the main thread (run wants signals)
        while not done.wait(0.05):  # the supervision interval (0.5 s in duet up)
            sup.supervise_once()

    thread = threading.Thread(target=supervision, name="test-supervision", daemon=True)
    thread.start()
    try:
        yield UpStandIn(sup, nodes, f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        done.set()
        thread.join(WAIT_S)
        server.shutdown()
        server.server_close()
        for c in nodes.values():
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
            if c.proc is not None:
                c.proc.wait()


async def drain_stand_in() -> tuple[web.AppRunner, str, list[str]]:
    """An idle node's drain endpoint for every prefill node (`{base}/{node_id}/drain`), behind
    the cluster secret; the nodes asked to drain are listed."""
    drained: list[str] = []

    async def drain(request: web.Request) -> web.Response:
        if not SECRET.verify(request.headers.get("Authorization")):
            return web.Response(status=401)
        node_id = request.match_info["node"]
        if request.method == "POST":
            drained.append(node_id)
        status = DrainStatus(
            node_id=node_id,
            role="prefill",
            draining=node_id in drained,
            inflight=0,
            held=0,
            idle=node_id in drained,
        )
        return web.Response(body=msgspec.json.encode(status), content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{node}/drain", drain)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", drained


def test_the_planner_steps_only_once_duet_up_is_up_and_the_step_is_done(up: UpStandIn) -> None:
    clock = Clock()
    old = clock.t - 3600
    cfg = PlannerConfig(
        interval_s=5,
        window_s=10,
        cooldown_s=30,
        cold_start_s=60,
        bounds={"prefill": (1, 2), "decode": (1, 1)},
    )

    async def go() -> None:
        runner, base, drained = await drain_stand_in()
        try:
            async with aiohttp.ClientSession(headers=SECRET.headers) as session:
                c = coordinator_with(
                    {
                        "prefill-0": (info("prefill-0", "prefill", old), frame(0)),
                        "prefill-1": (info("prefill-1", "prefill", old), frame(0)),
                        "decode-0": (info("decode-0", "decode", old), frame(0)),
                    }
                )
                for node_id in ("prefill-0", "prefill-1"):
                    c.views[node_id].info = msgspec.structs.replace(
                        c.views[node_id].info, url=f"{base}/{node_id}"
                    )
                c.election.won, c.election.valid_until = True, float("inf")
                actuator = LocalActuator(
                    up.url, Drainer(session, auth=SECRET.headers, poll_s=0.05), session
                )
                loop = PlannerLoop(c, cfg, actuator, clock=clock)

                # duet up still starts: ticks well past the window, and the idle pool is not judged
                # (the old planner stepped in here, and the step failed: 503 `starting`)
                early = []
                for _ in range(6):
                    refresh(c)
                    early += [d for d in await loop.tick() if d.direction != "hold"]
                    await asyncio.wait_for(asyncio.gather(*loop.busy.values()), WAIT_S)
                    clock.t += 5
                assert early == [], [(d, r) for d, r in loop.results]
                report = loop.report()
                assert report.decisions == [] and report.last_tick is None, report
                assert report.waiting is not None and "503 starting" in report.waiting, (
                    report.waiting
                )
                # the console's Cluster page says so (its autoscaler section renders the report)
                assert (
                    "It decides nothing until its actuator can act: GET /ready: duet up answered "
                    "503 starting: duet up is still starting."
                ) in render(report, "http://coordinator"), render(report, "")
                assert drained == [] and not loop.busy

                # all up: the planner judges the pool from now on, and its step is carried out
                up.sup.ready.set()
                steps = []
                for _ in range(6):
                    refresh(c)
                    steps += [d for d in await loop.tick() if d.direction != "hold"]
                    if steps:
                        break
                    clock.t += 5
                assert [(str(d.pool), d.direction, d.reason, d.desired) for d in steps] == [
                    ("prefill/smollm2/shared", "in", "headroom", 1)
                ], steps
                [result] = await asyncio.wait_for(asyncio.gather(*loop.busy.values()), WAIT_S)
                assert result.outcome == Outcome.DONE, result
                assert loop.report().waiting is None
                assert "decides nothing" not in render(loop.report(), "http://coordinator")
                assert drained == [steps[0].victim]
                text = generate_latest(c.metrics.registry).decode()
                assert (
                    'duet:planner_actuations_total{actuator="local",direction="in",outcome="done"} '
                    "1.0" in text
                )
                assert 'outcome="failed"' not in text
        finally:
            await runner.cleanup()

    asyncio.run(go())
    # duet up stopped the drained node and took it off supervision
    [victim] = [
        n
        for n in ("prefill-0", "prefill-1")
        if up.nodes[n].retired.is_set() or up.nodes[n].retiring
    ]
    assert up.nodes[victim].retired.wait(WAIT_S)
    assert victim not in {c.name for c in up.sup.stages[0]}
    assert all(up.nodes[n].proc.poll() is None for n in NODES if n != victim)  # type: ignore[union-attr]
