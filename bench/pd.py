"""`python -m bench.pd` (also `duet bench pd`): where TTFT goes, disaggregated vs colocated.

Starts real node processes on this machine: a prefill node pinned to one set of cores and a
decode node pinned to another (P → D over the chosen transport), then a colocated node
(`--role both`) on the union of those cores. For each prompt length it sends sequential
requests with fresh random prompts (no prefix-cache hits) and breaks the time to first token
into the nodes' own measurements:

  P queue + P prefill + transfer (incl. D's reservation queue) + D first decode step + rest
  (HTTP hops, the client's two legs, SSE)

and, colocated, queue + prefill. Every figure is a median over --reps requests with p10/p90
beside it; "other" is computed per request (its TTFT less its own parts) before the median,
never as a median less other medians, and the disaggregated/colocated TTFT ratio pairs the
same prompt in both modes. A request without a first token, or a node that does not report a
part, fails the run: nothing is counted as 0. The run also fails when a node runs another
transport than the one asked for, or when D logs a failed pull (a recompute would measure
local prefill, not the transfer). One JSON object with --json.

`--mix long-prompt` runs bench/pd_mix.py instead: one colocated node's inter-token latency while
long prompts arrive, the fixed token budget against `--itl-target-ms` (its own flags:
`python -m bench.pd --mix long-prompt --help`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from bench import pd_mix
from bench.pd_client import Result, completion, disaggregated
from bench.pd_mix import MIXES
from bench.procs import duet_node, running
from bench.stats import spread
from runtime.cluster_secret import read_secret_file, write_secret_file
from runtime.models import DEFAULT_MODEL, resolve_model
from text.tokenizer import Tokenizer


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.pd",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument(
        "--lengths",
        default=None,
        help="prompt lengths in tokens (default 128,512,1024; quick 32,64)",
    )
    p.add_argument(
        "--reps", type=int, default=None, help="requests per length and mode (default 5; quick 3)"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens generated per request (default 16; quick 4)",
    )
    p.add_argument(
        "--kv-memory", default=None, help="KV pool of each node (default 512MiB; quick 64MiB)"
    )
    p.add_argument(
        "--quick", action="store_true", help="small sizes: a smoke test, not a measurement"
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--transport", default="nixl", choices=["nixl", "ucx", "tcp"])
    p.add_argument(
        "--p-cpus", default=None, help="cores for the prefill node (default: first half)"
    )
    p.add_argument(
        "--d-cpus", default=None, help="cores for the decode node (default: second half)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--mix",
        choices=MIXES,
        default=None,
        help="a colocated workload mix instead (bench/pd_mix.py; see --mix long-prompt --help)",
    )
    a = p.parse_args(argv)
    preset = (
        {"lengths": "32,64", "reps": 3, "max_tokens": 4, "kv_memory": "64MiB"}
        if a.quick
        else {"lengths": "128,512,1024", "reps": 5, "max_tokens": 16, "kv_memory": "512MiB"}
    )
    for k, v in preset.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.reps < 1 or a.max_tokens < 2:
        p.error("--reps must be >= 1 and --max-tokens >= 2 (TPOT needs a second token)")
    return a


def _halves() -> tuple[str, str]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return str(cpus[0]), str(cpus[0])
    mid = len(cpus) // 2
    return ",".join(map(str, cpus[:mid])), ",".join(map(str, cpus[mid:]))


def _count(spec: str) -> int:
    return len(spec.split(","))


class MissingFigure(RuntimeError):
    """A request lacks a figure the report needs (no first token, a node's timing part)."""


def ttft(r: Result) -> float:
    if r.ttft is None:
        raise MissingFigure(
            f"request {r.request_id} has no time to first token: its stream sent no token "
            f"(error: {r.error}, finish: {r.finish_reason})"
        )
    return r.ttft


def part(timing: dict[str, float], key: str, r: Result, side: str) -> float:
    if key not in timing:
        raise MissingFigure(
            f"request {r.request_id}: the {side} node did not report timing {key!r} "
            f"(got {sorted(timing)})"
        )
    return timing[key]


def tpot(r: Result, max_tokens: int) -> float:
    if len(r.token_ids) != max_tokens:
        raise MissingFigure(
            f"request {r.request_id} produced {len(r.token_ids)} tokens, not {max_tokens}"
        )
    return (r.latency - ttft(r)) / (max_tokens - 1)


def _ms(xs: list[float]) -> dict[str, float]:
    return {k: v * 1e3 for k, v in spread(xs).items() if k != "n"}


def disaggregated_row(rs: list[Result], max_tokens: int) -> dict[str, dict[str, float]]:
    """Each part per request, then its median and p10/p90 (ms); `other` per request too."""
    parts: dict[str, list[float]] = {
        k: []
        for k in ("ttft", "p_queue", "p_prefill", "transfer", "d_first_decode", "other", "tpot")
    }
    for r in rs:
        x = {
            "ttft": ttft(r),
            "p_queue": part(r.prefill_timing, "queue_s", r, "prefill"),
            "p_prefill": part(r.prefill_timing, "prefill_s", r, "prefill"),
            # D's reservation queue belongs to the transfer: the pull cannot start before it.
            "transfer": part(r.timing, "queue_s", r, "decode")
            + part(r.timing, "transfer_s", r, "decode"),
            "d_first_decode": part(r.timing, "first_decode_s", r, "decode"),
            "tpot": tpot(r, max_tokens),
        }
        x["other"] = x["ttft"] - x["p_queue"] - x["p_prefill"] - x["transfer"] - x["d_first_decode"]
        for k, v in x.items():
            parts[k].append(v)
    return {k: _ms(v) for k, v in parts.items()}


def colocated_row(cs: list[Result], max_tokens: int) -> dict[str, dict[str, float]]:
    parts: dict[str, list[float]] = {"ttft": [], "queue": [], "prefill": [], "tpot": []}
    for r in cs:
        parts["ttft"].append(ttft(r))
        parts["queue"].append(part(r.timing, "queue_s", r, "colocated"))
        parts["prefill"].append(part(r.timing, "prefill_s", r, "colocated"))
        parts["tpot"].append(tpot(r, max_tokens))
    return {k: _ms(v) for k, v in parts.items()}


def paired_ttft(rs: list[Result], cs: list[Result]) -> dict[str, dict[str, float]]:
    """The same prompts in both modes (same seed), compared request by request."""
    return {
        "ratio_disagg_over_colocated": spread(
            [ttft(r) / ttft(c) for r, c in zip(rs, cs, strict=True)]
        ),
        "diff_ms_disagg_minus_colocated": _ms(
            [ttft(r) - ttft(c) for r, c in zip(rs, cs, strict=True)]
        ),
    }


def check_pulls(d_log: str, transport: str, logs: dict[str, str]) -> str:
    """The line naming D's transport; raises if any node runs another one or D recomputed."""
    for role, text in logs.items():
        found = re.findall(r"KV transport: (\w+)", text)
        if found != [transport]:
            raise RuntimeError(
                f"the {role} node runs transport {found or 'unknown'}, not {transport}: "
                "this run would not measure what it says"
            )
    if "KV pull failed" in d_log:
        bad = next(ln for ln in d_log.splitlines() if "KV pull failed" in ln)
        raise RuntimeError(f"the decode node recomputed instead of pulling: {bad.strip()}")
    return next(ln for ln in d_log.splitlines() if "KV transport:" in ln)


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(100, vocab - 1) for _ in range(n)]


