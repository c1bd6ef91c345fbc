"""`python -m bench.gateway`: what the gateway costs, measured against a node that costs nothing.

Starts a token-echo node (bench.echo_node: the node API, no engine) and a `duet gateway` in
front of it (SQLite store in a temporary directory, one team and key), then:

1. overhead — sequential streamed requests, in turn straight to the node, through the gateway
   (auth, quota reservation, tokenization, routing, relay, usage record) and through a bare
   relay (bench.bare_relay: the same HTTP stack doing nothing but forwarding); p50/p99 of TTFT
   and latency for each, and per request the difference to the node's own (paired: request i
   of each path ran back to back), the CPU each process spent per request, and each path's
   share of requests more than 1 ms slower than its own median (`slow_share`: the machine's
   stalls — when the node path, no gateway in it, has them too, a p99 measures the machine as
   much as the gateway). Target: the gateway's overhead p99 < 2 ms;
2. concurrency — `--streams` SSE streams through the gateway at once (each `--stream-tokens`
   tokens, `--token-delay` apart at the node, so they overlap); how many completed, errors,
   TTFT p50/p99, wall time and tokens/s.

Prints a summary, or one JSON object with --json. Figures depend on the machine: compare runs
on the same one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import Proc, free_port, running
from runtime.models import DEFAULT_MODEL, resolve_model
from text.tokenizer import Tokenizer

PROMPT = "Measure the gateway, not the model: "
#: the target for the gateway's overhead (p99, ms): 2 ms, small beside any model's TTFT
TARGET_P99_MS = 2.0
#: a request this much slower than its path's median counts as stalled (slow_share)
SLOW_S = 0.001


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--tokenizer", default=DEFAULT_MODEL, help="model whose tokenizer the gateway uses"
    )
    p.add_argument(
        "--requests",
        type=int,
        default=2000,
        help="sequential requests per path (overhead; a p99 needs thousands)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per overhead request")
    p.add_argument(
        "--first-token-delay",
        type=float,
        default=0.0,
        help="seconds the overhead test's echo node waits before its first token, as an engine "
        "would (0, the default: the gateway's cost against a node that costs nothing)",
    )
    p.add_argument(
        "--streams", type=int, default=10000, help="concurrent SSE streams through the gateway"
    )
    p.add_argument("--stream-tokens", type=int, default=32)
    p.add_argument(
        "--token-delay",
        type=float,
        default=0.02,
        help="seconds between tokens at the echo node of the concurrency test",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=3.0,
        help="the gateway's [routing] connect_timeout_s to the nodes (3 s: its default)",
    )
    p.add_argument(
        "--store",
        choices=("sqlite", "postgres"),
        default="sqlite",
        help="the gateway's store: SQLite (its default) or a PostgreSQL server started for the run "
        "(pgserver; the store of several gateways)",
    )
    p.add_argument(
        "--traced",
        action="store_true",
        help="also a second gateway with OpenTelemetry tracing on (spans kept in its console ring, "
        "no export), its requests interleaved with the others: tracing's cost, per request",
    )
    p.add_argument(
        "--otlp",
        action="store_true",
        help="also a gateway with tracing on that exports every span over OTLP/HTTP (the SDK's "
        "batch exporter) to a local receiver (bench.otlp_sink, a process of its own): the cost of "
        "tracing as a deployment with Jaeger or Tempo pays it. Implies --traced",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    args.traced = args.traced or args.otlp
    return args


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _summary(xs: list[float]) -> dict[str, float | None]:
    return {"p50_ms": _ms(statistics.median(xs) if xs else None), "p99_ms": _ms(_pct(xs, 0.99))}


def slow_share(xs: list[float], over_s: float = SLOW_S) -> float | None:
    """The share of `xs` more than `over_s` above their own median."""
    if not xs:
        return None
    limit = statistics.median(xs) + over_s
    return round(sum(1 for x in xs if x > limit) / len(xs), 4)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


async def _stream(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[float, float, int]:
    """(ttft, latency, tokens) of one streamed completion; raises on an HTTP error."""
    t0 = time.perf_counter()
    ttft = None
    n = 0
    async with s.post(url, json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for line in r.content:
            if line.startswith(b"data: {") and b'"text"' in line:
                n += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    return ttft or 0.0, time.perf_counter() - t0, n


async def _overhead(
    node: str,
    gw: str,
    relay: str,
    key: str,
    ids: list[int],
    args: argparse.Namespace,
    traced: dict[str, tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """`traced`: path name -> (url, key) of the gateways with tracing on, more paths."""
    paths: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
        "node": (node, {"prompt": ids}, {}),
        "gateway": (gw, {"model": "echo", "prompt": PROMPT}, {"Authorization": f"Bearer {key}"}),
        "bare_relay": (relay, {"prompt": ids}, {}),
    }
    for name, (url, tkey) in (traced or {}).items():
        paths[name] = (
            url,
            {"model": "echo", "prompt": PROMPT},
            {"Authorization": f"Bearer {tkey}"},
        )
    times: dict[str, dict[str, list[float]]] = {p: {"ttft": [], "latency": []} for p in paths}
    common = {"max_tokens": args.max_tokens, "stream": True, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        for i in range(args.requests):
            for name, (url, body, headers) in paths.items():
                t, lat, _ = await _stream(
                    s,
                    url + "/v1/completions",
                    {**body, **common},
                    {**headers, "X-Request-Id": f"bench-{i}"},
                )
                times[name]["ttft"].append(t)
                times[name]["latency"].append(lat)
    out: dict[str, Any] = {"requests": args.requests}
    for metric in ("ttft", "latency"):
        direct = times["node"][metric]
        x: dict[str, Any] = {p: _summary(times[p][metric]) for p in paths}
        x["slow_share"] = {p: slow_share(times[p][metric]) for p in paths}
        for p in [q for q in paths if q != "node"]:
            # Request i's overhead is its own difference to node request i (they ran back to
            # back): percentiles of those differences, never a percentile minus a percentile.
            paired = _summary([v - d for d, v in zip(direct, times[p][metric], strict=True)])
            prefix = "overhead" if p == "gateway" else f"{p}_overhead"
            x[f"{prefix}_p50_ms"], x[f"{prefix}_p99_ms"] = paired["p50_ms"], paired["p99_ms"]
        out[metric] = x
    out["target_overhead_p99_ms"] = TARGET_P99_MS
    out["meets_target"] = {
        m: (out[m]["overhead_p99_ms"] or 1e9) < TARGET_P99_MS for m in ("ttft", "latency")
    }
    return out


def _cpu_s(pid: int) -> float:
    """CPU seconds a process has used so far (all its threads, user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def _with_memory(pid: int, work: Any) -> tuple[Any, dict[str, float]]:
    """Run `work` while sampling the gateway's RSS every 100 ms: idle, peak and per stream."""
    idle = _rss_bytes(pid)
    peak = idle
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_bytes(pid))
            await asyncio.sleep(0.1)  # sampling interval

    sampler = asyncio.ensure_future(sample())
    try:
        result = await work
    finally:
        done.set()
        await sampler
    return result, {"rss_idle_mib": round(idle / 2**20, 1), "rss_peak_mib": round(peak / 2**20, 1)}


