"""`python -m bench.probes.prefill_profile --schemes none,int8,int8-w8a8`: where a 512-token prefill
(bench.engine_tiers' W1) spends its time, per scheme, under cProfile.

The schemes' engines are built as bench.engine_tiers builds them and their prefills interleave,
one of each in turn, so the machine's drift moves them alike. The kernels are ctypes calls, so
their time shows under the Python function that calls them (Linear._own, QLinear._kernel,
attention's paged_attention, ...)."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random

from bench.engine_runs import prefill_once
from bench.engine_tiers import _engine, parse_args
from bench.flops import ModelShape


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--schemes", default="none,int8,int8-w8a8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--top", type=int, default=12, help="functions listed per scheme, by own time")
    args = p.parse_args()
    schemes = args.schemes.split(",")
    eargs = parse_args(["--threads", str(args.threads)])
    engines = {s: _engine(eargs, s) for s in schemes}
    shape = ModelShape.of(next(iter(engines.values())).model_config)
    profiles = {s: cProfile.Profile() for s in schemes}
    seconds = dict.fromkeys(schemes, 0.0)
    rng = random.Random(0)
    for eng in engines.values():
        prefill_once(eng, shape, 512, rng, "warm")
    for rep in range(args.reps):
        for s, eng in engines.items():
            profiles[s].enable()
            seconds[s] += prefill_once(eng, shape, 512, rng, f"r{rep}")
            profiles[s].disable()
    for s in schemes:
        print(
            f"==== {s}: {seconds[s] / args.reps * 1000:.1f} ms a prefill (totals below are over "
            f"{args.reps})"
        )
        buf = io.StringIO()
        pstats.Stats(profiles[s], stream=buf).sort_stats("tottime").print_stats(args.top)
        print(buf.getvalue())


if __name__ == "__main__":
    main()
