"""`duet bench fairness`: a noisy neighbour against tier admission's fair shares.

Starts a token-echo node (bench.echo_node: the node API, no engine; `--first-token-delay` and
`--token-delay` stand for an engine's prefill and decode) and two `duet gateway`s in front of
it whose interactive tier has `--slots` admission slots: one with fair shares (`[tiers]
fair_share = true`, the default, with its headroom: `--fair-headroom`), one first come first
served (`fair_share = false`, the baseline). Two teams, a and b, of weight 1: each one's fair
share is half the slots. Phases, each `--duration-s` long:

1. capacity — team a alone keeps `--flood` × its fair share of requests outstanding (closed
   loop): the tier's throughput when saturated (tokens/s);
2. b alone — team b sends a steady open-loop load (Poisson, `--b-share` of its fair share of
   that capacity): b's TTFT P90 alone;
3. flood, fair and first come first served — both at once on each gateway: b's TTFT P90
   against its P90 alone, and a's throughput against the capacity b left over (capacity less
   b's own throughput in that phase).

Targets: b's TTFT P90 under the flood within 1.5× of alone, a's throughput ≥ 90 % of the
capacity left over. Prints a table (or one JSON object with --json); `--plot PATH` draws each
team's output tokens/s over the flood phases. TTFT is measured at the client, queue wait
included; each team's mean queue wait, and the bucket bound under which 90 % of team b's
waits fell, are read from the gateway's `duet:gateway_queue_wait_seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from bench.arrivals import send_offsets
from bench.procs import Proc, free_port, running
from bench.records import RequestRecord
from bench.sse_client import send
from bench.stats import percentile
from runtime.models import DEFAULT_MODEL, resolve_model

PROMPT = {"a": "Team a floods the tier with requests: ", "b": "Team b sends a steady load: "}
TARGET_TTFT_RATIO = 1.5
TARGET_LEFTOVER = 0.9
#: seconds at each phase's start left out of the throughputs (the closed loop filling the slots)
RAMP_S = 2.0


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="duet bench fairness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokenizer", default=DEFAULT_MODEL, help="the gateway's tokenizer's model")
    p.add_argument("--slots", type=int, default=16, help="the tier's admission slots")
    p.add_argument(
        "--flood",
        type=float,
        default=10.0,
        help="team a's requests outstanding, in multiples of its fair share of the slots",
    )
    p.add_argument(
        "--b-share",
        type=float,
        default=0.5,
        help="team b's steady request rate, as a fraction of its fair share of the capacity",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="mean output tokens per request (each drawn uniformly from half to 1.5 times it, so "
        "that requests do not end in lockstep)",
    )
    p.add_argument(
        "--first-token-delay-s", type=float, default=0.1, help="the echo node's time to first token"
    )
    p.add_argument(
        "--token-delay-s", type=float, default=0.01, help="the echo node's time between tokens"
    )
    p.add_argument("--duration-s", type=float, default=20.0, help="each phase's length")
    p.add_argument(
        "--fair-headroom",
        type=int,
        help="the fair gateway's `[tiers] fair_headroom` (slots kept free of a team beyond its "
        "share while another active team is under its own; default: the gateway's, "
        "1 from 8 slots, 2 from 64)",
    )
    p.add_argument("--seed", type=int, default=0, help="team b's arrival times")
    p.add_argument("--plot", type=Path, help="PNG of each team's tokens/s over the flood phases")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def _config(
    tmp: Path, port: int, node: str, tokenizer: str, slots: int, fair: bool, headroom: int | None
) -> Path:
    cfg = tmp / f"gateway-{port}.toml"
    set_headroom = f"fair_headroom = {headroom}" if fair and headroom is not None else ""
    cfg.write_text(f"""
[server]
port = {port}
max_connections_per_address = 0   # every client is on this one address
[quotas]
default_max_concurrent = 0        # team a's flood is bounded by the tier, not by a team limit
[store]
url = {json.dumps(f"sqlite://{tmp / f'gateway-{port}.db'}")}
[tiers]
max_inflight = {slots}
interactive_queue = 4096
interactive_max_wait_s = 600
fair_share = {"true" if fair else "false"}
{set_headroom}
[models.echo]
tokenizer = {json.dumps(tokenizer)}
max_model_len = 100000
static = {{ both = [{json.dumps(node)}] }}
""")
    return cfg


def _admin(url: str, admin: str, path: str, body: dict[str, Any] | None = None) -> Any:
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode() if body is not None else None,
        method="POST" if body is not None else "GET",
        headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read()
        return json.loads(text) if path != "/metrics" else text.decode()


def _queue_wait(url: str, admin: str) -> dict[str, dict[str, float]]:
    """`duet:gateway_queue_wait_seconds` per team, from the gateway's /metrics: its sum, its
    count, and each bucket's count (keyed by the bucket's bound as written, e.g. "0.005")."""
    out: dict[str, dict[str, float]] = {}
    for line in _admin(url, admin, "/metrics").splitlines():
        if not line.startswith("duet:gateway_queue_wait_seconds"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        name = line.split("{", 1)[0].rsplit("_", 1)[1]  # sum, count, bucket or created
        if name not in ("sum", "count", "bucket"):
            continue
        key = labels["le"] if name == "bucket" else name
        row = out.setdefault(labels.get("team", ""), {})
        row[key] = row.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _wait_p90(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The least bucket bound at or under which 90 % of the phase's waits fell (the
    histogram's resolution: a bound, not the exact P90)."""
    n = after.get("count", 0.0) - before.get("count", 0.0)
    bounds = sorted((float(k), k) for k in after if k not in ("sum", "count"))
    for bound, k in bounds:
        if n > 0 and after[k] - before.get(k, 0.0) >= 0.9 * n:
            return bound
    return None


