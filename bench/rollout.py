"""`python -m bench.rollout`: a rollout under steady load through the gateway, as a timeline.

On its own cluster (bench/rollout_plane.py: v1 on a prefill and a decode node, `bad` and `good`
on a colocated node each, one gateway), `--concurrency` clients send completions back to back
with the official openai client while two rollouts run:

1. `bad` (its node fails `--fail-fraction` of its requests) at a `--canary` share: the gateway
   must roll it back by itself within the policy's window;
2. `good`: it must step up the policy's steps to 100 % (`done`).

Each second it reads the gateway's versions view (protocol/rollout.py) and records the new
version's share, every version's attempts and failed attempts in that second (differences of
the gateway's totals) and the client's errors. It prints a summary line per phase, writes the
timeline (`--json`) and plots it (`--plot`, bench/rollout_plot.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import openai

from bench.rollout_plane import Plane, plane
from protocol.rollout import VersionsView

DEFAULT_MODEL = Path.home() / ".cache/duet/models/smollm2-135m-instruct"


def _admin(p: Plane, method: str, path: str, body: dict[str, Any] | None = None) -> VersionsView:
    req = urllib.request.Request(
        f"{p.gateway}/admin/models/{p.model}/{path}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {p.admin_key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return msgspec.json.decode(r.read(), type=VersionsView)


class Load:
    """Clients sending back to back; errors counted per second since `t0`."""

    def __init__(self, p: Plane, max_tokens: int) -> None:
        self.client = openai.OpenAI(base_url=p.gateway + "/v1", api_key=p.api_key, max_retries=0)
        self.model, self.max_tokens = p.model, max_tokens
        self.stop = threading.Event()
        self.t0 = time.time()
        self.requests = 0
        self.errors: list[tuple[float, str]] = []

    def worker(self) -> None:
        prompt = "Write one sentence about a rollout that moves requests to a new version."
        while not self.stop.is_set():
            try:
                self.client.completions.create(
                    model=self.model, prompt=prompt, max_tokens=self.max_tokens, temperature=0
                )
                self.requests += 1
            except openai.APIError as e:
                self.errors.append((time.time() - self.t0, repr(e)[:200]))


def _phase(p: Plane, args: argparse.Namespace, to: str, canary: float | None, end: str) -> dict:
    """One rollout under load, sampled each second until its phase is `end` (then a tail)."""
    load = Load(p, args.max_tokens)
    rows: list[dict[str, Any]] = []
    last: dict[str, tuple[int, int]] = {}
    ended_at: float | None = None
    with ThreadPoolExecutor(args.concurrency) as pool:
        for _ in range(args.concurrency):
            pool.submit(load.worker)
        time.sleep(args.lead_s)  # the old version alone first
        start = _admin(p, "POST", "rollout", {"action": "start", "to": to, "canary": canary})
        started = time.time() - load.t0
        try:
            while True:
                time.sleep(1.0)
                v = _admin(p, "GET", "versions")
                t = time.time() - load.t0
                row: dict[str, Any] = {"t": round(t, 2), "share": v.rollout.share}
                for s in v.versions:
                    a0, f0 = last.get(s.name, (s.total_attempts, s.total_failed))
                    row[s.name] = [s.total_attempts - a0, s.total_failed - f0]
                    last[s.name] = (s.total_attempts, s.total_failed)
                row["client_errors"] = sum(1 for e, _ in load.errors if t - 1 < e <= t)
                rows.append(row)
                if ended_at is None and v.rollout.phase == end:
                    ended_at = t
                if ended_at is not None and t - ended_at >= args.tail_s:
                    break
                if t - started > args.phase_timeout_s:
                    break
        finally:
            load.stop.set()
    return {
        "to": to,
        "end": end,
        "reached": ended_at is not None,
        "started_s": round(started, 2),
        "ended_s": None if ended_at is None else round(ended_at, 2),
        "requests": load.requests,
        "client_errors": len(load.errors),
        "errors": load.errors[:5],
        "events": [msgspec.to_builtins(e) for e in v.rollout.events],
        "weights_at_start": {s.name: s.weight for s in start.versions},
        "rows": rows,
    }


#: each version's nodes (bench/rollout_plane.py)
VERSION_NODES = {"v1": {"prefill-v1", "decode-v1"}, "bad": {"both-bad"}, "good": {"both-good"}}


def legs_across_versions(p: Plane, since: float) -> tuple[int, int]:
    """(records, records with a leg on another version's node) since `since` (unix seconds)."""
    url = f"{p.gateway}/v1/usage?start={since}&end={time.time() + 1}&group_by=record&limit=10000"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {p.admin_key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        rows = json.loads(r.read())["data"]
    mixed = [x for x in rows if not set((x["nodes"] or "").split()) <= VERSION_NODES[x["version"]]]
    return len(rows), len(mixed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.rollout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model directory")
    p.add_argument("--concurrency", type=int, default=4, help="clients sending back to back")
    p.add_argument("--max-tokens", type=int, default=4, help="completion tokens per request")
    p.add_argument("--fail-fraction", type=float, default=0.2, help="bad's node: share failed")
    p.add_argument("--canary", type=float, default=20.0, help="bad's first share, percent")
    p.add_argument("--steps", default="10,25,50,100", help="the policy's steps, percent")
    p.add_argument("--step-interval-s", type=float, default=15.0, help="each step's least time")
    p.add_argument("--window-s", type=float, default=60.0, help="the judging window, seconds")
    p.add_argument("--max-error-rate", type=float, default=0.05, help="the error bar")
    p.add_argument("--min-requests", type=int, default=5, help="attempts before a judgement")
    p.add_argument("--lead-s", type=float, default=5.0, help="load on v1 alone before a start")
    p.add_argument("--tail-s", type=float, default=10.0, help="seconds sampled after the end")
    p.add_argument("--phase-timeout-s", type=float, default=300.0, help="give up a phase after")
    p.add_argument("--json", type=Path, default=None, help="write the timeline here")
    p.add_argument("--plot", type=Path, default=None, help="plot the timeline (PNG)")
    args = p.parse_args(argv)
    policy = {
        "steps": [float(s) for s in args.steps.split(",")],
        "step_interval_s": args.step_interval_s,
        "window_s": args.window_s,
        "max_error_rate": args.max_error_rate,
        "min_requests": args.min_requests,
    }
    node_args = ["--max-model-len", "512"]
    with (
        tempfile.TemporaryDirectory(prefix="duet-rollout-") as tmp,
        plane(args.model, Path(tmp), args.fail_fraction, policy, node_args) as pl,
    ):
        since = time.time() - 1
        bad = _phase(pl, args, "bad", args.canary, "rolled_back")
        good = _phase(pl, args, "good", None, "done")
        time.sleep(2)  # the usage writer's last batch
        records, mixed = legs_across_versions(pl, since)
    out = {"policy": policy, "fail_fraction": args.fail_fraction, "bad": bad, "good": good}
    out["records"], out["legs_across_versions"] = records, mixed
    print(f"usage records: {records}, with legs on two versions: {mixed}")
    for name, ph in (("bad", bad), ("good", good)):
        took = None if ph["ended_s"] is None else ph["ended_s"] - ph["started_s"]
        print(
            f"{name}: {ph['end'] if ph['reached'] else 'NOT ' + ph['end']}"
            + (f" {took:.1f} s after the start" if took is not None else "")
            + f"; {ph['requests']} requests, {ph['client_errors']} client errors"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if args.plot:
        from bench.rollout_plot import plot

        plot(out, args.plot)
    errors = bad["client_errors"] + good["client_errors"]
    ok = bad["reached"] and good["reached"] and not errors and not mixed
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
