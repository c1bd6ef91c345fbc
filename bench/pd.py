"""`python -m bench.pd` (also `duet bench pd`): where TTFT goes, disaggregated vs colocated.

Starts real node processes on this machine: a prefill node pinned to one set of cores and a
decode node pinned to another (P → D over the chosen transport), then a colocated node
(`--role both`) on the union of those cores. For each prompt length it sends sequential
requests with fresh random prompts (no prefix-cache hits) and breaks the time to first token
into the nodes' own measurements:

  P queue + P prefill + transfer (incl. D's reservation queue) + D first decode step + rest
  (HTTP hops, the client's two legs, SSE)

and, colocated, queue + prefill. Medians over --reps requests; one JSON object with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from bench.pd_client import Result, completion, disaggregated
from bench.procs import duet_node, running
from protocol.models import DEFAULT_MODEL, resolve_model
from protocol.tokenizer import Tokenizer


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.pd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--lengths", default="128,512,1024", help="prompt lengths in tokens")
    p.add_argument("--reps", type=int, default=5, help="requests per length and mode")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--transport", default="nixl", choices=["nixl", "ucx", "tcp"])
    p.add_argument("--p-cpus", default=None, help="cores for the prefill node (default: first half)")
    p.add_argument("--d-cpus", default=None, help="cores for the decode node (default: second half)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def _halves() -> tuple[str, str]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return str(cpus[0]), str(cpus[0])
    mid = len(cpus) // 2
    return ",".join(map(str, cpus[:mid])), ",".join(map(str, cpus[mid:]))


def _count(spec: str) -> int:
    return len(spec.split(","))


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(100, vocab - 1) for _ in range(n)]


async def _measure(send: Any, lengths: list[int], reps: int, vocab: int, params: dict[str, Any],
                   seed: int) -> dict[int, list[Result]]:  # fmt: skip
    rng = random.Random(seed)
    out: dict[int, list[Result]] = {}
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # warm-up: first-touch allocations, kernel load, peer handshake
            await send(s, _prompt(rng, vocab, 64), params)
        for n in lengths:
            rs = []
            for _ in range(reps):
                r = await send(s, _prompt(rng, vocab, n), params)
                if r.error:
                    raise RuntimeError(f"request failed: {r.error}")
                rs.append(r)
            out[n] = rs
            print(f"  {n} tokens: median TTFT {_med([r.ttft or 0 for r in rs]) * 1e3:.1f} ms", file=sys.stderr)
    return out


def _tpot(r: Result, max_tokens: int) -> float:
    return (r.latency - (r.ttft or 0)) / max(1, max_tokens - 1)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    ref = resolve_model(args.model)
    vocab = Tokenizer(ref.directory).vocab_size
    p_cpus, d_cpus = args.p_cpus or _halves()[0], args.d_cpus or _halves()[1]
    both_cpus = ",".join(sorted(set(p_cpus.split(",")) | set(d_cpus.split(",")), key=int))
    params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    ctx = str(max(lengths) + args.max_tokens + 64)
    common = ("--dtype", args.dtype, "--max-model-len", ctx, "--kv-memory", "512MiB",
              "--transport", args.transport, "--max-num-batched-tokens", "1024")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-pd-") as tmp:
        logs = Path(tmp)
        print(f"disaggregated: P on cpus {p_cpus}, D on cpus {d_cpus}", file=sys.stderr)
        p = duet_node("prefill", args.model, logs, *common, "--cpus", p_cpus, threads=_count(p_cpus))
        d = duet_node("decode", args.model, logs, *common, "--cpus", d_cpus, threads=_count(d_cpus))
        with running(p, d):
            pd = asyncio.run(_measure(lambda s, x, prm: disaggregated(s, p.url, d.url, x, prm),
                                      lengths, args.reps, vocab, params, seed=1))  # fmt: skip
            transport_line = next((ln for ln in d.log().splitlines() if "transport" in ln.lower()), "")
        print(f"colocated: one node on cpus {both_cpus}", file=sys.stderr)
        c = duet_node("both", args.model, logs, *common, "--cpus", both_cpus, threads=_count(both_cpus))
        with running(c):
            co = asyncio.run(_measure(lambda s, x, prm: completion(s, c.url, x, prm),
                                      lengths, args.reps, vocab, params, seed=1))  # fmt: skip
    report: dict[str, Any] = {
        "model": ref.name, "dtype": args.dtype, "transport": args.transport, "reps": args.reps,
        "max_tokens": args.max_tokens, "prefill_cpus": p_cpus, "decode_cpus": d_cpus,
        "colocated_cpus": both_cpus, "transport_log": transport_line.strip()[-160:], "lengths": {},
    }  # fmt: skip
    for n in lengths:
        rs, cs = pd[n], co[n]
        ttft = _med([r.ttft or 0 for r in rs])
        row = {
            "disaggregated": {
                "ttft_ms": ttft * 1e3,
                "p_queue_ms": _med([r.prefill_timing.get("queue_s", 0) for r in rs]) * 1e3,
                "p_prefill_ms": _med([r.prefill_timing.get("prefill_s", 0) for r in rs]) * 1e3,
                "transfer_ms": _med([r.timing.get("queue_s", 0) + r.timing.get("transfer_s", 0) for r in rs]) * 1e3,
                "d_first_decode_ms": _med([r.timing.get("first_decode_s", 0) for r in rs]) * 1e3,
                "tpot_ms": _med([_tpot(r, args.max_tokens) for r in rs]) * 1e3,
            },
            "colocated": {
                "ttft_ms": _med([r.ttft or 0 for r in cs]) * 1e3,
                "queue_ms": _med([r.timing.get("queue_s", 0) for r in cs]) * 1e3,
                "prefill_ms": _med([r.timing.get("prefill_s", 0) for r in cs]) * 1e3,
                "tpot_ms": _med([_tpot(r, args.max_tokens) for r in cs]) * 1e3,
            },
        }
        dis = row["disaggregated"]
        dis["other_ms"] = dis["ttft_ms"] - dis["p_queue_ms"] - dis["p_prefill_ms"] - dis["transfer_ms"] - dis["d_first_decode_ms"]
        row["ttft_ratio_disagg_over_colocated"] = dis["ttft_ms"] / max(row["colocated"]["ttft_ms"], 1e-9)
        report["lengths"][str(n)] = row
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _table(report)
    return 0


def _table(rep: dict[str, Any]) -> None:
    print(f"model {rep['model']}  transport {rep['transport']}  P cpus {rep['prefill_cpus']}  "
          f"D cpus {rep['decode_cpus']}  medians of {rep['reps']} (ms)")  # fmt: skip
    print(f"{'tokens':>6} | {'TTFT':>7} {'P queue':>7} {'prefill':>7} {'xfer':>7} {'1st dec':>7} "
          f"{'other':>6} {'TPOT':>6} | {'colo TTFT':>9} {'prefill':>7} {'TPOT':>6} | ratio")  # fmt: skip
    for n, row in rep["lengths"].items():
        d, c = row["disaggregated"], row["colocated"]
        print(f"{n:>6} | {d['ttft_ms']:7.1f} {d['p_queue_ms']:7.1f} {d['p_prefill_ms']:7.1f} "
              f"{d['transfer_ms']:7.1f} {d['d_first_decode_ms']:7.1f} {d['other_ms']:6.1f} "
              f"{d['tpot_ms']:6.1f} | {c['ttft_ms']:9.1f} {c['prefill_ms']:7.1f} {c['tpot_ms']:6.1f} | "
              f"{row['ttft_ratio_disagg_over_colocated']:.2f}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