class Phase:
    """One phase's load on one gateway: team a's closed loop, team b's open loop."""

    def __init__(self, url: str, keys: dict[str, str], args: argparse.Namespace) -> None:
        self.url, self.keys, self.args = url + "/v1/completions", keys, args
        self.records: list[RequestRecord] = []
        self.start = 0.0
        self.rng = random.Random(args.seed)

    async def _one(self, s: aiohttp.ClientSession, team: str) -> None:
        mean = self.args.max_tokens
        n = self.rng.randint(max(1, mean // 2), max(1, mean * 3 // 2))
        rec = RequestRecord(index=len(self.records), prompt_len=0, max_tokens=n, scheduled_s=0)
        rec.team = team
        self.records.append(rec)
        body = {"model": "echo", "prompt": PROMPT[team], "max_tokens": n, "stream": True}
        auth = {"Authorization": f"Bearer {self.keys[team]}"}
        await send(s, self.url, body, auth, rec, 600.0, self.start)

    async def _flood(self, s: aiohttp.ClientSession, end: float) -> None:
        # started over the first second, so that the slots do not all free at once
        await asyncio.sleep(self.rng.uniform(0.0, 1.0))
        while time.perf_counter() < end:
            await self._one(s, "a")

    async def _steady(self, s: aiohttp.ClientSession, rate: float, end: float) -> None:
        sends: list[asyncio.Task[None]] = []
        for offset in send_offsets(rate, 1.0, random.Random(self.args.seed + 1)):
            at = self.start + offset
            if at >= end:
                break
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            sends.append(asyncio.ensure_future(self._one(s, "b")))
        await asyncio.gather(*sends)

    async def run(self, flood: int, b_rate: float) -> dict[str, Any]:
        self.start = time.perf_counter()
        end = self.start + self.args.duration_s
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            work = [self._flood(s, end) for _ in range(flood)]
            if b_rate > 0:
                work.append(self._steady(s, b_rate, end))
            await asyncio.gather(*work)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        window = (min(RAMP_S, self.args.duration_s / 4), self.args.duration_s)
        out: dict[str, Any] = {}
        for team in ("a", "b"):
            recs = [r for r in self.records if r.team == team]
            if not recs:
                continue
            ok = [r for r in recs if r.ok]
            ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
            tokens = sum(
                n
                for r in ok
                for at, n in zip(r.chunk_s, r.chunk_tokens, strict=True)
                if window[0] <= r.sent_s + at < window[1]
            )
            out[team] = {
                "requests": len(recs),
                "errors": len(recs) - len(ok),
                "ttft_p50_s": round(percentile(ttfts, 0.5), 4) if ttfts else None,
                "ttft_p90_s": round(percentile(ttfts, 0.9), 4) if ttfts else None,
                "tokens_per_s": round(tokens / (window[1] - window[0]), 1),
            }
        return out

    def timeline(self) -> dict[str, list[int]]:
        """Each team's output tokens in each second of the phase."""
        n = int(self.args.duration_s) + 1
        out = {t: [0] * n for t in ("a", "b")}
        for r in self.records:
            for at, k in zip(r.chunk_s, r.chunk_tokens, strict=True):
                sec = int(r.sent_s + at)
                if r.team in out and sec < n:
                    out[r.team][sec] += k
        return out


def _phase(
    url: str, admin: str, keys: dict[str, str], args: argparse.Namespace, flood: int, rate: float
) -> tuple[dict[str, Any], Phase]:
    """One phase on the gateway at `url` (`flood` of team a's requests outstanding, team b at
    `rate` requests/s), with each team's mean queue wait in it."""
    before = _queue_wait(url, admin)
    phase = Phase(url, keys, args)
    result = asyncio.run(phase.run(flood, rate))
    after = _queue_wait(url, admin)
    for team, row in after.items():
        was = before.get(team, {})
        n = row.get("count", 0.0) - was.get("count", 0.0)
        if team in result and n > 0:
            total = row.get("sum", 0.0) - was.get("sum", 0.0)
            result[team]["queue_wait_mean_s"] = round(total / n, 4)
            result[team]["queue_wait_p90_le_s"] = _wait_p90(was, row)
    return result, phase


def _gateway(tmp: Path, node: str, tokenizer: str, args: argparse.Namespace, fair: bool) -> Proc:
    port = free_port()
    cfg = _config(tmp, port, node, tokenizer, args.slots, fair, args.fair_headroom)
    cmd = [sys.executable, "-m", "duet", "gateway", "--config", str(cfg), "--log-level", "WARNING"]
    env = {"DUET_ADMIN_KEY": args.admin, "DUET_HOME": str(tmp)}
    return Proc(cmd, port, tmp / f"gateway-{port}.log", env=env)


def _keys(url: str, admin: str) -> dict[str, str]:
    keys = {}
    for team in ("a", "b"):
        _admin(url, admin, "/admin/teams", {"id": team})
        keys[team] = _admin(url, admin, "/admin/keys", {"team_id": team})["key"]
    return keys


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.admin = secrets.token_urlsafe(32)
    tokenizer = str(resolve_model(args.tokenizer).directory)
    flood = max(1, round(args.flood * args.slots / 2))
    with tempfile.TemporaryDirectory(prefix="duet-bench-fair-") as d:
        tmp = Path(d)
        nport = free_port()
        node = Proc(
            [
                *(sys.executable, "-m", "bench.echo_node", "--port", str(nport)),
                *("--first-token-delay", str(args.first_token_delay_s)),
                *("--token-delay", str(args.token_delay_s)),
            ],
            nport,
            tmp / "echo.log",
        )
        fair = _gateway(tmp, node.url, tokenizer, args, fair=True)
        fcfs = _gateway(tmp, node.url, tokenizer, args, fair=False)
        with running(node, fair, fcfs):
            keys = {g.url: _keys(g.url, args.admin) for g in (fair, fcfs)}
            say = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr))
            say(f"capacity: team a alone, {flood} requests outstanding …")
            capacity, _ = _phase(fair.url, args.admin, keys[fair.url], args, flood, 0.0)
            cap_tps = capacity["a"]["tokens_per_s"]
            rate = args.b_share * cap_tps / 2 / args.max_tokens
            say(f"team b alone at {rate:.2f} requests/s …")
            alone, _ = _phase(fair.url, args.admin, keys[fair.url], args, 0, rate)
            runs: dict[str, Any] = {}
            timelines: dict[str, dict[str, list[int]]] = {}
            for name, g in (("fair", fair), ("fcfs", fcfs)):
                say(f"flood on the {name} gateway …")
                runs[name], phase = _phase(g.url, args.admin, keys[g.url], args, flood, rate)
                timelines[name] = phase.timeline()
    b_alone = alone["b"]["ttft_p90_s"]
    for r in runs.values():
        left = cap_tps - r["b"]["tokens_per_s"]
        r["b_ttft_p90_ratio"] = round(r["b"]["ttft_p90_s"] / b_alone, 3)
        r["a_of_leftover"] = round(r["a"]["tokens_per_s"] / left, 3) if left > 0 else None
        r["meets_targets"] = (
            r["b_ttft_p90_ratio"] <= TARGET_TTFT_RATIO
            and (r["a_of_leftover"] or 0) >= TARGET_LEFTOVER
        )
    cfg = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    cfg.pop("admin")
    return {
        "bench": "fairness",
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "flood_outstanding": flood,
        "b_rate_per_s": round(rate, 3),
        "capacity": capacity["a"],
        "b_alone": alone["b"],
        "flood": runs,
        "timelines": timelines,
        "config": cfg,
    }


