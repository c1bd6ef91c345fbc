"""Nodes sharing one machine (sim/host.py): a step's work runs at 1/factor while another node is
mid-step, and at full speed alone — checked on exact virtual times — and a one-host cluster's
overlapping steps take longer than the same cluster spread over machines."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from protocol.profile import CoRun, Provenance
from sim import vclock
from sim.cluster import Layout, NodeGroup
from sim.host import SharedHost
from sim.run import simulate
from sim.workload import WorkItem
from tests.sim.helpers import toy_profile

TWO = CoRun(prefill_factor=2.0, decode_factor=3.0, cpus=2, provenance=Provenance.MEASURED)


def _ends(host: SharedHost, steps: list[tuple[float, float, bool]]) -> list[float]:
    """Start each (at, work, prefill) step on `host`; the virtual time each one ends."""

    async def one(at: float, work: float, prefill: bool) -> float:
        await asyncio.sleep(at)
        await host.step(work, prefill=prefill)
        return asyncio.get_running_loop().time()

    async def main() -> list[float]:
        return list(await asyncio.gather(*(one(*s) for s in steps)))

    return vclock.run(main())  # type: ignore[return-value]


def test_a_step_alone_lasts_its_work() -> None:
    assert _ends(SharedHost(TWO), [(0.0, 1.5, True)]) == [pytest.approx(1.5)]
    assert _ends(SharedHost(TWO), [(0.0, 1.0, True), (2.0, 1.0, False)]) == [
        pytest.approx(1.0),
        pytest.approx(3.0),
    ]


def test_fully_overlapping_steps_run_at_one_over_their_factor() -> None:
    # both prefill (×2): each does 1 s of work at half speed; the decode step (×3) at a third
    assert _ends(SharedHost(TWO), [(0.0, 1.0, True), (0.0, 1.0, True)]) == [pytest.approx(2.0)] * 2
    a, b = _ends(SharedHost(TWO), [(0.0, 1.0, True), (0.0, 0.5, False)])
    # the decode step's 0.5 s at 1/3 ends at 1.5 (A did 0.75 by then), A's last 0.25 alone
    assert b == pytest.approx(1.5) and a == pytest.approx(1.75)


def test_a_partial_overlap_is_stretched_for_the_overlap_only() -> None:
    # A alone 0–0.5 (0.5 done), shared until A's last 0.5 is done at rate ½ (t = 1.5),
    # B did 0.5 of its 1.0 by then and finishes alone at 2.0
    assert _ends(SharedHost(TWO), [(0.0, 1.0, True), (0.5, 1.0, True)]) == [
        pytest.approx(1.5),
        pytest.approx(2.0),
    ]


def test_factors_of_one_change_nothing() -> None:
    assert _ends(SharedHost(CoRun()), [(0.0, 1.0, True), (0.5, 1.0, False)]) == [
        pytest.approx(1.0),
        pytest.approx(1.5),
    ]


def test_a_cancelled_step_frees_the_machine() -> None:
    host = SharedHost(TWO)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        other = loop.create_task(host.step(10.0, prefill=True))
        await asyncio.sleep(0)
        t = loop.create_task(host.step(1.0, prefill=True))
        await asyncio.sleep(0.5)  # t did 0.25 at half speed
        other.cancel()
        await t  # alone now: its last 0.75 at full speed
        return loop.time()

    assert vclock.run(main()) == pytest.approx(1.25)


def test_a_one_host_cluster_pays_the_corun_factor_where_steps_overlap() -> None:
    prof = msgspec.structs.replace(toy_profile(), corun=TWO)
    items = [
        WorkItem(t=0.0, prompt=list(range(3, 403)), max_tokens=20),
        WorkItem(t=0.0, prompt=list(range(500, 900)), max_tokens=20),
    ]
    two = (NodeGroup("both", 2),)
    apart, _ = simulate(prof, Layout(two), items)
    together, _ = simulate(prof, Layout(two, one_host=True), items)
    plain, _ = simulate(toy_profile(), Layout(two, one_host=True), items)
    # one request per node, started together: every decode step overlaps the other node's (×3)
    assert together.latency_ms["p50_tpot"] == pytest.approx(
        3 * apart.latency_ms["p50_tpot"], rel=0.02
    )
    assert (
        together.latency_ms["p50_ttft"] > 1.9 * apart.latency_ms["p50_ttft"] - 2 * 2.0
    )  # the prefills (×2)
    assert plain.latency_ms == apart.latency_ms  # no co-run measured: one host changes nothing
    alone, _ = simulate(prof, Layout((NodeGroup("both", 1),), one_host=True), items[:1])
    spread, _ = simulate(prof, Layout((NodeGroup("both", 1),)), items[:1])
    assert alone.latency_ms == spread.latency_ms  # one node has no neighbour
