"""Throughput mode's inputs: the request rate, ISL/OSL and prefix-hit fraction per model × tier,
measured from the routing decisions this replica makes, and their forecast.

Each `/route` adds one arrival (prompt tokens, max_tokens — the requested output bound, the
only OSL known when a request is routed — and the tokens the chosen nodes had cached). The
forecast looks `lookahead_s` ahead (a node added now serves only after its cold start) along
the trend between the window's two halves, never below the second half's rate.

Only the leader plans, and it sees only the requests routed through itself: with several
coordinator replicas behind the gateways, run the throughput mode with one replica, or treat
its rate as a share (documented in docs/operations.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from planner.pools import PoolKey


@dataclass(frozen=True)
class Forecast:
    rate: float  # requests/s expected at now + lookahead
    isl: float  # mean prompt tokens
    osl: float  # mean output tokens (requested max_tokens)
    prefix_hit: float  # fraction of prompt tokens served from cache
    observed_rate: float  # requests/s over the window

    def as_dict(self) -> dict[str, float]:
        return {
            "rate": round(self.rate, 3),
            "observed_rate": round(self.observed_rate, 3),
            "isl": round(self.isl, 1),
            "osl": round(self.osl, 1),
            "prefix_hit": round(self.prefix_hit, 3),
        }


class RateMeter:
    """Arrivals of one model × tier over a sliding window (monotonic seconds)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.arrivals: deque[tuple[float, int, int, int]] = deque()

    def add(self, now: float, prompt_tokens: int, max_tokens: int, cached_tokens: int) -> None:
        self.arrivals.append((now, prompt_tokens, max_tokens, cached_tokens))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self.arrivals and now - self.arrivals[0][0] > self.window_s:
            self.arrivals.popleft()

    def forecast(self, now: float, lookahead_s: float) -> Forecast | None:
        self._trim(now)
        if not self.arrivals:
            return None
        w = self.window_s
        half = now - w / 2
        first = sum(1 for a in self.arrivals if a[0] < half) / (w / 2)
        second = sum(1 for a in self.arrivals if a[0] >= half) / (w / 2)
        trend = (second - first) / (w / 2)
        rate = max(second, second + trend * lookahead_s)
        n = len(self.arrivals)
        prompt = sum(a[1] for a in self.arrivals)
        return Forecast(
            rate=rate,
            isl=prompt / n,
            osl=sum(a[2] for a in self.arrivals) / n,
            prefix_hit=sum(a[3] for a in self.arrivals) / max(prompt, 1),
            observed_rate=n / w,
        )


def merge(fs: list[Forecast]) -> Forecast | None:
    """Several meters' forecasts as one (rates add; ISL/OSL/hits weighted by observed rate)."""
    fs = [f for f in fs if f.rate > 0 or f.observed_rate > 0]
    if not fs:
        return None
    w = [max(f.observed_rate, 1e-9) for f in fs]
    tw = sum(w)
    return Forecast(
        rate=sum(f.rate for f in fs),
        observed_rate=sum(f.observed_rate for f in fs),
        isl=sum(f.isl * x for f, x in zip(fs, w, strict=True)) / tw,
        osl=sum(f.osl * x for f, x in zip(fs, w, strict=True)) / tw,
        prefix_hit=sum(f.prefix_hit * x for f, x in zip(fs, w, strict=True)) / tw,
    )


def pool_forecasts(
    meters: dict[tuple[str, str], RateMeter],
    pools: Iterable[PoolKey],
    now: float,
    lookahead_s: float,
) -> dict[tuple[str, str], Forecast]:
    """The forecast per model × tier that has pools: a tier's own meter, and for `shared` every
    tier of that model without a pool of its own (the shared pool serves them)."""
    keys = list(pools)
    out: dict[tuple[str, str], Forecast] = {}
    for model, tier in {(k.model, k.tier) for k in keys}:
        if tier == "shared":
            own = {k.tier for k in keys if k.model == model}
            fs = [
                m.forecast(now, lookahead_s)
                for (mdl, t), m in meters.items()
                if mdl == model and t not in own
            ]
        else:
            m = meters.get((model, tier))
            fs = [m.forecast(now, lookahead_s)] if m else []
        f = merge([f for f in fs if f is not None])
        if f is not None:
            out[(model, tier)] = f
    return out
