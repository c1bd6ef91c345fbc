"""`duet plan`: capacity planning on the simulator (sim/).

Two forms:
- `duet plan [--scenario FILE] [--profile P.json ...]`: search layouts for a scenario (default:
  data/scenarios/target-10k-users.toml with the Llama-3-70B FP8 H100/H200 profiles), print the
  cheapest fleet meeting the SLOs, the Pareto front of cost against TTFT, $ per 1M tokens against
  every commercial price in the price table, whether the required saving holds and at what
  utilisation it breaks — with every assumption — and write plan.json + PNG plots to --out.
- `duet plan --layout 1P+1D --profile P.json (--from-result F | --trace F | --rate R ...)`: one
  simulation of one layout: the predicted TTFT/TPOT/ITL/E2E percentiles, throughput, goodput,
  utilisation, queue depth and KV use (what the validation against real runs compares).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from duet.errors import UsageError

if TYPE_CHECKING:
    from protocol.profile import Profile
    from sim.plan import Capacity, Fleet, Scenario, SearchConfig
    from sim.prices import PriceTable

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCENARIO = ROOT / "data/scenarios/target-10k-users.toml"
DEFAULT_PROFILES = [
    ROOT / "data/profiles/llama-3-70b-fp8-h100-tp2.json",
    ROOT / "data/profiles/llama-3-70b-fp8-h200-tp2.json",
]
DEFAULT_PRICES = ROOT / "data/prices/prices-2025-10.json"

EPILOG = """\
examples:
  duet plan                                   # the target scenario, H100 vs H200, to ./plan/
  duet plan --scenario my.toml --profile data/profiles/llama-3-70b-fp8-h200-tp2.json --out plan-h200
  duet plan --layout 1P+1D --profile data/profiles/smollm2-135m-bf16-none-t1.json \\
      --from-result run.json --json           # predict one measured run
  duet plan --layout 2C --profile P.json --rate 4 --duration 120 --input-len 512 --output-len 64
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="capacity planner: cheapest layout meeting SLOs, $/1M tokens vs APIs (simulator)",
        description=__doc__.split("\n\n", 1)[1],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--profile", action="append", default=[], help="node-kind profile JSON (repeatable)"
    )
    p.add_argument(
        "--scenario",
        default=None,
        help=f"scenario TOML (default {DEFAULT_SCENARIO.relative_to(ROOT)})",
    )
    p.add_argument("--prices", default=str(DEFAULT_PRICES), help="price table JSON")
    p.add_argument(
        "--node-price",
        type=float,
        default=None,
        help="$/hour of one node (overrides the price table)",
    )
    p.add_argument(
        "--out", default="plan", help="directory for plan.json and the PNG plots (default ./plan)"
    )
    p.add_argument("--jobs", type=int, default=2, help="simulations in parallel (default 2)")
    p.add_argument("--quick", action="store_true", help="fewer layout variants and shorter probes")
    p.add_argument(
        "--measure-s",
        type=float,
        default=None,
        help="simulated seconds measured per probe (default 45)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    one = p.add_argument_group("one layout (--layout)")
    one.add_argument(
        "--layout", default=None, help="e.g. 1C, 2C, 1P+1D, 2P+3D: simulate this layout only"
    )
    one.add_argument(
        "--from-result", default=None, help="workload: a `duet bench serve --result-file` JSON"
    )
    one.add_argument("--trace", default=None, help="workload: a Mooncake trace (JSONL)")
    one.add_argument("--rate", type=float, default=None, help="workload: requests/s (Poisson)")
    one.add_argument("--duration", type=float, default=60.0)
    one.add_argument("--input-len", default="128")
    one.add_argument("--output-len", default="128")
    one.add_argument("--prefix-groups", type=int, default=0)
    one.add_argument("--prefix-len", type=int, default=0)
    one.add_argument("--max-num-seqs", type=int, default=None)
    one.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="simulated seconds left out of the figures "
        "(one layout: default 0; search probes: default 15, --quick 10)",
    )
    one.add_argument(
        "--max-inflight",
        type=int,
        default=None,
        help="the gateway's tier admission limit (gateway TierConfig.max_inflight; default 256)",
    )
    one.add_argument(
        "--contention",
        type=float,
        default=None,
        help="CPU node kinds: the contention the nodes ran at during the run (sim/procstat.py's "
        "stretch of their step threads, as sim.validate records it); the profile is scaled from "
        "its own",
    )
    one.add_argument(
        "--one-host",
        action="store_true",
        help="CPU node kinds: every node runs on this one machine (sim.validate's clusters); steps "
        "that overlap another node's are stretched by the profile's co-run factors",
    )
    one.add_argument("--slo", default=None, help="ttft_p90=MS,e2e_p90=MS,itl_p99=MS,tpot_p50=MS")
    p.set_defaults(func=run)