async def _concurrency(gw: str, key: str, args: argparse.Namespace) -> dict[str, Any]:
    body = {
        "model": "echo-slow",
        "prompt": PROMPT,
        "max_tokens": args.stream_tokens,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    errors: dict[str, int] = {}
    samples: dict[str, str] = {}  # one message per error kind
    ttfts: list[float] = []
    tokens = 0
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:

        async def one() -> None:
            nonlocal tokens
            try:
                t, _, n = await _stream(s, gw + "/v1/completions", body, headers)
                ttfts.append(t)
                tokens += n
            except Exception as e:
                k = str(e).split(":")[0] if isinstance(e, RuntimeError) else type(e).__name__
                errors[k] = errors.get(k, 0) + 1
                samples.setdefault(k, str(e)[:300])

        t0 = time.perf_counter()
        await asyncio.gather(*[one() for _ in range(args.streams)])
        wall = time.perf_counter() - t0
    return {
        "streams": args.streams,
        "completed": len(ttfts),
        "errors": errors,
        "error_samples": samples,
        "wall_s": round(wall, 3),
        "ttft": _summary(ttfts),
        "tokens_per_s": round(tokens / wall, 1),
    }


def _otlp_settled(url: str, quiet_s: float = 6.0, timeout_s: float = 120.0) -> dict[str, int]:
    """The OTLP receiver's count once it has stopped growing for `quiet_s` (the exporter sends
    a batch at least every 5 s, so 6 s without a new span means the run's spans are all in and
    their export is in the gateway's CPU)."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while True:
        got = json.loads(urllib.request.urlopen(url + "/count", timeout=5).read())
        if got["spans"] != last:
            last, since = got["spans"], time.monotonic()
        elif time.monotonic() - since >= quiet_s or time.monotonic() > deadline:
            return {"spans": got["spans"], "exports": got["exports"], "bytes": got["bytes"]}
        time.sleep(0.1)  # polling the receiver's count, not covering a race


def _write_config(
    tmp: Path,
    port: int,
    fast: str,
    slow: str,
    tokenizer: str,
    streams: int,
    connect_timeout: float,
    store: str = "",
) -> Path:
    cfg = tmp / "gateway.toml"
    cfg.write_text(f"""
[server]
port = {port}
max_connections_per_address = 0   # every stream comes from this one address
[quotas]
default_max_concurrent = 0        # team "bench" runs all its streams at once
[store]
url = {json.dumps(store or f"sqlite://{tmp / 'gateway.db'}")}
[routing]
connect_timeout_s = {connect_timeout}
[tiers]
max_inflight = {streams + 64}
interactive_queue = {streams + 64}
[models.echo]
tokenizer = {json.dumps(tokenizer)}
max_model_len = 100000
static = {{ both = [{json.dumps(fast)}] }}
[models.echo-slow]
tokenizer = {json.dumps(tokenizer)}
max_model_len = 100000
static = {{ both = [{json.dumps(slow)}] }}
""")
    return cfg


@contextlib.contextmanager
def _postgres(tmp: Path) -> Iterator[str]:
    """A PostgreSQL server for the run (pgserver ships one); its URL."""
    try:
        import pgserver
    except ImportError:
        raise SystemExit("--store postgres needs pgserver (pip install -e .[test])") from None
    srv = pgserver.get_server(tmp / "pg", cleanup_mode="stop")
    try:
        yield srv.get_uri()
    finally:
        srv.cleanup()


def _admin(url: str, admin: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def run(args: argparse.Namespace) -> dict[str, Any]:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tok_dir = resolve_model(args.tokenizer).directory
    ids = Tokenizer(tok_dir).encode(PROMPT)
    with tempfile.TemporaryDirectory(prefix="duet-bench-gw-") as d, contextlib.ExitStack() as stack:
        tmp = Path(d)
        nport, sport, gport, rport = free_port(), free_port(), free_port(), free_port()
        # one echo node answers at once (overhead), the other spaces its tokens (streams overlap)
        node = Proc(
            [
                sys.executable,
                "-m",
                "bench.echo_node",
                "--port",
                str(nport),
                "--first-token-delay",
                str(args.first_token_delay),
            ],
            nport,
            tmp / "echo.log",
        )
        slow = Proc(
            [
                sys.executable,
                "-m",
                "bench.echo_node",
                "--port",
                str(sport),
                "--token-delay",
                str(args.token_delay),
            ],
            sport,
            tmp / "echo-slow.log",
        )
        relay = Proc(
            [sys.executable, "-m", "bench.bare_relay", "--port", str(rport), "--node", node.url],
            rport,
            tmp / "relay.log",
        )
        admin = secrets.token_urlsafe(32)
        store = ""
        if args.store == "postgres":
            store = stack.enter_context(_postgres(tmp))
        cfg = _write_config(
            tmp, gport, node.url, slow.url, str(tok_dir), args.streams, args.connect_timeout, store
        )
        gw = Proc(
            [
                sys.executable,
                "-m",
                "duet",
                "gateway",
                "--config",
                str(cfg),
                "--log-level",
                "WARNING",
            ],
            gport,
            tmp / "gateway.log",
            env={"DUET_ADMIN_KEY": admin, "DUET_HOME": str(tmp)},
        )
        procs = [node, slow, relay, gw]
        # the same gateway with tracing on, each in a store of its own: spans kept in the console's
        # ring only ("gateway_traced"), and ring plus an OTLP exporter to a local receiver
        # ("gateway_otlp")
        variants: dict[str, Proc] = {}
        sink = None
        if args.otlp:
            oport = free_port()
            sink = Proc(
                [sys.executable, "-m", "bench.otlp_sink", "--port", str(oport)],
                oport,
                tmp / "otlp.log",
            )
            procs.append(sink)
        for name in ["gateway_traced"] * args.traced + ["gateway_otlp"] * args.otlp:
            (tmp / name).mkdir()
            tport = free_port()
            tcfg = _write_config(
                tmp / name,
                tport,
                node.url,
                slow.url,
                str(tok_dir),
                args.streams,
                args.connect_timeout,
            )
            env = {"DUET_ADMIN_KEY": admin, "DUET_HOME": str(tmp / name), "DUET_TRACING": "1"}
            if name == "gateway_otlp" and sink is not None:
                # the SDK's batch exporter with its defaults (a batch every 5 s or 512 spans), as a
                # deployment runs it
                env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.url
            variants[name] = Proc(
                [
                    sys.executable,
                    "-m",
                    "duet",
                    "gateway",
                    "--config",
                    str(tcfg),
                    "--log-level",
                    "WARNING",
                ],
                tport,
                tmp / f"{name}.log",
                env=env,
            )
            procs.append(variants[name])
        with running(*procs):
            _admin(gw.url, admin, "/admin/teams", {"id": "bench"})
            key = _admin(gw.url, admin, "/admin/keys", {"team_id": "bench"})["key"]
            measured = [("gateway", gw.proc), ("bare_relay", relay.proc)]
            traced: dict[str, tuple[str, str]] = {}
            for name, tgw in variants.items():
                _admin(tgw.url, admin, "/admin/teams", {"id": "bench"})
                traced[name] = (
                    tgw.url,
                    _admin(tgw.url, admin, "/admin/keys", {"team_id": "bench"})["key"],
                )
                measured.append((name, tgw.proc))
            if not args.json:
                print(f"overhead: {args.requests} sequential requests per path …", file=sys.stderr)
            cpu0 = {p: _cpu_s(proc.pid) for p, proc in measured}
            overhead = asyncio.run(_overhead(node.url, gw.url, relay.url, key, ids, args, traced))
            if (
                sink is not None
            ):  # every span of the run received, so its export is in the CPU read below
                overhead["otlp"] = _otlp_settled(sink.url)
            # CPU per request (every thread, user + system): what a core sustains, which the
            # machine's noise hardly moves — unlike a p99 on shared cores
            overhead["cpu_ms_per_request"] = {
                p: round((_cpu_s(proc.pid) - cpu0[p]) * 1000 / args.requests, 3)
                for p, proc in measured
            }
            if not args.json:
                print(f"concurrency: {args.streams} streams at once …", file=sys.stderr)
            conc, mem = asyncio.run(_with_memory(gw.proc.pid, _concurrency(gw.url, key, args)))
            mem["kib_per_stream"] = round(
                (mem["rss_peak_mib"] - mem["rss_idle_mib"]) * 1024 / args.streams, 1
            )
            conc["gateway_memory"] = mem
            if conc["errors"]:  # the gateway's side of the story: its last warnings
                warnings = [
                    ln for ln in gw.log().splitlines() if " WARNING " in ln or " ERROR " in ln
                ]
                conc["gateway_warnings"] = warnings[:10]  # the first: the cause, not its echoes
    return {
        "bench": "gateway",
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "overhead": overhead,
        "concurrency": conc,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
    }


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    o, c = result["overhead"], result["concurrency"]
    print(f"gateway overhead over {o['requests']} sequential streamed requests:")
    for name in ("ttft", "latency"):
        x = o[name]
        print(
            f"  {name:8s} node p50 {x['node']['p50_ms']} ms p99 {x['node']['p99_ms']} ms | gateway "
            f"p50 {x['gateway']['p50_ms']} ms p99 {x['gateway']['p99_ms']} ms | overhead p50 "
            f"{x['overhead_p50_ms']} ms p99 {x['overhead_p99_ms']} ms (target < {TARGET_P99_MS} "
            f"ms: {'met' if o['meets_target'][name] else 'NOT met'}) | a bare relay's overhead p50 "
            f"{x['bare_relay_overhead_p50_ms']} ms p99 {x['bare_relay_overhead_p99_ms']} ms"
        )
        slow = ", ".join(f"{p} {v:.2%}" for p, v in x["slow_share"].items())
        print(f"  {'':8s} requests over 1 ms slower than their path's median: {slow}")
    cpu = o["cpu_ms_per_request"]
    print(f"  CPU per request: gateway {cpu['gateway']} ms, bare relay {cpu['bare_relay']} ms")
    t = o["latency"]
    for name, what in (
        ("gateway_traced", "tracing on (ring only)"),
        ("gateway_otlp", "tracing on + OTLP export"),
    ):
        if name in cpu:
            print(
                f"  {what}: CPU per request {cpu[name]} ms ({cpu[name] / cpu['gateway']:.2f}x the "
                "untraced "
                f"gateway's), latency overhead p50 {t[f'{name}_overhead_p50_ms']} ms p99 "
                f"{t[f'{name}_overhead_p99_ms']} ms"
            )
    if "otlp" in o:
        x = o["otlp"]
        print(
            f"  OTLP receiver: {x['spans']} spans in {x['exports']} exports, {x['bytes']} bytes "
            f"({x['spans'] / o['requests']:.1f} spans per request)"
        )
    print(
        f"{c['streams']} concurrent streams: {c['completed']} completed, errors {c['errors']}, "
        f"wall {c['wall_s']} s, TTFT p50 {c['ttft']['p50_ms']} ms p99 {c['ttft']['p99_ms']} ms, "
        f"{c['tokens_per_s']} tokens/s, gateway RSS {c['gateway_memory']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
