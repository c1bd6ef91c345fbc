"""A load step against a running autoscaled cluster (`duet up --autoscale`): the base request
rate, then `--factor`× for a while, then the base again, driven by `duet bench serve` (one run
per phase, each started on schedule), while the coordinator's `/cluster` is sampled every second.

Reports (JSON on stdout, a PNG with `--plot`): nodes per role over time, the offered rate and the
nodes' queues, every request's TTFT with a rolling P90 against `--slo-ttft-ms`; the seconds from
the step to the first node added, when the pool shrank back, direction changes of the node count,
and failed requests per phase (a scale-in must fail none).

    python -m bench.autoscale_step --base-url http://127.0.0.1:8000 --coordinator
    http://127.0.0.1:PORT \
        --api-key KEY --rate 0.5 --factor 4 --phases 60,180,240 --plot docs/bench/autoscale-step.png

Talks HTTP only (bench/ rules); the coordinator URL is in `duet status --json` (or
$DUET_HOME/up/state.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.scrape import scrape_secret
from runtime.cluster_secret import is_loopback


def cluster_headers(coordinator: str) -> dict[str, str]:
    """The cluster secret's header for `/cluster` (an internal endpoint): found as scrapes find
    it (bench/scrape.py: $DUET_CLUSTER_SECRET_FILE, $DUET_CLUSTER_SECRET, else the running
    `duet up`'s file, the latter sent to a loopback coordinator only)."""
    secret, local_only = scrape_secret()
    if secret is None or (local_only and not is_loopback(urlsplit(coordinator).hostname or "")):
        return {}
    return dict(secret.headers)


def _read_cluster(coordinator: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    req = urllib.request.Request(coordinator + "/cluster", headers=headers)
    with urllib.request.urlopen(req, timeout=2) as r:
        return json.loads(r.read())["nodes"]


def _sample(
    coordinator: str,
    headers: dict[str, str],
    t0: float,
    out: list[dict[str, Any]],
    stop: threading.Event,
) -> None:
    while not stop.wait(1.0):  # sampling interval
        try:
            nodes = _read_cluster(coordinator, headers)
        except (
            OSError,
            ValueError,
            KeyError,
        ):  # a coordinator restarting: the next second's sample
            continue
        row: dict[str, Any] = {
            "t": time.time() - t0,
            "prefill": 0,
            "decode": 0,
            "both": 0,
            "draining": 0,
            "waiting": 0,
            "running": 0,
            "queued_prefill_tokens": 0,
        }
        for n in nodes:
            if n["status"] == "draining":
                row["draining"] += 1
            else:
                row[n["role"]] += 1
            load = n.get("load") or {}
            for k in ("waiting", "running", "queued_prefill_tokens"):
                row[k] += load.get(k, 0)
        out.append(row)


def _phase(
    args: argparse.Namespace, rate: float, duration: float, result: Path
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "duet",
        "bench",
        "serve",
        "--base-url",
        args.base_url,
        "--api-key",
        args.api_key,
        "--request-rate",
        str(rate),
        "--duration",
        str(duration),
        "--input-len",
        args.input_len,
        "--output-len",
        args.output_len,
        "--result-file",
        str(result),
        "--quiet",
        "--seed",
        str(int(rate * 100)),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _p90(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    phases = [float(x) for x in args.phases.split(",")]
    rates = [args.rate, args.rate * args.factor, args.rate]
    headers = cluster_headers(args.coordinator)
    # one read first: a refused or unreachable coordinator is the caller's to fix, not an empty plot
    try:
        _read_cluster(args.coordinator, headers)
    except urllib.error.HTTPError as e:
        hint = (
            " (it needs the cluster secret: set $DUET_CLUSTER_SECRET_FILE)" if e.code == 401 else ""
        )
        raise SystemExit(
            f"autoscale_step: {args.coordinator}/cluster answered HTTP {e.code}{hint}"
        ) from None
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"autoscale_step: cannot read {args.coordinator}/cluster: {e}") from None
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    t0 = time.time()
    sampler = threading.Thread(
        target=_sample, args=(args.coordinator, headers, t0, samples, stop), daemon=True
    )
    sampler.start()
    tmp = Path(tempfile.mkdtemp(prefix="autoscale-step-"))
    procs, starts = [], []
    at = 0.0
    for k, (rate, dur) in enumerate(zip(rates, phases, strict=True)):
        while time.time() - t0 < at:
            time.sleep(0.2)  # waiting for the phase's scheduled start
        starts.append(time.time() - t0)
        procs.append(_phase(args, rate, dur, tmp / f"phase{k}.json"))
        print(
            f"autoscale_step: phase {k} at {starts[-1]:.0f} s: {rate:g} req/s for {dur:g} s",
            file=sys.stderr,
            flush=True,
        )
        at += dur
    for p in procs:
        p.wait()
    time.sleep(args.tail)  # keep sampling while the pool shrinks back
    stop.set()
    sampler.join(5)
    requests = []
    per_phase = []
    for k, start in enumerate(starts):
        r = json.loads((tmp / f"phase{k}.json").read_text())
        failed = [e for e in r["errors"] if e]
        per_phase.append(
            {
                "rate": rates[k],
                "requests": len(r["errors"]),
                "failed": len(failed),
                "failures": sorted(set(failed))[:5],
            }
        )
        for st, ttft, err in zip(r["start_times"], r["ttfts"], r["errors"], strict=True):
            requests.append({"t": start + st, "ttft_s": ttft, "failed": bool(err)})
    nodes = [s["prefill"] + s["decode"] + s["both"] for s in samples]
    changes, last_dir = 0, 0
    for a, b in itertools.pairwise(nodes):
        d = (b > a) - (b < a)
        if d and last_dir and d != last_dir:
            changes += 1
        last_dir = d or last_dir
    step_t = starts[1]
    base_nodes = next(
        (n for s, n in zip(samples, nodes, strict=True) if s["t"] >= step_t),
        nodes[0] if nodes else 0,
    )
    first_out = next(
        (
            s["t"] - step_t
            for s, n in zip(samples, nodes, strict=True)
            if s["t"] > step_t and n > base_nodes
        ),
        None,
    )
    back = next(
        (
            s["t"] - starts[2]
            for s, n in zip(samples, nodes, strict=True)
            if s["t"] > starts[2] and n <= base_nodes
        ),
        None,
    )
    window = [
        r["ttft_s"]
        for r in requests
        if r["ttft_s"] is not None and r["t"] >= starts[2] - 60 and r["t"] < starts[2]
    ]
    summary = {
        "phases": per_phase,
        "phase_starts_s": starts,
        "scale_out_after_step_s": first_out,
        "back_to_base_after_fall_s": back,
        "max_nodes_seen": max(nodes, default=0),
        "node_count_direction_changes": changes,
        "failed_requests": sum(p["failed"] for p in per_phase),
        "ttft_p90_last_60s_of_step_ms": None if _p90(window) is None else round(_p90(window) * 1e3),  # type: ignore[operator]
        "samples": samples,
        "requests": requests,
    }
    if args.plot:
        plot(summary, args.plot, args.slo_ttft_ms)
    return summary


def plot(s: dict[str, Any], path: str, slo_ms: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    t = [x["t"] for x in s["samples"]]
    for role in ("prefill", "decode", "both"):
        ys = [x[role] for x in s["samples"]]
        if any(ys):
            ax[0].step(t, ys, where="post", label=f"{role} nodes")
    ax[0].step(
        t, [x["draining"] for x in s["samples"]], where="post", label="draining", linestyle=":"
    )
    ax[0].set_ylabel("nodes")
    ax[0].legend(loc="upper left")
    starts = s["phase_starts_s"]
    for k, p in enumerate(s["phases"]):
        end = starts[k + 1] if k + 1 < len(starts) else max(t, default=starts[k])
        ax[1].hlines(
            p["rate"], starts[k], end, colors="k", label="offered req/s" if k == 0 else None
        )
    ax1b = ax[1].twinx()
    ax1b.plot(
        t,
        [x["waiting"] + x["running"] for x in s["samples"]],
        color="tab:orange",
        label="waiting + running",
    )
    ax[1].set_ylabel("request rate")
    ax1b.set_ylabel("requests on nodes")
    ax[1].legend(loc="upper left")
    ax1b.legend(loc="upper right")
    ok = [(r["t"], r["ttft_s"] * 1e3) for r in s["requests"] if r["ttft_s"] is not None]
    ax[2].scatter([a for a, _ in ok], [b for _, b in ok], s=4, alpha=0.4, label="TTFT per request")
    roll = []
    for a, _ in ok:
        w = [b for x, b in ok if a - 30 <= x <= a]
        roll.append(sorted(w)[min(len(w) - 1, int(0.9 * len(w)))])
    ax[2].plot([a for a, _ in ok], roll, color="tab:red", label="P90 (30 s)")
    if slo_ms:
        ax[2].axhline(slo_ms, color="k", linestyle="--", label="SLO")
    fails = [r["t"] for r in s["requests"] if r["failed"]]
    if fails:
        ax[2].scatter(fails, [0] * len(fails), marker="x", color="k", label="failed")
    ax[2].set_yscale("log")
    ax[2].set_ylabel("TTFT (ms)")
    ax[2].set_xlabel("seconds")
    ax[2].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.autoscale_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", required=True, help="the gateway")
    p.add_argument(
        "--coordinator", required=True, help="a coordinator replica (its /cluster is sampled)"
    )
    p.add_argument("--api-key", required=True)
    p.add_argument("--rate", type=float, default=0.5, help="base request rate (req/s)")
    p.add_argument("--factor", type=float, default=4.0, help="the step: this × the base rate")
    p.add_argument(
        "--phases", default="60,180,240", help="seconds at the base, at the step, at the base again"
    )
    p.add_argument("--input-len", default="256")
    p.add_argument("--output-len", default="32")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--tail", type=float, default=10.0, help="seconds sampled after the last phase")
    p.add_argument("--plot", default=None, metavar="PNG")
    p.add_argument(
        "--out", default=None, metavar="JSON", help="the full result (samples, every request)"
    )
    args = p.parse_args(argv)
    s = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(s))
    print(json.dumps({k: v for k, v in s.items() if k not in ("samples", "requests")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