def parse_layout(
    spec: str,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    one_host: bool = False,
):
    from protocol.cluster import Role
    from sim.cluster import Layout, NodeGroup

    roles: dict[str, Role] = {"C": "both", "P": "prefill", "D": "decode"}
    parts = re.findall(r"(\d+)\s*([CPDcpd])", spec)
    if not parts or re.sub(r"[\d\sCPDcpd+,]", "", spec):
        raise ValueError(f"cannot read --layout {spec!r}: use e.g. 1C, 2C, 1P+1D, 2P+3D")
    groups = tuple(NodeGroup(roles[r.upper()], int(n)) for n, r in parts)
    if any(g.count < 1 for g in groups) or not any(g.role in ("both", "decode") for g in groups):
        raise ValueError(f"--layout {spec!r} has no node that decodes")
    return Layout(
        groups,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        one_host=one_host,
    )


def parse_slo(spec: str | None):
    from sim.stats import SLO

    if not spec:
        return None
    keys = {
        "ttft_p90": "ttft_p90_ms",
        "ttft_p99": "ttft_p99_ms",
        "tpot_p50": "tpot_p50_ms",
        "itl_p99": "itl_p99_ms",
        "e2e_p90": "e2e_p90_ms",
    }
    kw = {}
    for part in filter(None, spec.split(",")):
        k, _, v = part.partition("=")
        if k not in keys:
            raise ValueError(f"cannot read --slo {spec!r}: keys are {', '.join(keys)}")
        kw[keys[k]] = float(v)
    return SLO(**kw)


def run(args: argparse.Namespace) -> int:

    try:
        return _one(args) if args.layout else _plan(args)
    except ValueError as e:
        raise UsageError(str(e)) from None


# -- one layout --------------------------------------------------------------------------------
def _one(a: argparse.Namespace) -> int:
    from sim import profile as pf
    from sim import workload as wl
    from sim.run import simulate

    if len(a.profile) != 1:
        raise ValueError("--layout needs exactly one --profile")
    prof = pf.load(Path(a.profile[0]))
    if a.contention:
        prof = prof.at_contention(a.contention)
    layout = parse_layout(a.layout, a.max_num_seqs, a.max_num_batched_tokens, a.one_host)
    if a.max_inflight:
        from dataclasses import replace

        layout = replace(layout, tiers=replace(layout.tiers, max_inflight=a.max_inflight))
    if a.from_result:
        items = wl.from_result_file(Path(a.from_result))
    elif a.trace:
        items = wl.mooncake(Path(a.trace))
    elif a.rate:
        items = wl.synthetic(
            wl.Synthetic(
                rate=a.rate,
                duration_s=a.duration,
                input_len=a.input_len,
                output_len=a.output_len,
                prefix_groups=a.prefix_groups,
                prefix_len=a.prefix_len,
            )
        )
    else:
        raise ValueError("--layout needs a workload: --from-result, --trace or --rate")
    t0 = time.perf_counter()
    s, c = simulate(
        prof,
        layout,
        items,
        slo=parse_slo(a.slo),
        warmup_s=a.warmup_s,
        node_price_per_hour=a.node_price,
    )
    wall = time.perf_counter() - t0
    out = {
        "layout": layout.label(),
        "profile": prof.kind.name,
        "wall_s": round(wall, 2),
        "simulated_s": round(c.end, 2),
        **msgspec.to_builtins(s),
    }
    if a.json:
        print(json.dumps(out))
        return 0
    lat = s.latency_ms
    print(
        f"{layout.label()} on {prof.kind.name}: {s.completed}/{s.requests} requests, simulated "
        f"{c.end:,.1f} s in {wall:,.1f} s"
    )
    for k in ("ttft", "tpot", "itl", "e2e"):
        print(
            f"  {k.upper():5} ms  p50 {_f(lat.get(f'p50_{k}'))}  p90 {_f(lat.get(f'p90_{k}'))}  "
            f"p99 {_f(lat.get(f'p99_{k}'))}"
        )
    print(
        f"  output throughput {s.output_throughput:,.1f} tok/s, utilisation {_pct(s.utilisation)}, "
        f"paths {s.paths}, KV use mean {s.kv_usage['mean']:.0%} max {s.kv_usage['max']:.0%}, node "
        f"queue max {s.queue['nodes_max']:.0f}"
    )
    if s.failures:
        print(f"  failed: {s.failures}")
    if s.meets_slo is not None:
        print(
            f"  SLO: {'met' if s.meets_slo else 'missed: ' + '; '.join(s.violations)}; goodput "
            f"{s.goodput:.2f} req/s"
        )
    return 0


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _pct(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0%}" for k, v in d.items())


