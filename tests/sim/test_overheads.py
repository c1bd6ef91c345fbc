"""The overhead measurement's pieces without a cluster: the kernel's per-thread clocks split a
node into loop / step / aux and show a busy thread's stretch, and `derive` turns two request
shapes' CPU and client figures into the profile's Overheads."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import msgspec
import pytest

from protocol.profile import Provenance
from sim import procstat
from sim.overheads import ShapeRun, derive
from tests.sim.helpers import toy_profile

pytestmark = pytest.mark.skipif(not procstat.available(), reason="needs Linux /proc schedstat")


def test_a_nodes_busiest_other_thread_is_its_step_thread() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    def idle() -> None:
        stop.wait()

    threads = [threading.Thread(target=spin), threading.Thread(target=idle)]
    before = procstat.snapshot({"node:me": os.getpid()})
    for t in threads:
        t.start()
    time.sleep(0.3)  # the spinning thread runs meanwhile: that is what is measured
    after = procstat.snapshot(
        {"node:me": os.getpid()}
    )  # while the threads live (an ended one has no clock)
    stop.set()
    for t in threads:
        t.join()
    d = (after - before).parts()
    assert set(d) == {"node:me/loop", "node:me/step", "node:me/aux"}
    # aux is every other thread of this process: stray threads of earlier tests in the same
    # pytest process may burn some CPU too (0.054 s once on a slow CPU), so relative, not absolute
    assert (
        d["node:me/step"].cpu_s > 0.05 and d["node:me/step"].cpu_s > 2 * d["node:me/aux"].cpu_s
    ), d
    assert d["node:me/step"].stretch >= 1.0


def test_cluster_parts_are_named_from_their_command_lines() -> None:
    assert procstat.part(os.getpid()) is None  # pytest is no duet part
    assert procstat.cluster(os.getpid()) == {}


def test_derive_overheads_from_two_shapes() -> None:
    prof = msgspec.structs.replace(toy_profile(), contention=2.0)
    # shape A: one token; TTFT 130 ms of which the step thread ran 50 ms of CPU at stretch 2
    a = ShapeRun(
        cpu={"gateway": 0.004, "coordinator": 0.001, "node:n/loop": 0.002, "node:n/step": 0.050},
        ttft_ms=130.0,
        tpot_ms=None,
        contention=2.0,
        meter=1.5,
        wall_s=1.0,
    )
    # shape B: 1 + 10 tokens, 30 ms of step CPU a token at stretch 2, TPOT 64 ms: 4 ms blocked a
    # token
    b = ShapeRun(
        cpu={"gateway": 0.009, "coordinator": 0.001, "node:n/loop": 0.012, "node:n/step": 0.350},
        ttft_ms=130.0,
        tpot_ms=64.0,
        contention=2.0,
        meter=1.5,
        wall_s=5.0,
    )
    m = derive(prof, a, b, tokens=10)
    o = m.overheads
    assert o.provenance is Provenance.MEASURED
    assert o.gateway_token_cpu_s == pytest.approx(
        0.0005
    ) and o.gateway_request_cpu_s == pytest.approx(0.0035)
    assert o.node_token_cpu_s == pytest.approx(0.002)  # 4 ms blocked / stretch 2
    assert o.coordinator_request_cpu_s == pytest.approx(0.001)
    # TTFT outside the step: 130 − 50·2 = 30 ms; less the node's token (2·2) and the relay (0.5·2)
    assert o.request_s == pytest.approx(0.025) and o.stream_s == pytest.approx(0.001)
    assert o.pd_hop_s == 0.0 and "TTFT outside the step 30.0 ms" in m.notes[0]


def test_in_node_decode_steps_set_the_factor_and_the_simulation_meets_shape_b() -> None:
    """With the node's own decode-step clock (duet:engine_decode_step_seconds), a step that runs
    slower inside the streaming node than the model says becomes `decode_step_factor`, the rest
    of B's TPOT is the time between steps; simulated one request at a time, shape B's TPOT is
    then the measured one (the old split, on the step thread's CPU, under-predicted it by the
    in-node excess: the validation's TPOT misses)."""
    from sim.cluster import Layout, NodeGroup
    from sim.profile import StepFeatures
    from sim.run import simulate
    from sim.workload import WorkItem

    prof = msgspec.structs.replace(toy_profile(), contention=1.0)
    prompt, tokens = 32, 16
    model = prof.step.seconds(StepFeatures(0, 1, round(prompt + (tokens + 1) / 2), 0))
    a = ShapeRun(
        cpu={"gateway": 0.004, "node:n/loop": 0.002, "node:n/step": 0.020},
        ttft_ms=30.0,
        tpot_ms=None,
        contention=1.0,
        meter=1.0,
        wall_s=1.0,
    )
    # the step inside the node: 15 % over the model, 10 points of it on the CPU (shared caches),
    # 5 off it (waiting for the GIL its loop holds); and 0.8 ms between two steps
    in_node = model * 1.15
    tpot = in_node + 0.0008
    b = ShapeRun(
        cpu={"gateway": 0.006, "node:n/loop": 0.006, "node:n/step": 0.020 + tokens * model * 1.10},
        ttft_ms=30.0,
        tpot_ms=tpot * 1e3,
        contention=1.0,
        meter=1.0,
        wall_s=2.0,
        decode_step_s=in_node,
        decode_steps=tokens * 12,
    )
    m = derive(prof, a, b, tokens=tokens, prompt=prompt)
    o = m.overheads
    assert o.decode_step_factor == pytest.approx(1.15)
    assert o.node_token_cpu_s == pytest.approx(0.0008)
    assert "pure decode step in the node" in m.notes[0]
    measured = msgspec.structs.replace(prof, overheads=o)
    s, _ = simulate(
        measured,
        Layout((NodeGroup("both", 1),)),
        [WorkItem(t=0.0, prompt=list(range(3, 3 + prompt)), max_tokens=1 + tokens)],
    )
    assert s.latency_ms["p50_tpot"] == pytest.approx(tpot * 1e3, rel=0.01)
    # the old split (no counters): B's step CPU per token stood in for the model's step, so the
    # CPU the step spent over the model vanished from the simulation
    old = derive(
        prof, a, dataclasses.replace(b, decode_step_s=None), tokens=tokens, prompt=prompt
    ).overheads
    assert old.decode_step_factor == 1.0
    s_old, _ = simulate(
        msgspec.structs.replace(prof, overheads=old),
        Layout((NodeGroup("both", 1),)),
        [WorkItem(t=0.0, prompt=list(range(3, 3 + prompt)), max_tokens=1 + tokens)],
    )
    assert s_old.latency_ms["p50_tpot"] < 0.95 * tpot * 1e3
