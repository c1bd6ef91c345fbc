"""What a simulation measured: per-request results, ITL gaps, cluster samples over time, node
busy time — and their summary (percentiles, goodput for an SLO, utilisation, queue depth, KV
use, $ per 1M tokens).

Percentiles follow `duet bench serve` (numpy's linear interpolation over completed requests;
TPOT = (last token − first token) / (output tokens − 1), requests of one token have none;
TTFT is from the gateway's arrival, as the bench's is from its send). Requests that arrive in
the first `warmup_s` are left out of latency figures (the cluster starts empty); throughput
is output tokens of the measured requests over the window from the first measured arrival to
the last measured completion, as the bench divides by its own run's duration.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import numpy as np

from sim.node import NodeStats


@dataclass
class RequestResult:
    arrival: float
    prompt_tokens: int
    tier: str
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    path: str = ""
    failure: str | None = None


@dataclass
class Collector:
    results: list[RequestResult] = field(default_factory=list)
    itls: array = field(default_factory=lambda: array("d"))
    #: (t, gateway queue, node waiting, node running, mean KV usage), at most one per second
    samples: list[tuple[float, int, int, int, float]] = field(default_factory=list)
    nodes: dict[str, tuple[str, NodeStats]] = field(default_factory=dict)
    transfer_bytes: int = 0
    transfers: int = 0
    sending_ended: float = 0.0
    end: float = 0.0
    #: why the run ended before every request did (sim/early.py); None: it ran to the end
    stopped: str | None = None

    def finish(self, r: RequestResult) -> None:
        self.results.append(r)

    def itl(self, gap: float) -> None:
        self.itls.append(gap)

    def transfer(self, nbytes: int) -> None:
        self.transfer_bytes += nbytes
        self.transfers += 1

    def sample(self, t: float, gw: int, waiting: int, running: int, kv: float) -> None:
        if not self.samples or t - self.samples[-1][0] >= 1.0:
            self.samples.append((t, gw, waiting, running, kv))

    def node(self, node_id: str, role: str, stats: NodeStats) -> None:
        self.nodes[node_id] = (role, stats)


class SLO(msgspec.Struct, frozen=True, kw_only=True):
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    e2e_p90_ms: float | None = None
    #: most requests that may fail (shed, no capacity), as a fraction
    max_failed: float = 0.01

    def per_request(self, ttft_ms: float, tpot_ms: float | None, e2e_ms: float) -> bool:
        """Goodput: a request counts when it meets every per-request bound (percentile bounds
        read as per-request limits: TTFT ≤ the TTFT bound, TPOT ≤ the TPOT bound, …)."""
        ttft = self.ttft_p90_ms or self.ttft_p99_ms
        if ttft is not None and ttft_ms > ttft:
            return False
        if self.tpot_p50_ms is not None and tpot_ms is not None and tpot_ms > self.tpot_p50_ms:
            return False
        return not (self.e2e_p90_ms is not None and e2e_ms > self.e2e_p90_ms)


class Summary(msgspec.Struct, kw_only=True):
    requests: int
    completed: int
    failures: dict[str, int]
    window_s: float
    output_throughput: float  # output tokens/s
    input_throughput: float  # prompt tokens/s
    request_throughput: float
    latency_ms: dict[str, float | None]  # e.g. p90_ttft, p50_tpot, p99_itl
    goodput: float | None  # requests/s meeting the SLO
    good_fraction: float | None
    meets_slo: bool | None
    violations: list[str]
    utilisation: dict[str, float]  # role -> mean busy fraction of its nodes over the window
    queue: dict[str, float]  # gateway/node queue depth: mean, p99, max
    kv_usage: dict[str, float]  # mean, max
    paths: dict[str, int]
    cached_token_fraction: float
    transfer_gb: float
    node_hours: float
    cost_per_hour: float | None = None
    usd_per_m_output: float | None = None
    usd_per_m_total: float | None = None


PCTS = (50, 90, 99)


def _pcts(name: str, xs: list[float] | np.ndarray, out: dict[str, float | None]) -> None:
    a = np.asarray(xs, dtype=float) * 1e3
    for p in PCTS:
        out[f"p{p}_{name}"] = float(np.percentile(a, p)) if a.size else None
    out[f"mean_{name}"] = float(a.mean()) if a.size else None


def summarize(
    c: Collector,
    *,
    slo: SLO | None = None,
    warmup_s: float = 0.0,
    node_price_per_hour: float | None = None,
) -> Summary:
    measured = [r for r in c.results if r.arrival >= warmup_s]
    ok = [r for r in measured if r.failure is None and r.first_token is not None]
    fails = Counter(r.failure for r in measured if r.failure is not None)
    start = min((r.arrival for r in measured), default=0.0)
    end = max((r.last_token or r.arrival for r in measured), default=start)
    window = max(end - start, 1e-9)
    # (arrival, first token, last token, output tokens) of each answered request: the two token
    # times are set together (sim/cluster.py), so every request in ok has both
    times = [
        (r.arrival, r.first_token, r.last_token, r.output_tokens)
        for r in ok
        if r.first_token is not None and r.last_token is not None
    ]
    ttft = [first - arrival for arrival, first, _, _ in times]
    tpot = [(last - first) / (n - 1) for _, first, last, n in times if n > 1]
    e2e = [last - arrival for arrival, _, last, _ in times]
    lat: dict[str, float | None] = {}
    _pcts("ttft", ttft, lat)
    _pcts("tpot", tpot, lat)
    _pcts("itl", np.frombuffer(c.itls, dtype=float) if c.itls else [], lat)
    _pcts("e2e", e2e, lat)
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    good = meets = None
    violations: list[str] = []
    if slo is not None:
        good = sum(
            slo.per_request(
                (first - arrival) * 1e3,
                (last - first) / (n - 1) * 1e3 if n > 1 else None,
                (last - arrival) * 1e3,
            )
            for arrival, first, last, n in times
        )
        for key, bound in (
            ("p90_ttft", slo.ttft_p90_ms),
            ("p99_ttft", slo.ttft_p99_ms),
            ("p50_tpot", slo.tpot_p50_ms),
            ("p99_itl", slo.itl_p99_ms),
            ("p90_e2e", slo.e2e_p90_ms),
        ):
            v = lat.get(key)
            if bound is not None and (v is None or v > bound):
                violations.append(f"{key} {v if v is None else round(v)} ms > {bound:g} ms")
        if c.stopped:
            violations.append(c.stopped)
        failed = sum(fails.values()) / max(len(measured), 1)
        if failed > slo.max_failed:
            violations.append(
                f"{failed:.1%} of requests failed ({dict(fails)}) > {slo.max_failed:.0%}"
            )
        meets = not violations
    util: dict[str, list[float]] = {}
    sim_end = max(c.end, 1e-9)
    for role, st in c.nodes.values():
        util.setdefault(role, []).append(st.busy_s / sim_end)
    samples = [s for s in c.samples if s[0] >= start]
    # counts as the samples hold them (ints), or one 0.0 when none was taken in the window
    waiting: list[float] = [s[1] for s in samples]
    queued: list[float] = [s[2] for s in samples]
    gw = np.array(waiting or [0.0])
    nq = np.array(queued or [0.0])
    kv = np.array([s[4] for s in samples] or [0.0])
    node_hours = len(c.nodes) * window / 3600
    cost_h = None if node_price_per_hour is None else node_price_per_hour * len(c.nodes)
    s = Summary(
        requests=len(measured),
        completed=len(ok),
        failures=dict(fails),
        window_s=window,
        output_throughput=out_tok / window,
        input_throughput=in_tok / window,
        request_throughput=len(ok) / window,
        latency_ms=lat,
        goodput=None if good is None else good / window,
        good_fraction=None if good is None else good / max(len(measured), 1),
        meets_slo=meets,
        violations=violations,
        utilisation={k: float(np.mean(v)) for k, v in util.items()},
        queue={
            "gateway_mean": float(gw.mean()),
            "gateway_max": float(gw.max()),
            "nodes_mean": float(nq.mean()),
            "nodes_p99": float(np.percentile(nq, 99)),
            "nodes_max": float(nq.max()),
        },
        kv_usage={"mean": float(kv.mean()), "max": float(kv.max())},
        paths=dict(Counter(r.path for r in ok)),
        cached_token_fraction=sum(r.cached_tokens for r in ok) / max(in_tok, 1),
        transfer_gb=c.transfer_bytes / 1e9,
        node_hours=node_hours,
        cost_per_hour=cost_h,
    )
    if cost_h is not None and out_tok:
        s.usd_per_m_output = cost_h * window / 3600 / out_tok * 1e6
        s.usd_per_m_total = cost_h * window / 3600 / (out_tok + in_tok) * 1e6
    return s


def timeline(c: Collector) -> dict[str, list[float]]:
    """Queue depth and KV use over time (one point a second), for plots and the JSON."""
    return {
        "t": [s[0] for s in c.samples],
        "gateway_queue": [s[1] for s in c.samples],
        "node_waiting": [s[2] for s in c.samples],
        "node_running": [s[3] for s in c.samples],
        "kv_usage": [s[4] for s in c.samples],
    }
