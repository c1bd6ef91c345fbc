"""Capacity planning on the simulator: for each node kind and layout family, the most load a
*cell* (a small group of nodes, the unit the fleet is built of) carries within the SLOs; the
fleet for a peak rate is then whole cells; cost follows from node-hour prices.

Why cells: simulating every node of a 100-node fleet for each candidate is far slower than the
answer is worth; the routing policy spreads load evenly over identical nodes, so a cell at
1/n of the load behaves as the fleet does (an assumption, printed with the plan). Each cell
simulation runs the real scheduler, block pool, router and admission.

Search: per layout variant (colocated, P:D 1:1, 1:2, 1:3; batch limits), a bisection on the
cell's request rate, started from a bracket, each probe a short simulation (warm-up left
out; a probe that has certainly missed the SLOs stops there, sim/early.py). The cheapest fleet
meeting the SLOs wins; the Pareto front of fleet cost against TTFT P90 adds, per variant, the
larger fleets of the passing probes the search ran below capacity (up to 2.5× the minimum; when
there are none, fleets 25 % and 50 % larger are simulated).
"""

from __future__ import annotations

import math
import tomllib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from sim.cluster import Layout, NodeGroup
from sim.profile import Profile, StepFeatures
from sim.run import simulate
from sim.stats import SLO, Summary
from sim.workload import Synthetic, synthetic


class Scenario(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    users_peak: int
    teams: int = 1
    team_peak_users: int = 0
    think_time_s: float = 30.0
    e2e_guess_s: float = 8.0
    input_len: str = "512"
    output_len: str = "128"
    system_prompt_tokens: int = 0
    peak_hours_per_day: float = 24.0
    offpeak_load_fraction: float = 1.0
    ttft_p90_ms: float | None = 1000.0
    e2e_p90_ms: float | None = None
    itl_p99_ms: float | None = None
    required_saving: float = 0.4

    @property
    def peak_rate(self) -> float:
        """Requests/s at the peak: each user sends one request per think + answer time."""
        return self.users_peak / (self.think_time_s + self.e2e_guess_s)

    @property
    def day_utilisation(self) -> float:
        """Mean load of a day over the peak load (a static fleet sized for the peak)."""
        h = self.peak_hours_per_day
        return (h + (24 - h) * self.offpeak_load_fraction) / 24

    def slo(self) -> SLO:
        return SLO(
            ttft_p90_ms=self.ttft_p90_ms, e2e_p90_ms=self.e2e_p90_ms, itl_p99_ms=self.itl_p99_ms
        )

    def workload(self, rate: float, duration_s: float, seed: int = 0) -> Synthetic:
        return Synthetic(
            rate=rate,
            duration_s=duration_s,
            input_len=self.input_len,
            output_len=self.output_len,
            prefix_groups=self.teams if self.system_prompt_tokens else 0,
            prefix_len=self.system_prompt_tokens,
            teams=self.teams,
            seed=seed,
        )

    def mean_tokens(self) -> tuple[float, float]:
        return self.workload(1.0, 1.0).mean_tokens()

    def assumptions(self) -> list[str]:
        i, o = self.mean_tokens()
        return [
            f"peak: {self.users_peak:,} concurrent users ({self.teams} teams, one team's own peak "
            f"{self.team_peak_users:,}); each sends a request every think {self.think_time_s:g} s "
            f"+ answer {self.e2e_guess_s:g} s → {self.peak_rate:,.1f} requests/s at the peak",
            f"requests: input {self.input_len} + a {self.system_prompt_tokens}-token system prompt "
            f"per team (mean {i:,.0f} tokens), output {self.output_len} (mean {o:,.0f} tokens), "
            "all interactive tier",
            f"day: {self.peak_hours_per_day:g} h at the peak, {self.offpeak_load_fraction:.0%} of "
            "the peak load otherwise → a static fleet sized for the peak runs at "
            f"{self.day_utilisation:.0%} of its capacity on average",
            f"SLOs: TTFT P90 ≤ {self.ttft_p90_ms} ms, E2E P90 ≤ {self.e2e_p90_ms} ms, ITL P99 ≤ "
            f"{self.itl_p99_ms} ms, ≤ 1 % of requests refused",
        ]


def load_scenario(path: Path) -> Scenario:
    try:
        return msgspec.convert(tomllib.loads(Path(path).read_text()), Scenario)
    except FileNotFoundError:
        raise ValueError(f"no scenario file {path}") from None
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"{path}: {e}") from None


