"""`duet bench ...`: runs the benchmarks of `bench/` (each also `python -m bench.<name>`)."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "engine": "engine throughput vs transformers (bench.engine)",
    "kvtransfer": "KV block transfer bandwidth per backend vs memcpy (bench.kvtransfer)",
    "pd": "TTFT breakdown, disaggregated vs colocated (bench.pd)",
    "serve": "load-test an OpenAI-compatible URL: TTFT/TPOT/ITL, goodput, sweeps (bench.serve)",
    "compare": "side-by-side table of two `bench serve` JSON results (bench.compare)",
    "chaos": "mixed load on a duet up while SIGKILLing its processes: availability, recovery "
    "(bench.chaos)",
    "fairness": "a team flooding a tier beside a steady one: fair shares vs first come first "
    "served (bench.fairness)",
    "profile": "measure a node kind's step time, KV bytes and transport; write its profile JSON "
    "(bench.profile)",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: engine, kvtransfer, pd, serve, compare, chaos, fairness, profile",
        description="Run a benchmark; arguments after the name go to it "
        "(e.g. `duet bench serve --base-url URL`). See `duet bench NAME --help`.",
    )
    p.add_argument(
        "name", choices=sorted(BENCHES), help="; ".join(f"{k}: {v}" for k, v in BENCHES.items())
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        mod = importlib.import_module(f"bench.{args.name}")
    except ModuleNotFoundError as e:
        if e.name == f"bench.{args.name}":
            print(f"duet bench {args.name}: not implemented yet", flush=True)
            return 2
        raise
    return int(mod.main(args.args) or 0)
