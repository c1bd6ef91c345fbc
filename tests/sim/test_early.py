"""Stopping a probe early: the count that proves a percentile above a bound agrees with numpy's
interpolation at every n, and a run stopped early fails exactly when the full run does."""

from __future__ import annotations

import numpy as np

from sim.cluster import Layout, NodeGroup
from sim.early import needed
from sim.run import simulate
from sim.stats import SLO
from sim.workload import Synthetic, synthetic
from tests.sim.helpers import toy_profile


def test_needed_is_the_least_count_that_moves_the_percentile() -> None:
    for n in range(1, 120):
        for q in (0.9, 0.99):
            k = needed(n, q)
            above = np.array([0.0] * (n - k) + [2.0] * k)
            assert np.percentile(above, q * 100) > 1.0, (n, q)  # k values over the bound: over
            if k > 1:
                # one fewer, each just over the bound: the percentile can still be under it
                fewer = np.array([0.0] * (n - k + 1) + [1.0 + 1e-9] * (k - 1))
                assert np.percentile(fewer, q * 100) <= 1.0, (n, q)


def test_a_run_stopped_early_fails_as_the_full_run_does() -> None:
    slo = SLO(ttft_p90_ms=400, e2e_p90_ms=3000)
    layout = Layout((NodeGroup("both", 1),))
    for rate, expect in ((2.0, True), (60.0, False)):
        w = Synthetic(rate=rate, duration_s=15, input_len="200", output_len="16", seed=2)
        full, _ = simulate(toy_profile(), layout, synthetic(w), slo=slo, warmup_s=3)
        early, c = simulate(
            toy_profile(), layout, synthetic(w), slo=slo, warmup_s=3, stop_early=True
        )
        assert full.meets_slo is early.meets_slo is expect
        if expect:
            assert c.stopped is None and early.latency_ms == full.latency_ms
        else:
            assert c.stopped and c.stopped in early.violations
            assert early.completed < full.completed  # it did stop before the end
