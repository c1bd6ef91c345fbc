"""Stopping a probe early once it has certainly missed its SLO (the plan search's bisection
needs only pass/fail from a failing probe, and overloaded probes are the slowest to simulate).

Exact, not a guess: with `n` requests to be measured, P90 of a latency is above a bound as soon
as more of them exceed it than the interpolated percentile can hide. numpy's linear P_q over
n values reads the sorted values at floor(q·(n−1)) and the next; when the count above the bound
reaches n − floor(q·(n−1)), both are above it. Fewer completed requests (some shed) only lower
that count's threshold, so counting against all `n` is safe. A request counts as above the
TTFT bound when its first token comes later than the bound, and above the E2E bound when its
last one does. ITL and TPOT bounds are not checked early (they need every gap).
"""

from __future__ import annotations

import math

from sim.stats import SLO


def needed(n: int, q: float) -> int:
    """Values above a bound, out of n, that put the linear-interpolated P_q above it."""
    return n - math.floor(q * (n - 1)) if n > 0 else 1


class EarlyStop:
    def __init__(self, slo: SLO, measured: int, warmup_s: float) -> None:
        self.warmup_s = warmup_s
        self.bounds: list[tuple[str, float, int]] = []  # (what, bound s, count that proves a miss)
        for what, bound, q in (
            ("ttft", slo.ttft_p90_ms, 0.9),
            ("ttft", slo.ttft_p99_ms, 0.99),
            ("e2e", slo.e2e_p90_ms, 0.9),
        ):
            if bound is not None:
                self.bounds.append((what, bound / 1e3, needed(measured, q)))
        self.over = {"ttft": [0] * len(self.bounds), "e2e": [0] * len(self.bounds)}
        self.reason: str | None = None

    def observe(self, what: str, arrival: float, latency_s: float) -> bool:
        """Record one request's TTFT or E2E; True once the SLO is certainly missed."""
        if arrival < self.warmup_s or self.reason is not None:
            return self.reason is not None
        counts = self.over[what]
        for i, (w, bound, need) in enumerate(self.bounds):
            if w == what and latency_s > bound:
                counts[i] += 1
                if counts[i] >= need:
                    self.reason = (
                        f"stopped early: {counts[i]} requests over the {what} bound "
                        f"{bound * 1e3:g} ms"
                    )
        return self.reason is not None
