"""`python -m bench.route`: how fast the coordinator decides a route.

A synthetic cluster (default: 64 nodes, half prefill and half decode, 100,000 distinct cached
blocks) is loaded into a real `Coordinator` (prefix index, router, pending accounting,
metrics), and 1,000-block prompts are routed:

- in-process: `Coordinator.route` called in a loop (decision latency without HTTP);
- over HTTP: the real coordinator app serves the same state in a child process, and
  `--concurrency` clients POST /route (latency seen by the client, JSON both ways).

Prompts come from families of chained block hashes; each family's prefix is cached on a few
nodes at random depths, and some prompts diverge from their family part-way, so matches stop
at every depth. Prints a table, or one JSON object with --json. Target: p99 < 1 ms in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

MODEL = "bench-model"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.route",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=int, default=64, help="nodes in the synthetic cluster")
    p.add_argument(
        "--blocks", type=int, default=100_000, help="distinct cached blocks in the index"
    )
    p.add_argument("--prompt-blocks", type=int, default=1000, help="blocks per routed prompt")
    p.add_argument("--decisions", type=int, default=5000, help="in-process decisions to time")
    p.add_argument(
        "--http-decisions", type=int, default=2000, help="decisions to time over HTTP (0: skip)"
    )
    p.add_argument("--concurrency", type=int, default=8, help="HTTP clients in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--serve", type=int, default=None, help=argparse.SUPPRESS
    )  # child: serve on this port
    a = p.parse_args(argv)
    if a.nodes < 2 or a.blocks < a.prompt_blocks or a.prompt_blocks < 1:
        p.error("need ≥ 2 nodes and blocks ≥ prompt-blocks ≥ 1")
    return a


def build(a: argparse.Namespace) -> tuple[Any, list[list[int]]]:
    """A Coordinator holding the synthetic cluster, and the prompts' block hash lists."""
    from coordinator.etcd_store import EtcdStore
    from coordinator.nodes import NodeView
    from coordinator.route_config import PolicyConfig
    from coordinator.service import Coordinator, CoordinatorConfig
    from protocol.cluster import NodeInfo, Role
    from protocol.kv_events import LoadFrame

    rng = random.Random(a.seed)
    # Never started: the store is only constructed (aetcd connects lazily), no etcd is needed.
    cfg = CoordinatorConfig(
        etcd="http://127.0.0.1:9",
        index_max_blocks=max(a.blocks, 1),
        policy=PolicyConfig(stale_load_s=1e9, pending_max_age_s=1.0),
    )
    c = Coordinator(cfg, EtcdStore(cfg.etcd))
    now = time.monotonic()
    capacity = 10**7  # pending decisions must not fill the synthetic pools during the run
    ids = []
    for i in range(a.nodes):
        role: Role = "prefill" if i % 2 == 0 else "decode"
        info = NodeInfo(
            node_id=f"{role}-{i:03d}",
            role=role,
            url=f"http://10.0.{i // 256}.{i % 256}:8000",
            model=MODEL,
            engine_id=f"e{i}",
            block_size=16,
            kv_layout_hash="L",
            kv_capacity_blocks=capacity,
            max_model_len=a.prompt_blocks * 16 + 4096,
            started_at=0.0,
        )
        v = NodeView(info=info, connected=True, load_at=now)
        free = rng.randint(capacity // 2, capacity)
        v.load = LoadFrame(
            seq=0,
            ts=0.0,
            num_requests_waiting=rng.randint(0, 4),
            num_requests_running=rng.randint(0, 32),
            kv_cache_usage_perc=1 - free / capacity,
            queued_prefill_tokens=rng.randint(0, 4000),
            kv_blocks_free=free,
            kv_blocks_total=capacity,
        )
        c.views[info.node_id] = v
        ids.append(info.node_id)
    families = [
        [rng.getrandbits(64) for _ in range(a.prompt_blocks)]
        for _ in range(a.blocks // a.prompt_blocks)
    ]
    for fam in families:
        holders = rng.sample(ids, min(4, len(ids)))
        c.index.store(holders[0], fam)  # every block is cached somewhere: the index holds them all
        for h in holders[1:]:
            c.index.store(h, fam[: rng.randint(1, a.prompt_blocks)])
    prompts = []
    for _ in range(256):
        fam = rng.choice(families)
        cut = rng.randint(0, a.prompt_blocks) if rng.random() < 0.5 else a.prompt_blocks
        prompts.append(fam[:cut] + [rng.getrandbits(64) for _ in range(a.prompt_blocks - cut)])
    return c, prompts


def _stats(lat_s: list[float], wall_s: float) -> dict[str, Any]:
    lat = sorted(lat_s)
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {
        "decisions": len(lat),
        "decisions_per_s": round(len(lat) / wall_s, 1),
        "p50_ms": round(q[49] * 1e3, 4),
        "p99_ms": round(q[98] * 1e3, 4),
        "mean_ms": round(statistics.fmean(lat) * 1e3, 4),
        "max_ms": round(lat[-1] * 1e3, 4),
    }


def in_process(c: Any, prompts: list[list[int]], n: int, prompt_blocks: int) -> dict[str, Any]:
    from protocol.route import RouteRequest

    reqs = [
        RouteRequest(
            model=MODEL, block_hashes=p, num_prompt_tokens=prompt_blocks * 16 + 5, max_tokens=256
        )
        for p in prompts
    ]
    for r in reqs[:50]:  # warm-up
        c.route(r)
    lat: list[float] = []
    cpu: list[float] = []
    outcomes: dict[str, int] = {}
    perf, thread = time.perf_counter, time.thread_time
    t0 = perf()
    for i in range(n):
        t, tc = perf(), thread()
        d = c.route(reqs[i % len(reqs)])
        lat.append(perf() - t)
        cpu.append(thread() - tc)
        outcomes[d.outcome] = outcomes.get(d.outcome, 0) + 1
    out = _stats(lat, perf() - t0)
    # CPU time per decision: what the wall-clock figures would be on an idle machine (a busy
    # one preempts the loop and inflates the tail).
    q = statistics.quantiles(sorted(cpu), n=100, method="inclusive")
    out["cpu_p50_ms"], out["cpu_p99_ms"] = round(q[49] * 1e3, 4), round(q[98] * 1e3, 4)
    out["outcomes"] = outcomes
    return out


def serve(a: argparse.Namespace) -> int:
    from aiohttp import web

    from coordinator.app import make_app

    c, _ = build(a)
    app = make_app(c.config, coordinator=c)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", a.serve).start()
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    return 0


async def _http_load(url: str, bodies: list[bytes], n: int, concurrency: int) -> dict[str, Any]:
    import aiohttp

    lat: list[float] = []
    errors: dict[int, int] = {}
    counter = iter(range(n))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        hdr = {"Content-Type": "application/json"}
        for b in bodies[:20]:  # warm-up
            async with s.post(url, data=b, headers=hdr) as r:
                await r.read()

        async def worker() -> None:
            for i in counter:
                t = time.perf_counter()
                async with s.post(url, data=bodies[i % len(bodies)], headers=hdr) as r:
                    await r.read()
                    if r.status != 200:
                        errors[r.status] = errors.get(r.status, 0) + 1
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    out = _stats(lat, wall)
    out["concurrency"] = concurrency
    out["errors"] = errors
    return out


def over_http(a: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from bench.procs import free_port

    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "bench.route",
        "--serve",
        str(port),
        "--nodes",
        str(a.nodes),
        "--blocks",
        str(a.blocks),
        "--prompt-blocks",
        str(a.prompt_blocks),
        "--seed",
        str(a.seed),
    ]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("the bench coordinator did not start")
        bodies = [
            json.dumps(
                {
                    "model": MODEL,
                    "block_hashes": p,
                    "num_prompt_tokens": a.prompt_blocks * 16 + 5,
                    "max_tokens": 256,
                }
            ).encode()
            for p in prompts
        ]
        return asyncio.run(
            _http_load(f"http://127.0.0.1:{port}/route", bodies, a.http_decisions, a.concurrency)
        )
    finally:
        child.terminate()
        child.wait(10)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.serve is not None:
        return serve(a)

    def log(msg: str) -> None:  # progress on stderr, results on stdout
        print(msg, file=sys.stderr, flush=True)

    log(f"building a {a.nodes}-node cluster with {a.blocks:,} cached blocks ...")
    c, prompts = build(a)
    log(f"routing {a.decisions:,} prompts of {a.prompt_blocks} blocks in-process ...")
    result: dict[str, Any] = {
        "config": {
            "nodes": a.nodes,
            "index_blocks": len(c.index),
            "prompt_blocks": a.prompt_blocks,
            "seed": a.seed,
        },
        "in_process": in_process(c, prompts, a.decisions, a.prompt_blocks),
    }
    if a.http_decisions:
        log(f"routing {a.http_decisions:,} prompts over HTTP with {a.concurrency} clients ...")
        result["http"] = over_http(a, prompts)
    result["load_average_1m"] = round(os.getloadavg()[0], 2)
    result["target_p99_ms_in_process"] = 1.0
    result["meets_target"] = result["in_process"]["p99_ms"] < 1.0
    if a.json:
        print(json.dumps(result))
        return 0
    print(f"{'':12} {'decisions/s':>12} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for k in ("in_process", "http"):
        if k in result:
            r = result[k]
            print(
                f"{k:12} {r['decisions_per_s']:>12,.0f} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} "
                f"{r['max_ms']:>9.3f}"
            )
    print(
        f"in-process outcomes: {result['in_process']['outcomes']}  (target p99 < 1 ms: "
        f"{'met' if result['meets_target'] else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
