"""`python -m bench.pd --mix long-prompt` (also `python -m bench.pd_mix`): inter-token latency
of a colocated node while long prompts arrive — the fixed token budget against
`--itl-target-ms`, in one run.

One colocated node (`duet node --role both`) on the given cores serves, per mode:
- `--streams` decode streams, each a loop of short prompts generating `--decode-tokens` tokens
  (ignore_eos), the traffic whose inter-token latency (ITL) the target protects;
- `--long-count` long prompts of `--long-len` tokens, one at a time, `--long-gap` seconds apart,
  the traffic whose time to first token (TTFT) the target may cost.
ITL = the gap between consecutive tokens of one decode request (the first token, a TTFT, is not
one), counted while the long prompts run (first sent → last answered). Every prompt is fresh
random tokens (no prefix-cache hits); both modes get the same prompts (same seed). Modes
alternate over `--rounds` node starts (fixed, target, fixed, target, ...), each node warmed up
first (a short and a long prompt) and stopped after.

The machine is shared, so beside wall-clock figures each mode reports the node process's CPU
seconds over its window and the load average before and after; the comparison is the ratio of
the two modes' figures within this one run. One JSON object with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.pd_client import Result, completion
from bench.procs import Proc, duet_node, running
from bench.stats import percentile, spread
from runtime.cluster_secret import read_secret_file, write_secret_file
from runtime.models import DEFAULT_MODEL, resolve_model
from text.tokenizer import Tokenizer

MIXES = ("long-prompt",)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.pd --mix long-prompt",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--mix", choices=MIXES, default="long-prompt", help="the workload (default long-prompt)"
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--cpus",
        default=None,
        help="cores of the colocated node (default: all this process may use)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the node (default: one per core)",
    )
    p.add_argument(
        "--itl-target-ms",
        type=float,
        default=100.0,
        help="the target mode's --itl-target-ms (default 100)",
    )
    p.add_argument(
        "--budget",
        type=int,
        default=512,
        help="--max-num-batched-tokens of both modes (default 512)",
    )
    p.add_argument(
        "--streams", type=int, default=None, help="concurrent decode streams (default 4; quick 2)"
    )
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=None,
        help="tokens per decode request (default 64; quick 16)",
    )
    p.add_argument(
        "--long-len",
        type=int,
        default=None,
        help="long prompt length in tokens (default 1536; quick 256)",
    )
    p.add_argument(
        "--long-count",
        type=int,
        default=None,
        help="long prompts per mode and round (default 6; quick 2)",
    )
    p.add_argument(
        "--long-gap",
        type=float,
        default=1.0,
        help="seconds between a long prompt's answer and the next",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="node starts per mode, alternating (default 1)"
    )
    p.add_argument("--kv-memory", default="512MiB", help="KV pool of the node (default 512MiB)")
    p.add_argument(
        "--quick", action="store_true", help="small sizes: a smoke test, not a measurement"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    preset = (
        {"streams": 2, "decode_tokens": 16, "long_len": 256, "long_count": 2}
        if a.quick
        else {"streams": 4, "decode_tokens": 64, "long_len": 1536, "long_count": 6}
    )
    for k, v in preset.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be >= 1")
    if min(a.streams, a.long_count, a.rounds) < 1 or a.decode_tokens < 2 or a.long_len < 2:
        p.error(
            "--streams, --long-count and --rounds must be >= 1; --decode-tokens and --long-len >= 2"
        )
    if not a.itl_target_ms > 0 or a.long_gap < 0:
        p.error("--itl-target-ms must be positive and --long-gap >= 0")
    return a


@dataclass
class Window:
    """What one mode measured on one node start."""

    itl: list[float] = field(default_factory=list)  # seconds
    long_ttft: list[float] = field(default_factory=list)  # seconds
    node_cpu_s: float = 0.0
    wall_s: float = 0.0
    decode_tokens: int = 0
    load: tuple[float, float] = (0.0, 0.0)


def gaps_within(r: Result, t0: float, t1: float) -> list[float]:
    """Inter-token gaps of one request whose later token arrived in [t0, t1]."""
    ts = r.token_times
    return [b - a for a, b in itertools.pairwise(ts) if t0 <= b <= t1]


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(100, vocab - 1) for _ in range(n)]


async def _mix(
    node: Proc, a: argparse.Namespace, vocab: int, headers: dict[str, str], seed: int
) -> Window:
    rng = random.Random(seed)
    decode_params = {"max_tokens": a.decode_tokens, "temperature": 0, "ignore_eos": True}
    long_params = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    out = Window()
    done: list[Result] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(headers=headers) as s:

        async def call(prompt: list[int], params: dict[str, Any]) -> Result:
            r = await completion(s, node.url, prompt, params)
            if r.error or r.ttft is None:
                raise RuntimeError(f"request {r.request_id} failed: {r.error or 'no token'}")
            return r

        # warm-up: first-touch allocations and kernels at both shapes (and, with a target, the
        # step model's first samples)
        await call(_prompt(rng, vocab, 32), decode_params)
        await call(_prompt(rng, vocab, a.long_len), long_params)
        prompts = [_prompt(rng, vocab, a.long_len) for _ in range(a.long_count)]
        short = random.Random(seed + 1)

        async def stream() -> None:
            while not stop.is_set():
                done.append(
                    await call(_prompt(short, vocab, short.randrange(16, 64)), decode_params)
                )

        streams = [asyncio.create_task(stream()) for _ in range(a.streams)]
        await asyncio.sleep(
            0.5 + a.long_gap
        )  # the decode batch is running before the first long prompt
        load0, cpu0, t0 = os.getloadavg()[0], proc_cpu_seconds(node.proc.pid), time.perf_counter()
        for i, p in enumerate(prompts):
            if i:
                await asyncio.sleep(a.long_gap)
            r = await call(p, long_params)
            assert r.ttft is not None  # call() raised on a result without a first token
            out.long_ttft.append(r.ttft)
            print(
                f"  long prompt {i + 1}/{len(prompts)}: TTFT {r.ttft * 1e3:.0f} ms", file=sys.stderr
            )
        t1, cpu1 = time.perf_counter(), proc_cpu_seconds(node.proc.pid)
        stop.set()
        await asyncio.gather(*streams)
    for r in done:
        out.itl.extend(gaps_within(r, t0, t1))
        out.decode_tokens += sum(1 for t in r.token_times if t0 <= t <= t1)
    out.node_cpu_s, out.wall_s, out.load = cpu1 - cpu0, t1 - t0, (load0, os.getloadavg()[0])
    if not out.itl:
        raise RuntimeError(
            "no inter-token gap fell inside the window: the decode streams produced nothing"
        )
    return out


def summary(ws: list[Window], cpus: int = 1) -> dict[str, Any]:
    """Pooled figures of a mode's windows; `node_cpu_of_its_cores`: the node's CPU time over
    (wall × its cores), 1.0 when it had them to itself — what the machine's load left it."""
    itl = [x for w in ws for x in w.itl]
    ttft = [x for w in ws for x in w.long_ttft]
    cpu, wall = sum(w.node_cpu_s for w in ws), sum(w.wall_s for w in ws)
    return {
        "itl_ms": {
            "p50": percentile(itl, 0.5) * 1e3,
            "p90": percentile(itl, 0.9) * 1e3,
            "p99": percentile(itl, 0.99) * 1e3,
            "max": max(itl) * 1e3,
            "n": len(itl),
        },
        "long_ttft_ms": {k: (v * 1e3 if k != "n" else v) for k, v in spread(ttft).items()},
        "node_cpu_s": cpu,
        "wall_s": wall,
        "node_cpu_share": cpu / wall,
        "node_cpu_of_its_cores": cpu / wall / cpus,
        "decode_tokens": sum(w.decode_tokens for w in ws),
        "node_cpu_ms_per_decode_token": cpu / max(1, sum(w.decode_tokens for w in ws)) * 1e3,
        "load_avg_1m": [list(w.load) for w in ws],
    }


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    ref = resolve_model(a.model)
    vocab = Tokenizer(ref.directory).vocab_size
    cpus = a.cpus or ",".join(map(str, sorted(os.sched_getaffinity(0))))
    cores = len(cpus.split(","))
    threads = a.threads or cores
    modes = {"fixed": (), "itl_target": ("--itl-target-ms", str(a.itl_target_ms))}
    results: dict[str, list[Window]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="bench-pd-mix-") as tmp:
        logs = Path(tmp)
        secret = logs / "cluster.secret"
        write_secret_file(secret, secrets.token_urlsafe(32))
        headers = read_secret_file(secret).headers
        common = (
            "--dtype",
            a.dtype,
            "--max-model-len",
            str(a.long_len + 128),
            "--kv-memory",
            a.kv_memory,
            "--max-num-batched-tokens",
            str(a.budget),
            "--cpus",
            cpus,
            "--cluster-secret-file",
            str(secret),
        )
        for rnd in range(a.rounds):
            for mode, extra in modes.items():
                print(
                    f"round {rnd + 1}/{a.rounds}, {mode}: colocated node on cpus {cpus}",
                    file=sys.stderr,
                )
                node = duet_node("both", a.model, logs, *common, *extra, threads=threads)
                with running(node):
                    results[mode].append(asyncio.run(_mix(node, a, vocab, headers, seed=rnd)))
    fixed, target = summary(results["fixed"], cores), summary(results["itl_target"], cores)
    report: dict[str, Any] = {
        "mix": a.mix,
        "model": ref.name,
        "dtype": a.dtype,
        "cpus": cpus,
        "threads": threads,
        "budget": a.budget,
        "itl_target_ms": a.itl_target_ms,
        "streams": a.streams,
        "decode_tokens": a.decode_tokens,
        "long_len": a.long_len,
        "long_count": a.long_count,
        "long_gap_s": a.long_gap,
        "rounds": a.rounds,
        "quick": a.quick,
        "fixed": fixed,
        "itl_target": target,
        "ratios_target_over_fixed": {
            "itl_p99": target["itl_ms"]["p99"] / fixed["itl_ms"]["p99"],
            "itl_p50": target["itl_ms"]["p50"] / fixed["itl_ms"]["p50"],
            "long_ttft_median": target["long_ttft_ms"]["median"] / fixed["long_ttft_ms"]["median"],
            "node_cpu_ms_per_decode_token": (
                target["node_cpu_ms_per_decode_token"] / fixed["node_cpu_ms_per_decode_token"]
            ),
        },
    }
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        _table(report)
    return 0