@dataclass(frozen=True)
class Variant:
    family: str  # "colocated" | "P:D 1:2" ...
    groups: tuple[NodeGroup, ...]
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    @property
    def nodes(self) -> int:
        return sum(g.count for g in self.groups)

    def layout(self, cells: int = 1) -> Layout:
        return Layout(
            tuple(NodeGroup(g.role, g.count * cells, g.pool) for g in self.groups),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )

    def label(self) -> str:
        return self.layout().label()


def variants(profile: Profile, quick: bool = False) -> list[Variant]:
    k = profile.kind
    out = [
        Variant("colocated", (NodeGroup("both", 2),)),
        Variant("colocated", (NodeGroup("both", 2),), max_num_seqs=max(8, k.max_num_seqs // 2)),
        Variant("P:D 1:1", (NodeGroup("prefill", 1), NodeGroup("decode", 1))),
        Variant("P:D 1:2", (NodeGroup("prefill", 1), NodeGroup("decode", 2))),
    ]
    if not quick:
        out += [
            Variant(
                "colocated",
                (NodeGroup("both", 2),),
                max_num_batched_tokens=max(64, k.max_num_batched_tokens // 2),
            ),
            Variant("P:D 2:1", (NodeGroup("prefill", 2), NodeGroup("decode", 1))),
        ]
    return out


@dataclass
class Probe:
    rate: float  # requests/s per cell
    summary: Summary


@dataclass
class Capacity:
    variant: Variant
    rate: float  # most requests/s per cell meeting the SLOs (0: none)
    at_capacity: Summary | None
    probes: list[Probe] = field(default_factory=list)
    #: (fleet size factor, cell rate, summary) for the Pareto front
    relaxed: list[tuple[float, float, Summary]] = field(default_factory=list)


@dataclass(frozen=True)
class SearchConfig:
    warmup_s: float = 15.0
    measure_s: float = 45.0
    iterations: int = 5
    seed: int = 0
    #: end a probe once it has certainly missed the SLOs (sim/early.py): a failing probe only
    #: needs to fail, and the overloaded ones are the slowest to simulate
    stop_early: bool = True


def _probe(profile: Profile, v: Variant, sc: Scenario, rate: float, cfg: SearchConfig) -> Summary:
    w = sc.workload(rate, cfg.warmup_s + cfg.measure_s, cfg.seed)
    s, _ = simulate(
        profile,
        v.layout(),
        synthetic(w),
        slo=sc.slo(),
        warmup_s=cfg.warmup_s,
        stop_early=cfg.stop_early,
    )
    return s


def capacity(
    profile: Profile, v: Variant, sc: Scenario, cfg: SearchConfig, guess: float
) -> Capacity:
    """Bisection on the cell's request rate between a rate that meets the SLOs and one that
    does not (the bracket grows from `guess` until it holds both)."""
    cap = Capacity(v, 0.0, None)
    lo, hi = 0.0, None
    r = guess
    for _ in range(8):  # find the bracket
        s = _probe(profile, v, sc, r, cfg)
        cap.probes.append(Probe(r, s))
        if s.meets_slo:
            lo, cap.at_capacity = r, s
            r *= 2
        else:
            hi = r
            if lo > 0:
                break
            r /= 2
        if hi is not None and lo > 0:
            break
    if hi is None or lo == 0.0:
        cap.rate = lo
        return cap
    for _ in range(cfg.iterations):
        mid = (lo + hi) / 2
        s = _probe(profile, v, sc, mid, cfg)
        cap.probes.append(Probe(mid, s))
        if s.meets_slo:
            lo, cap.at_capacity = mid, s
        else:
            hi = mid
    cap.rate = lo
    # the Pareto front's larger fleets: the passing probes the search ran anyway (a fleet sized
    # for a lower cell rate); only without any does it simulate fleets 25 % and 50 % larger
    for p in sorted(cap.probes, key=lambda p: -p.rate):
        if p.summary.meets_slo and 1.05 < lo / p.rate <= 2.5:
            cap.relaxed.append((lo / p.rate, p.rate, p.summary))
    if not cap.relaxed:
        for factor in (1.25, 1.5):
            cap.relaxed.append((factor, lo / factor, _probe(profile, v, sc, lo / factor, cfg)))
    return cap


def guess_rate(profile: Profile, v: Variant, sc: Scenario) -> float:
    """A first probe: the rate that would keep the cell's nodes half busy by the step model."""
    i, o = sc.mean_tokens()
    st = profile.step
    batch = 32
    t = st.seconds(
        StepFeatures(int(batch * i / o), batch, int(batch * (i + o / 2)), int(batch * i / o * 512))
    )
    tokens_per_s = batch / t  # output tokens/s of one node kept busy
    return max(0.05, 0.5 * tokens_per_s * v.nodes / o)


def _capacity_job(args: tuple) -> Capacity:
    return capacity(*args)


def search(
    profile: Profile,
    sc: Scenario,
    cfg: SearchConfig,
    *,
    quick: bool = False,
    jobs: int = 1,
    progress=None,
) -> list[Capacity]:
    vs = variants(profile, quick)
    work = [(profile, v, sc, cfg, guess_rate(profile, v, sc)) for v in vs]
    out: list[Capacity] = []
    if jobs <= 1:
        for w in work:
            out.append(_capacity_job(w))
            if progress:
                progress(out[-1])
        return out
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        for c in ex.map(_capacity_job, work):
            out.append(c)
            if progress:
                progress(c)
    return out


@dataclass
class Fleet:
    profile: str
    variant: str
    cells: int
    nodes: int
    gpus: int
    cell_rate: float
    fleet_rate: float
    usd_per_hour: float
    summary: Summary
    factor: float = 1.0  # fleet size over the minimum

    def usd_per_m_tokens(self, utilisation: float, tokens_per_request: float) -> float:
        """$ per 1M tokens (input + output) when the mean load is `utilisation` × the peak."""
        return self.usd_per_hour / (utilisation * self.fleet_rate * 3600 * tokens_per_request) * 1e6


def fleets(
    profile: Profile, caps: list[Capacity], peak_rate: float, usd_per_gpu_hour: float
) -> list[Fleet]:
    out = []
    gpus_per_node = max(profile.kind.gpus, 1)
    for c in caps:
        if c.rate <= 0 or c.at_capacity is None:
            continue
        points = [(1.0, c.rate, c.at_capacity), *c.relaxed]
        for factor, rate, s in points:
            cells = math.ceil(peak_rate / rate)
            nodes = cells * c.variant.nodes
            gpus = nodes * gpus_per_node
            out.append(
                Fleet(
                    profile.kind.name,
                    c.variant.label(),
                    cells,
                    nodes,
                    gpus,
                    rate,
                    peak_rate,
                    gpus * usd_per_gpu_hour,
                    s,
                    factor,
                )
            )
    return out


def pareto(points: list[Fleet]) -> list[Fleet]:
    """Fleets no other fleet beats on both cost and TTFT P90 (cheapest first)."""
    ok = [f for f in points if f.summary.meets_slo]
    ok.sort(key=lambda f: (f.usd_per_hour, f.summary.latency_ms["p90_ttft"] or math.inf))
    front: list[Fleet] = []
    best = math.inf
    for f in ok:
        t = f.summary.latency_ms["p90_ttft"] or math.inf
        if t < best:
            front.append(f)
            best = t
    return front
