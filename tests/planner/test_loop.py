"""The planner inside a coordinator replica (planner/loop.py): it reads the replica's node views
and load frames, acts only while the replica leads, hands steps to an actuator (the virtual one
here: a decision file), exports `duet:planner_*` on the coordinator's /metrics registry, and in
throughput mode sizes pools on the simulator from the routed request rate."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec
from prometheus_client import generate_latest

from coordinator.nodes import NodeView
from coordinator.service import Coordinator, CoordinatorConfig
from planner.config import PlannerConfig, PlannerMode, TierSLO
from planner.loop import PlannerLoop
from planner.throughput import SimSizer
from planner.virtual import VirtualActuator
from protocol.cluster import NodeInfo
from protocol.kv_events import LoadFrame
from protocol.latency_hist import RELATIVE_ERROR, bucket, histogram_of

PROFILE = Path(__file__).resolve().parents[2] / "data/profiles/smollm2-135m-bf16-none-t1.json"


def info(node_id: str, role: str, started: float) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=role,
        url=f"http://127.0.0.1:1/{node_id}",
        model="smollm2",  # type: ignore[arg-type]
        engine_id=node_id + "-e",
        block_size=16,
        kv_layout_hash="h",
        kv_capacity_blocks=1000,
        max_model_len=2048,
        started_at=started,
    )


def frame(queued: int, running: int = 0) -> LoadFrame:
    return LoadFrame(
        seq=1,
        ts=0.0,
        num_requests_waiting=0,
        num_requests_running=running,
        kv_cache_usage_perc=0.1,
        queued_prefill_tokens=queued,
        kv_blocks_free=900,
        kv_blocks_total=1000,
    )


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


def coordinator_with(views: dict[str, tuple[NodeInfo, LoadFrame]]) -> Coordinator:
    c = Coordinator(CoordinatorConfig(), store=None)  # type: ignore[arg-type]  # nothing here touches etcd
    for node_id, (i, f) in views.items():
        v = NodeView(info=i)
        v.load, v.load_at, v.connected = f, time.monotonic(), True
        c.views[node_id] = v
    return c


def refresh(c: Coordinator) -> None:
    for v in c.views.values():
        v.load_at = time.monotonic()


def test_the_loop_acts_only_while_leading_and_writes_the_decision(tmp_path: Path) -> None:
    clock = Clock()
    old = clock.t - 3600
    c = coordinator_with(
        {
            "p0": (info("p0", "prefill", old), frame(6000)),
            "d0": (info("d0", "decode", old), frame(0, 2)),
        }
    )
    cfg = PlannerConfig(interval_s=5, window_s=10, cooldown_s=30, cold_start_s=60)
    out = tmp_path / "decision.json"
    loop = PlannerLoop(c, cfg, VirtualActuator(out), clock=clock)

    async def go() -> None:
        for _ in range(4):  # a follower: nothing decided, nothing written
            assert await loop.tick() == []
            clock.t += 5
        c.election.won, c.election.valid_until = True, float("inf")
        acted, after = [], []
        for _ in range(6):
            refresh(c)
            ds = [d for d in await loop.tick() if d.pool.role == "prefill"]
            (after if acted else acted).extend(d for d in ds if acted or d.direction != "hold")
            await asyncio.gather(*loop.busy.values())
            clock.t += 5
        assert [(str(d.pool), d.direction, d.reason, d.desired) for d in acted] == [
            ("prefill/smollm2/shared", "out", "ttft", 2)
        ]
        # the started node has not registered yet: it counts as a cold replica, no second step
        assert after and all((d.current, d.reason) == (2, "cold_start") for d in after), after

    asyncio.run(go())
    written = json.loads(out.read_text())["pools"]
    assert (
        written["prefill/smollm2/shared"]["replicas"] == 2
        and "decode/smollm2/shared" not in written
    )
    text = generate_latest(c.metrics.registry).decode()
    assert 'duet:planner_desired_replicas{model="smollm2",pool="shared",role="prefill"} 2.0' in text
    assert (
        'duet:planner_actuations_total{actuator="virtual",direction="out",outcome="done"} 1.0'
        in text
    )
    assert 'duet:planner_current_replicas{model="smollm2",pool="shared",role="decode"} 1.0' in text


def test_throughput_mode_sizes_prefill_and_decode_from_the_routed_rate(tmp_path: Path) -> None:
    clock = Clock()
    old = clock.t - 3600
    c = coordinator_with(
        {"p0": (info("p0", "prefill", old), frame(0)), "d0": (info("d0", "decode", old), frame(0))}
    )
    cfg = PlannerConfig(
        mode=PlannerMode.THROUGHPUT,
        cooldown_s=0,
        reverse_cooldown_s=0,
        slo={"interactive": TierSLO(ttft_s=2.0, itl_s=0.5)},
        forecast_window_s=60,
        cold_start_s=0,
    )
    sizer = SimSizer(str(PROFILE), headroom=1.0, sim_requests=60)
    loop = PlannerLoop(c, cfg, VirtualActuator(tmp_path / "d.json"), sizer=sizer, clock=clock)
    c.election.won, c.election.valid_until = True, float("inf")
    # 3 requests/s of 256 prompt / 32 output tokens for the last minute, routed through this replica
    meter_now = time.monotonic()
    from planner.forecast import RateMeter

    loop.meters[("smollm2", "interactive")] = m = RateMeter(60)
    for k in range(180):
        m.add(meter_now - 60 + k / 3, 256, 32, 0)

    decisions = asyncio.run(loop.tick())
    p = next(d for d in decisions if d.pool.role == "prefill")
    assert p.direction == "out" and p.reason == "forecast" and p.desired == 2, p
    assert p.inputs["target"] > 1  # the simulator's size for 3 req/s: more than one P
    assert sizer.simulations >= 2


def test_the_loop_reads_the_measured_latency_of_the_load_frames(tmp_path: Path) -> None:
    """A light queue (predicted TTFT far under the SLO) but the node measured a 2.5 s TTFT P90
    over 40 requests: the leader steps the pool out, on the measurement."""
    clock = Clock()
    old = clock.t - 3600
    slow = msgspec.structs.replace(
        frame(100), ttft_p90_s=2.5, ttft_samples=40, latency_window_s=30.0
    )
    c = coordinator_with({"p0": (info("p0", "prefill", old), slow)})
    c.election.won, c.election.valid_until = True, float("inf")
    loop = PlannerLoop(
        c,
        PlannerConfig(interval_s=5, window_s=10, cold_start_s=60),
        VirtualActuator(tmp_path / "d.json"),
        clock=clock,
    )

    texts = []

    async def go() -> list:
        steps = []
        for _ in range(4):
            refresh(c)
            stepped = [d for d in await loop.tick() if d.direction != "hold"]
            if stepped:
                texts.append(generate_latest(c.metrics.registry).decode())
            steps += stepped
            await asyncio.gather(*loop.busy.values())
            clock.t += 5
        return steps

    steps = asyncio.run(go())
    assert [(d.direction, d.reason) for d in steps] == [("out", "ttft_measured")], steps
    assert (
        steps[0].inputs["at_n"]["ttft_s"] < 1.0 and steps[0].inputs["measured"]["ttft_p90_s"] == 2.5
    )
    out = next(e for e in loop.report().decisions if e.direction == "out")  # GET /planner's entry
    assert out.inputs.measured is not None and out.inputs.measured.counted == ["ttft"]
    assert (
        'duet:planner_measured_ttft_seconds{model="smollm2",pool="shared",role="prefill"} 2.5'
        in texts[0]
    )
    # the next ticks hold the pool for the started node's cold start: no figure counted, no series
    assert "duet:planner_measured_ttft_seconds{" not in generate_latest(c.metrics.registry).decode()


def test_the_loop_merges_the_nodes_latency_histograms(tmp_path: Path) -> None:
    """Two prefill nodes, light queues: p0 answered 800 requests in 50 ms, p1 200 in 2 s. The
    pool's P90 is p1's 2 s (the 900th of 1,000), read from the frames' histograms merged — the
    mean of the nodes' P90s (0.44 s) would have stepped the pool in."""
    clock = Clock()
    old = clock.t - 3600

    def measured(p90: float, n: int) -> LoadFrame:
        hist = histogram_of([bucket(p90)] * n)
        return msgspec.structs.replace(
            frame(100), ttft_p90_s=p90, ttft_samples=n, ttft_hist=hist, latency_window_s=30.0
        )

    c = coordinator_with(
        {
            "p0": (info("p0", "prefill", old), measured(0.05, 800)),
            "p1": (info("p1", "prefill", old), measured(2.0, 200)),
        }
    )
    c.election.won, c.election.valid_until = True, float("inf")
    loop = PlannerLoop(
        c,
        PlannerConfig(interval_s=5, window_s=10, cold_start_s=60),
        VirtualActuator(tmp_path / "d.json"),
        clock=clock,
    )

    async def go() -> list:
        steps = []
        for _ in range(4):
            refresh(c)
            steps += [d for d in await loop.tick() if d.direction != "hold"]
            await asyncio.gather(*loop.busy.values())
            clock.t += 5
        return steps

    steps = asyncio.run(go())
    assert [(d.direction, d.reason) for d in steps] == [("out", "ttft_measured")], steps
    out = next(e for e in loop.report().decisions if e.direction == "out")  # GET /planner's entry
    m = out.inputs.measured
    assert m is not None and (m.ttft_samples, m.ttft_merged_samples) == (1000, 1000)
    assert abs(m.ttft_p90_s - 2.0) <= RELATIVE_ERROR * 2.0, m