def _table(rep: dict[str, Any]) -> None:
    print(
        f"model {rep['model']}  cpus {rep['cpus']} ({rep['threads']} threads)  {rep['streams']} "
        f"decode streams, {rep['long_count']} × {rep['long_len']}-token prompts per round, "
        f"{rep['rounds']} round(s)"
    )
    print(
        f"{'mode':>18} | {'ITL p50':>7} {'p90':>7} {'p99':>7} {'max':>7} | {'long TTFT':>9} "
        f"{'p90':>7} | {'node CPU s':>10} {'wall s':>7} {'of cores':>8} {'CPU ms/tok':>10} | load "
        "1m"
    )
    for name, key in (
        ("fixed budget", "fixed"),
        (f"itl-target {rep['itl_target_ms']:g} ms", "itl_target"),
    ):
        r = rep[key]
        i, t = r["itl_ms"], r["long_ttft_ms"]
        loads = ", ".join(f"{a:.1f}→{b:.1f}" for a, b in r["load_avg_1m"])
        print(
            f"{name:>18} | {i['p50']:7.1f} {i['p90']:7.1f} {i['p99']:7.1f} {i['max']:7.1f} | "
            f"{t['median']:9.1f} {t['p90']:7.1f} | {r['node_cpu_s']:10.1f} {r['wall_s']:7.1f} "
            f"{r['node_cpu_of_its_cores']:8.2f} {r['node_cpu_ms_per_decode_token']:10.1f} | {loads}"
        )
    q = rep["ratios_target_over_fixed"]
    print(
        f"target / fixed: ITL p99 {q['itl_p99']:.2f}, ITL p50 {q['itl_p50']:.2f}, long TTFT "
        f"{q['long_ttft_median']:.2f}, node CPU per decode token "
        f"{q['node_cpu_ms_per_decode_token']:.2f}  (ms; ITL over the long prompts' window)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