# -- the search --------------------------------------------------------------------------------
def _gpu_price(
    prof: Profile, table: PriceTable, override: float | None
) -> list[tuple[str, float, str]]:
    """[(label, $/GPU-hour or $/node-hour for CPU kinds, source)] for this node kind."""
    if override is not None:
        return [("--node-price", override / max(prof.kind.gpus, 1), "given on the command line")]
    out = [
        (
            f"{g.provider} {g.gpu} ${g.usd_per_gpu_hour:.2f}/GPU-h",
            g.usd_per_gpu_hour,
            f"{g.url or 'assumption'} ({g.as_of}){': ' + g.note if g.note else ''}",
        )
        for g in table.gpus
        if g.gpu in prof.kind.device
    ]
    if not out:
        raise ValueError(
            f"no GPU price for {prof.kind.name} ({prof.kind.device}) in the price table: give "
            "--node-price"
        )
    return out


def _plan(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from sim import plan as pl
    from sim import plots
    from sim import prices as pr
    from sim import profile as pf

    t_start = time.perf_counter()
    console = Console(stderr=a.json, width=max(Console().width, 140))
    sc = pl.load_scenario(Path(a.scenario) if a.scenario else DEFAULT_SCENARIO)
    profiles = [pf.load(Path(p)) for p in (a.profile or DEFAULT_PROFILES)]
    table = pr.load(Path(a.prices))
    cfg = pl.SearchConfig(
        measure_s=a.measure_s or (30.0 if a.quick else 45.0),
        warmup_s=a.warmup_s or (10.0 if a.quick else 15.0),
        iterations=3 if a.quick else 4,
    )
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    i_tok, o_tok = sc.mean_tokens()
    console.print(f"[bold]duet plan[/]: {sc.name}")
    console.print("[bold]assumptions[/]")
    for line in sc.assumptions():
        console.print(f"  - {line}")
    console.print(
        "  - the fleet is built of identical cells; the router spreads load evenly, so a cell at "
        "1/n of the peak behaves as the fleet (each cell simulated with the real scheduler, block "
        "pool, router, admission)"
    )
    console.print(
        "  - simulated: step time from each profile's model, KV transfer = latency + "
        "bytes/bandwidth; not simulated: failures, retries, HTTP beyond the profile's fixed "
        "overheads"
    )
    all_fleets: list[pl.Fleet] = []
    report: dict = {
        "scenario": msgspec.to_builtins(sc),
        "assumptions": sc.assumptions(),
        "peak_rate": sc.peak_rate,
        "mean_tokens": {"input": i_tok, "output": o_tok},
        "profiles": {},
        "prices": msgspec.to_builtins(table),
    }
    cheapest: list[tuple[str, pl.Fleet, str]] = []
    best_caps: dict[str, pl.Capacity] = {}
    for prof in profiles:
        console.print(f"\n[bold]{prof.kind.name}[/] ({prof.kind.device}); profile notes:")
        for n in prof.notes:
            console.print(f"  - {n}")
        for s in prof.sources:
            console.print(
                f"  - source: {s.what}: {s.value} — {s.url}{' (' + s.note + ')' if s.note else ''}"
            )
        t0 = time.perf_counter()

        def progress(c: pl.Capacity, t0: float = t0) -> None:
            relaxed = sum(1 for r in c.relaxed if all(r[2] is not p.summary for p in c.probes))
            console.print(
                f"  [{time.perf_counter() - t0:5.0f} s] {c.variant.label():28} {c.rate:7.2f} req/s "
                f"per cell ({len(c.probes) + relaxed} simulations)"
            )

        caps = pl.search(prof, sc, cfg, quick=a.quick, jobs=a.jobs, progress=progress)
        t = Table(title=f"{prof.kind.name}: most load per cell within the SLOs")
        for col in (
            "layout (cell)",
            "req/s per cell",
            "req/s per node",
            "TTFT p90",
            "ITL p99",
            "E2E p90",
            "TPOT p50",
            "utilisation",
            "KV max",
        ):
            t.add_column(col, justify="right")
        for c in caps:
            at = c.at_capacity
            if at is None:
                t.add_row(c.variant.label(), "none", "-", "-", "-", "-", "-", "-", "-")
                continue
            lat = at.latency_ms
            t.add_row(
                c.variant.label(),
                f"{c.rate:.2f}",
                f"{c.rate / c.variant.nodes:.2f}",
                _f(lat["p90_ttft"]),
                _f(lat["p99_itl"]),
                _f(lat["p90_e2e"]),
                _f(lat["p50_tpot"]),
                _pct(at.utilisation),
                f"{at.kv_usage['max']:.0%}",
            )
        console.print(t)
        report["profiles"][prof.kind.name] = {
            "capacities": [
                {
                    "variant": c.variant.label(),
                    "cell_nodes": c.variant.nodes,
                    "rate": c.rate,
                    "at_capacity": msgspec.to_builtins(c.at_capacity),
                    "probes": [
                        {
                            "rate": p.rate,
                            "meets_slo": p.summary.meets_slo,
                            "violations": p.summary.violations,
                        }
                        for p in c.probes
                    ],
                }
                for c in caps
            ],
            "search_s": time.perf_counter() - t0,
        }
        for label, price, source in _gpu_price(prof, table, a.node_price):
            fl = pl.fleets(prof, caps, sc.peak_rate, price)
            for f in fl:
                f.profile = f"{prof.kind.name} @ {label}"
            all_fleets += fl
            ok = [f for f in fl if f.summary.meets_slo and f.factor == 1.0]
            if ok:
                best = min(ok, key=lambda f: f.usd_per_hour)
                cheapest.append((label, best, source))
        ok_caps = [c for c in caps if c.rate > 0]
        if ok_caps:
            best_caps[prof.kind.name] = max(ok_caps, key=lambda c: c.rate / c.variant.nodes)
    # -- answers ---------------------------------------------------------------------------
    console.print(
        "\n[bold]cheapest fleet meeting the SLOs at the peak[/] "
        f"({sc.peak_rate:,.1f} req/s; {i_tok:,.0f} in + {o_tok:,.0f} out tokens a request)"
    )
    t = Table()
    for col in (
        "node kind @ GPU price",
        "layout",
        "cells",
        "nodes",
        "GPUs",
        "$/hour",
        "TTFT p90",
        "E2E p90",
        "ITL p99",
        "$/1M tok at peak",
        f"$/1M tok at {sc.day_utilisation:.0%}",
    ):
        t.add_column(col, justify="right")
    for _label, f, _ in cheapest:
        lat = f.summary.latency_ms
        t.add_row(
            f.profile,
            f.variant,
            str(f.cells),
            str(f.nodes),
            str(f.gpus),
            f"{f.usd_per_hour:,.0f}",
            _f(lat["p90_ttft"]),
            _f(lat["p90_e2e"]),
            _f(lat["p99_itl"]),
            f"{f.usd_per_m_tokens(1.0, i_tok + o_tok):.3f}",
            f"{f.usd_per_m_tokens(sc.day_utilisation, i_tok + o_tok):.3f}",
        )
    console.print(t)
    front = pl.pareto(all_fleets)
    console.print(
        "\n[bold]Pareto front: fleet cost vs TTFT P90[/] (fleets of each variant at its minimum "
        "size "
        "and at the passing probes' lower cell rates)"
    )
    for f in front:
        console.print(
            f"  ${f.usd_per_hour:8,.0f}/h  TTFT p90 {_f(f.summary.latency_ms['p90_ttft']):>8} ms  "
            f"{f.profile}: "
            f"{f.cells} × [{f.variant}] ({f.nodes} nodes)"
        )
    console.print(
        f"\n[bold]against commercial APIs[/] (price table {table.as_of}; required saving "
        f"{sc.required_saving:.0%}; a request costs the API its {i_tok:,.0f} input + {o_tok:,.0f} "
        "output tokens at list price)"
    )
    t = Table()
    for col in (
        "self-hosted",
        "vs model",
        "API $/1M tok (blended)",
        f"self $/1M at {sc.day_utilisation:.0%}",
        f"saving at {sc.day_utilisation:.0%}",
        "saving at 100%",
        f"≥{sc.required_saving:.0%} saving needs utilisation ≥",
    ):
        t.add_column(col, justify="right")
    comparisons: list[dict[str, Any]] = []
    for _label, f, source in cheapest:
        for cp in table.commercial:
            api = cp.cost(i_tok, o_tok) / (i_tok + o_tok) * 1e6
            self_day = f.usd_per_m_tokens(sc.day_utilisation, i_tok + o_tok)
            self_peak = f.usd_per_m_tokens(1.0, i_tok + o_tok)
            need = self_peak / (api * (1 - sc.required_saving))
            comparisons.append(
                {
                    "self_hosted": f.profile,
                    "layout": f.variant,
                    "gpu_price_source": source,
                    "model": cp.model,
                    "api_usd_per_m": api,
                    "self_usd_per_m_day": self_day,
                    "self_usd_per_m_peak": self_peak,
                    "saving_day": 1 - self_day / api,
                    "saving_peak": 1 - self_peak / api,
                    "breakeven_utilisation": need,
                }
            )
            t.add_row(
                f.profile,
                cp.model,
                f"{api:.3f}",
                f"{self_day:.3f}",
                f"{1 - self_day / api:+.0%}",
                f"{1 - self_peak / api:+.0%}",
                f"{need:.0%}" if need <= 1 else "never (>100%)",
            )
    console.print(t)
    for label, _f2, source in cheapest:
        console.print(f"  price {label}: {source}")
    for cp in table.commercial:
        console.print(
            f"  price {cp.model}: ${cp.input_per_m}/1M in, ${cp.output_per_m}/1M out — {cp.url} "
            f"({cp.as_of})"
        )
    holds = [c for c in comparisons if c["saving_day"] >= sc.required_saving]
    console.print(
        f"\n[bold]answer[/]: the {sc.required_saving:.0%} saving holds at a "
        f"{sc.day_utilisation:.0%} day utilisation in {len(holds)} of {len(comparisons)} (fleet, "
        "API) pairs: "
        + (", ".join(sorted({f"{c['model']} ({c['self_hosted']})" for c in holds})) or "none")
    )
    # -- files -----------------------------------------------------------------------------
    written = [plots.pareto(all_fleets, front, out_dir / "pareto.png")]
    if cheapest:
        written.append(
            plots.cost_vs_utilisation(
                [(f.profile, f) for _, f, _ in cheapest],
                table.commercial,
                (i_tok, o_tok),
                sc.required_saving,
                out_dir / "cost_vs_utilisation.png",
            )
        )
        written += _timeline_plot(cheapest[0][1], profiles, best_caps, sc, cfg, out_dir)
    report.update(
        {
            "cheapest": [
                {"gpu_price": label, "source": src, **_fleet_dict(f)} for label, f, src in cheapest
            ],
            "pareto": [_fleet_dict(f) for f in front],
            "fleets": [_fleet_dict(f) for f in all_fleets],
            "comparisons": comparisons,
            "wall_s": time.perf_counter() - t_start,
        }
    )
    (out_dir / "plan.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    console.print(
        f"\nwrote {out_dir / 'plan.json'}, "
        + ", ".join(str(p) for p in written)
        + f" in {time.perf_counter() - t_start:,.0f} s"
    )
    if a.json:
        print(json.dumps(report, default=str))
    return 0


def _fleet_dict(f: Fleet) -> dict[str, Any]:
    return {
        "profile": f.profile,
        "layout": f.variant,
        "cells": f.cells,
        "nodes": f.nodes,
        "gpus": f.gpus,
        "cell_rate": f.cell_rate,
        "usd_per_hour": f.usd_per_hour,
        "size_factor": f.factor,
        "latency_ms": f.summary.latency_ms,
        "utilisation": f.summary.utilisation,
        "kv_usage": f.summary.kv_usage,
        "queue": f.summary.queue,
    }


def _timeline_plot(
    f: Fleet,
    profiles: list[Profile],
    caps: dict[str, Capacity],
    sc: Scenario,
    cfg: SearchConfig,
    out_dir: Path,
) -> list[Path]:
    """Queue depth and KV use of the cheapest fleet's cell at its capacity."""
    from sim import plots
    from sim.run import simulate
    from sim.stats import timeline
    from sim.workload import synthetic

    name = f.profile.split(" @ ")[0]
    prof = next((p for p in profiles if p.kind.name == name), None)
    cap = caps.get(name)
    if prof is None or cap is None or not math.isfinite(cap.rate):
        return []
    _, c = simulate(
        prof,
        cap.variant.layout(),
        synthetic(sc.workload(cap.rate, cfg.warmup_s + cfg.measure_s, cfg.seed)),
    )
    return [
        plots.timeline(
            timeline(c),
            f"{name}: one cell [{cap.variant.label()}] at {cap.rate:.2f} req/s",
            out_dir / "timeline.png",
        )
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet")
    sub = p.add_subparsers()
    add_parser(sub)
    a = p.parse_args(["plan", *(argv or sys.argv[1:])])
    return run(a)
