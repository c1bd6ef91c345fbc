"""`python -m bench.kvtransfer` (also `duet bench kvtransfer`): KV block transfers vs memcpy.

Bandwidth and latency of each kvtransfer backend between two real processes, against a plain
memcpy of the same bytes measured in the same run. Layout: SmolLM2-135M's KV cache (30
layers, 3 KV heads, head dim 64, 16-token blocks, bf16: 368,640 bytes per block). For each
backend and each transfer size (1, 16, 64, 256 blocks) an owner process holds a pool and
this process reads scattered blocks of it into its own pool with `Transport.read`; the same
block gather pattern is then copied between two pools of this process with torch `copy_`
(single thread by default, like libc memcpy: the transports move bytes on one thread too).
Transfers and copies alternate rep by rep so machine noise hits both; figures are medians
after warmup. The 1,024-token prompt figure is a 64-block read, both scattered and
contiguous. Bytes are checked once per size. Progress goes to stderr; stdout gets a table,
or one JSON object with --json.

--sweep-ucx repeats the nixl rows under several UCX settings (each run in a fresh process,
since UCX reads its environment once per context) to choose the loopback defaults kept in
kvtransfer/ucx_env.py.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

DESCRIPTION = __doc__.split("\n\n", 1)[1]

SMOLLM2_KV = {
    "num_layers": 30,
    "num_kv_heads": 3,
    "head_dim": 64,
    "block_size": 16,
    "dtype": "bfloat16",
}
POOL_BLOCKS = 600  # > 2 × the largest transfer, so scattered ids really are scattered
OWNER_SEED = 1
PROMPT_TOKENS = 1024

#: --sweep-ucx candidates: the default plus the transports UCX can use between two local
#: processes (cma: one kernel copy; posix/sysv: shared-memory bounce buffers; tcp: loopback).
UCX_SWEEP: list[tuple[str, dict[str, str], list[str]]] = [
    ("default", {}, []),
    ("UCX_TLS=cma,tcp,self", {"UCX_TLS": "cma,tcp,self"}, []),
    ("UCX_TLS=sm,tcp,self", {"UCX_TLS": "sm,tcp,self"}, []),
    ("UCX_TLS=posix,sysv,tcp,self (no cma)", {"UCX_TLS": "posix,sysv,tcp,self"}, []),
    ("UCX_TLS=tcp,self", {"UCX_TLS": "tcp,self"}, []),
    ("no huge pages", {}, ["--no-hugepages"]),
    ("NIXL progress thread on", {}, ["--nixl-option", "progress_thread=1"]),
    ("every post on the agent thread", {}, ["--nixl-option", "inline_max_bytes=0"]),
    ("every post inline on the loop", {}, ["--nixl-option", f"inline_max_bytes={1 << 40}"]),
]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.kvtransfer", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Wall-clock figures need a quiet machine: check the load. UCX settings come from "
               "the environment (UCX_TLS, ...) of this process, which the owner inherits.",
    )  # fmt: skip
    p.add_argument("--backends", default="available",
                   help="comma-separated nixl,ucx,tcp, or 'available' (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--blocks",
        type=_ints,
        default=[1, 16, 64, 256],
        help="transfer sizes in blocks (default 1,16,64,256)",
    )
    p.add_argument(
        "--reps", type=int, default=30, help="timed repetitions per size (default %(default)s)"
    )
    p.add_argument(
        "--warmup", type=int, default=5, help="untimed repetitions first (default %(default)s)"
    )
    p.add_argument(
        "--memcpy-threads",
        type=int,
        default=1,
        help="torch threads of the memcpy baseline (default %(default)s)",
    )
    p.add_argument("--no-hugepages", action="store_true", help="plain 4 KiB pages for every pool")
    p.add_argument(
        "--sweep-ucx", action="store_true", help="nixl under several UCX settings, to pick defaults"
    )
    p.add_argument(
        "--nixl-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="NixlTransport option for both processes, e.g. progress_thread=1 (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--seed", type=int, default=0, help="seed of the scattered block ids")
    # Internal: run as the owner ("P") process of one backend.
    p.add_argument("--owner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    unknown = set(a.backends.split(",")) - {"available", "nixl", "ucx", "tcp"}
    if unknown:
        p.error(f"unknown backend(s) {', '.join(sorted(unknown))}; choose from nixl, ucx, tcp")
    return a


def _transport_options(backend: str, a: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {"hugepages": not a.no_hugepages}
    if backend == "nixl":
        for item in a.nixl_option:
            key, _, value = item.partition("=")
            opts[key] = int(value) if value.isdigit() else value
    return opts


def _layout(num_blocks: int = POOL_BLOCKS) -> Any:
    from protocol.kv_layout import KVLayout

    return KVLayout(**SMOLLM2_KV, num_blocks=num_blocks)


def _pool(layout: Any, hugepages: bool) -> Any:
    """A bf16 pool as the engine holds it, viewed as [blocks, block_bytes] uint8."""
    import torch

    from kvtransfer.memory import allocate_pool

    if hugepages:
        pool = allocate_pool(layout)
    else:
        pool = torch.zeros(layout.num_blocks * layout.block_bytes // 2, dtype=torch.bfloat16)
    return pool.view(torch.uint8).view(layout.num_blocks, layout.block_bytes)


def _fill(pool: Any, seed: int) -> None:
    import torch

    words = pool.view(-1).view(torch.int64)
    torch.arange(words.numel(), out=words)
    words.bitwise_or_(seed << 48)


# -- the owner process -----------------------------------------------------------------


async def _owner(backend: str, a: argparse.Namespace) -> int:
    from kvtransfer import make_transport

    layout = _layout()
    pool = _pool(layout, not a.no_hugepages)
    _fill(pool, OWNER_SEED)
    opts = _transport_options(backend, a)
    transport = make_transport(backend, engine_id=f"bench-owner-{backend}", **opts)
    await transport.register_pool(pool, layout)
    print("METADATA " + base64.b64encode(transport.metadata_bytes()).decode(), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.buffer.read)  # until the reader closes stdin
    await transport.close()
    return 0


def _start_owner(backend: str, a: argparse.Namespace) -> tuple[subprocess.Popen[bytes], bytes]:
    cmd = [sys.executable, "-m", "bench.kvtransfer", "--owner", "--backend", backend]
    cmd += ["--no-hugepages"] if a.no_hugepages else []
    for item in a.nixl_option:
        cmd += ["--nixl-option", item]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    for line in proc.stdout:  # ends at EOF if the owner dies: then we report its failure
        if line.startswith(b"METADATA "):
            return proc, base64.b64decode(line.split()[1])
    proc.wait()
    raise RuntimeError(f"{backend} owner exited with {proc.returncode} before publishing metadata")


# -- the reader (this process) ---------------------------------------------------------


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


async def _bench_backend(backend: str, a: argparse.Namespace, log: Any) -> dict[str, Any]:
    import torch

    from kvtransfer import make_transport

    layout = _layout()
    hugepages = not a.no_hugepages
    local = _pool(layout, hugepages)
    src, dst = _pool(layout, hugepages), _pool(layout, hugepages)
    _fill(src, OWNER_SEED)
    expected = src  # the owner fills its pool exactly like src
    proc, metadata = _start_owner(backend, a)
    opts = _transport_options(backend, a)
    transport = make_transport(backend, engine_id=f"bench-reader-{backend}", **opts)
    rows = []
    try:
        await transport.register_pool(local, layout)
        peer = await transport.add_peer(metadata)
        rng = random.Random(a.seed)
        sizes = [*a.blocks, -PROMPT_TOKENS // layout.block_size]  # negative: contiguous run
        for n in sizes:
            count = abs(n)
            if n > 0:
                remote_ids = rng.sample(range(POOL_BLOCKS), count)
                local_ids = rng.sample(range(POOL_BLOCKS), count)
            else:
                remote_ids = list(range(100, 100 + count))
                local_ids = list(range(300, 300 + count))
            pairs = list(zip(remote_ids, local_ids, strict=True))
            xfer, copy = [], []
            for rep in range(a.warmup + a.reps):
                t0 = time.perf_counter()
                await transport.read(peer, remote_ids, local_ids, timeout=60)
                t1 = time.perf_counter()
                for r, dl in pairs:
                    dst[dl].copy_(src[r])
                t2 = time.perf_counter()
                if rep == 0 and not torch.equal(local[local_ids], expected[remote_ids]):
                    raise RuntimeError(f"{backend}: bytes differ after reading {count} blocks")
                if rep >= a.warmup:
                    xfer.append(t1 - t0)
                    copy.append(t2 - t1)
            nbytes = count * layout.block_bytes
            x_ms, c_ms = _median_ms(xfer), _median_ms(copy)
            row = {
                "backend": backend,
                "blocks": count,
                "pattern": "scattered" if n > 0 else "contiguous",
                "bytes": nbytes,
                "latency_ms": round(x_ms, 4),
                "latency_p90_ms": round(statistics.quantiles(xfer, n=10)[-1] * 1e3, 4),
                "gbps": round(nbytes / x_ms / 1e6, 3),
                "memcpy_ms": round(c_ms, 4),
                "memcpy_gbps": round(nbytes / c_ms / 1e6, 3),
                "ratio": round(c_ms / x_ms, 3),
            }
            rows.append(row)
            log(
                f"{backend:5s} {count:4d} blocks {row['pattern']:10s} {row['latency_ms']:9.3f} ms "
                f"{row['gbps']:7.2f} GB/s  memcpy {row['memcpy_gbps']:7.2f} GB/s  ratio {row['ratio']:.2f}"
            )
    finally:
        await transport.close()
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
    return {"rows": rows}


def _sweep(a: argparse.Namespace, log: Any) -> list[dict[str, Any]]:
    out = []
    for name, env, extra in UCX_SWEEP:
        log(f"sweep: nixl with {name}")
        cmd = [sys.executable, "-m", "bench.kvtransfer", "--backends", "nixl", "--json",
               "--blocks", ",".join(map(str, a.blocks)), "--reps", str(a.reps),
               "--warmup", str(a.warmup), "--seed", str(a.seed), *extra]  # fmt: skip
        r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
        if r.returncode != 0:
            out.append(
                {"setting": name, "env": env, "args": extra, "error": r.stderr.strip()[-300:]}
            )
            continue
        rows = [x for x in json.loads(r.stdout)["results"] if x["pattern"] == "scattered"]
        out.append({"setting": name, "env": env, "args": extra, "rows": rows})
        log("   " + "  ".join(f"{x['blocks']}: {x['gbps']} GB/s ({x['ratio']:.2f})" for x in rows))
    return out


def _table(report: dict[str, Any]) -> str:
    head = f"{'backend':8s}{'blocks':>7s} {'pattern':11s}{'MB':>8s}{'latency ms':>12s}{'GB/s':>8s}{'memcpy GB/s':>13s}{'ratio':>7s}"
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        lines.append(
            f"{r['backend']:8s}{r['blocks']:7d} {r['pattern']:11s}{r['bytes'] / 1e6:8.2f}"
            f"{r['latency_ms']:12.3f}{r['gbps']:8.2f}{r['memcpy_gbps']:13.2f}{r['ratio']:7.2f}"
        )
    lines.append("")
    for b, v in report["prompt_1024_tokens"].items():
        scattered = "" if v["scattered_ms"] is None else f"{v['scattered_ms']:.2f} ms scattered, "
        lines.append(
            f"1,024-token prompt ({v['blocks']} blocks, {v['bytes'] / 1e6:.1f} MB) over {b}: "
            f"{scattered}{v['contiguous_ms']:.2f} ms contiguous"
        )
    for b, why in report["skipped"].items():
        lines.append(f"skipped {b}: {why}")
    t = report["target"]
    if t["nixl_min_ratio_64_plus"] is not None:
        lines.append(
            f"target nixl >= 50% of memcpy at >= 64 blocks: min ratio {t['nixl_min_ratio_64_plus']:.2f} "
            f"-> {'met' if t['met'] else 'NOT met'}"
        )
    for s in report.get("ucx_sweep", []):
        cells = "  ".join(
            f"{x['blocks']}:{x['gbps']:.2f} GB/s" for x in s.get("rows", [])
        ) or s.get("error")
        lines.append(f"sweep {s['setting']:40s} {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.owner:
        return asyncio.run(_owner(a.backend, a))

    def log(msg: str) -> None:
        print(f"[bench.kvtransfer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    import torch

    from kvtransfer import BACKENDS, unavailable_reason
    from kvtransfer.ucx_env import ucx_environment

    torch.set_num_threads(a.memcpy_threads)
    wanted = list(BACKENDS) if a.backends == "available" else a.backends.split(",")
    layout = _layout()
    report: dict[str, Any] = {
        "layout": {**SMOLLM2_KV, "block_bytes": layout.block_bytes, "pool_blocks": POOL_BLOCKS},
        "reps": a.reps,
        "warmup": a.warmup,
        "memcpy_threads": a.memcpy_threads,
        "hugepages": not a.no_hugepages,
        "nixl_options": a.nixl_option,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "ucx_env": ucx_environment(),
        "results": [],
        "prompt_1024_tokens": {},
        "skipped": {},
    }
    for backend in wanted:
        reason = unavailable_reason(backend)
        if reason is not None:
            report["skipped"][backend] = reason
            log(f"skipping {backend}: {reason}")
            continue
        log(f"{backend}: starting the owner process")
        rows = asyncio.run(_bench_backend(backend, a, log))["rows"]
        report["results"].extend(r for r in rows if r["pattern"] == "scattered")
        prompt = next(r for r in rows if r["pattern"] == "contiguous")
        scattered = next(
            (r for r in rows if r["blocks"] == prompt["blocks"] and r["pattern"] == "scattered"),
            None,
        )
        report["results"].append(prompt)
        report["prompt_1024_tokens"][backend] = {
            "blocks": prompt["blocks"],
            "bytes": prompt["bytes"],
            "contiguous_ms": prompt["latency_ms"],
            "scattered_ms": scattered["latency_ms"] if scattered else None,
        }
    nixl = [r["ratio"] for r in report["results"] if r["backend"] == "nixl" and r["blocks"] >= 64]
    report["target"] = {
        "nixl_min_ratio_64_plus": min(nixl) if nixl else None,
        "met": bool(nixl) and min(nixl) >= 0.5,
    }
    if a.sweep_ucx:
        report["ucx_sweep"] = _sweep(a, log)
    print(json.dumps(report, indent=2) if a.json else _table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