def _table(res: dict[str, Any]) -> str:
    cap, alone = res["capacity"], res["b_alone"]
    rows = [
        f"capacity (team a alone, {res['flood_outstanding']} outstanding): "
        f"{cap['tokens_per_s']} tokens/s",
        f"team b alone ({res['b_rate_per_s']} requests/s): TTFT P50 {alone['ttft_p50_s']} s, "
        f"P90 {alone['ttft_p90_s']} s",
        "| order | b TTFT P50 / P90 (s) | P90 ×alone | b tokens/s | a tokens/s | a / leftover "
        "| mean wait a / b (s) | b wait P90 ≤ (s) | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["flood"].items():
        a, b = r["a"], r["b"]
        rows.append(
            f"| {name} | {b['ttft_p50_s']} / {b['ttft_p90_s']} | {r['b_ttft_p90_ratio']} "
            f"| {b['tokens_per_s']} | {a['tokens_per_s']} | {r['a_of_leftover']} "
            f"| {a.get('queue_wait_mean_s')} / {b.get('queue_wait_mean_s')} "
            f"| {b.get('queue_wait_p90_le_s')} "
            f"| {a['errors'] + b['errors']} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    res = run(args)
    if args.plot is not None:
        from bench.fairness_plot import plot

        plot(res["timelines"], args.plot)
    if args.json:
        print(json.dumps(res))
        return 0
    print(_table(res))
    fair = res["flood"]["fair"]
    print(
        f"targets (b ×alone ≤ {TARGET_TTFT_RATIO}, a / leftover ≥ {TARGET_LEFTOVER}): "
        f"{'met' if fair['meets_targets'] else 'NOT met'} with fair shares; CPUs "
        f"{res['cpus']}, load {res['load_average_1m']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