async def _measure(
    send: Any,
    lengths: list[int],
    reps: int,
    vocab: int,
    params: dict[str, Any],
    seed: int,
    headers: dict[str, str] | None = None,
) -> dict[int, list[Result]]:
    rng = random.Random(seed)
    out: dict[int, list[Result]] = {}
    async with aiohttp.ClientSession(headers=headers) as s:  # the nodes only: the cluster secret
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
            print(
                f"  {n} tokens: median TTFT {statistics.median(map(ttft, rs)) * 1e3:.1f} ms",
                file=sys.stderr,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(x == "--mix" or x.startswith("--mix=") for x in argv):
        return pd_mix.main(argv)
    args = _args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    ref = resolve_model(args.model)
    vocab = Tokenizer(ref.directory).vocab_size
    p_cpus, d_cpus = args.p_cpus or _halves()[0], args.d_cpus or _halves()[1]
    both_cpus = ",".join(sorted(set(p_cpus.split(",")) | set(d_cpus.split(",")), key=int))
    params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    ctx = str(max(lengths) + args.max_tokens + 64)
    common: tuple[str, ...] = (
        "--dtype",
        args.dtype,
        "--max-model-len",
        ctx,
        "--kv-memory",
        args.kv_memory,
        "--transport",
        args.transport,
        "--max-num-batched-tokens",
        "1024",
    )
    with tempfile.TemporaryDirectory(prefix="bench-pd-") as tmp:
        logs = Path(tmp)
        # The nodes run as a cluster does, behind a cluster secret that this client sends.
        secret = logs / "cluster.secret"
        write_secret_file(secret, secrets.token_urlsafe(32))
        common = (*common, "--cluster-secret-file", str(secret))
        headers = read_secret_file(secret).headers
        print(f"disaggregated: P on cpus {p_cpus}, D on cpus {d_cpus}", file=sys.stderr)
        p = duet_node(
            "prefill", args.model, logs, *common, "--cpus", p_cpus, threads=_count(p_cpus)
        )
        d = duet_node("decode", args.model, logs, *common, "--cpus", d_cpus, threads=_count(d_cpus))
        with running(p, d):
            pd = asyncio.run(
                _measure(
                    lambda s, x, prm: disaggregated(s, p.url, d.url, x, prm),
                    lengths,
                    args.reps,
                    vocab,
                    params,
                    seed=1,
                    headers=headers,
                )
            )
            transport_line = check_pulls(
                d.log(), args.transport, {"prefill": p.log(), "decode": d.log()}
            )
        print(f"colocated: one node on cpus {both_cpus}", file=sys.stderr)
        c = duet_node(
            "both", args.model, logs, *common, "--cpus", both_cpus, threads=_count(both_cpus)
        )
        with running(c):
            co = asyncio.run(
                _measure(
                    lambda s, x, prm: completion(s, c.url, x, prm),
                    lengths,
                    args.reps,
                    vocab,
                    params,
                    seed=1,
                    headers=headers,
                )
            )
    report: dict[str, Any] = {
        "model": ref.name,
        "dtype": args.dtype,
        "transport": args.transport,
        "reps": args.reps,
        "max_tokens": args.max_tokens,
        "quick": args.quick,
        "prefill_cpus": p_cpus,
        "decode_cpus": d_cpus,
        "colocated_cpus": both_cpus,
        "transport_log": transport_line.strip()[-160:],
        "statistic": "per-request figures; median with p10/p90, in ms",
        "lengths": {},
    }
    for n in lengths:
        report["lengths"][str(n)] = {
            "disaggregated": disaggregated_row(pd[n], args.max_tokens),
            "colocated": colocated_row(co[n], args.max_tokens),
            "ttft_paired": paired_ttft(pd[n], co[n]),
        }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _table(report)
    return 0


def _table(rep: dict[str, Any]) -> None:
    print(
        f"model {rep['model']}  transport {rep['transport']}  P cpus {rep['prefill_cpus']}  "
        f"D cpus {rep['decode_cpus']}  per-request medians of {rep['reps']} (ms)"
    )
    print(
        f"{'tokens':>6} | {'TTFT':>7} {'P queue':>7} {'prefill':>7} {'xfer':>7} {'1st dec':>7} "
        f"{'other':>6} {'TPOT':>6} | {'colo TTFT':>9} {'prefill':>7} {'TPOT':>6} | ratio (p10-p90)"
    )
    for n, row in rep["lengths"].items():
        d = {k: v["median"] for k, v in row["disaggregated"].items()}
        c = {k: v["median"] for k, v in row["colocated"].items()}
        ratio = row["ttft_paired"]["ratio_disagg_over_colocated"]
        print(
            f"{n:>6} | {d['ttft']:7.1f} {d['p_queue']:7.1f} {d['p_prefill']:7.1f} "
            f"{d['transfer']:7.1f} {d['d_first_decode']:7.1f} {d['other']:6.1f} "
            f"{d['tpot']:6.1f} | {c['ttft']:9.1f} {c['prefill']:7.1f} {c['tpot']:6.1f} | "
            f"{ratio['median']:.2f} ({ratio['p10']:.2f}-{ratio['p90']:.2f})"
        )
    print(
        "other = per request, TTFT less its parts (HTTP hops, the client's two legs, SSE); xfer "
        "includes D's reservation queue"
    )


if __name__ == "__main__":
    raise SystemExit(main())
