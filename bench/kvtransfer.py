"""`python -m bench.kvtransfer` (also `duet bench kvtransfer`): KV block transfers vs memcpy.

Bandwidth and latency of each kvtransfer backend between two real processes, against a plain
memcpy of the same bytes measured in the same run. Layout: SmolLM2-135M's KV cache (30
layers, 3 KV heads, head dim 64, 16-token blocks, bf16: 368,640 bytes per block). For each
backend and each transfer size (1, 16, 64, 256 blocks) an owner process holds a pool and
this process reads scattered blocks of it into its own pool with `Transport.read`. The
baseline ("memcpy") is the fastest plain copy of the same block pattern between two pools of
this process, at the same thread count (1 by default: the transports move bytes on one
thread too): the faster of one `copy_` per run of blocks consecutive on both sides, and an
`index_select` gather + `index_copy_` scatter. Beside it, one contiguous `copy_` of the same
total size shows what the scattering itself costs. Transfers and copies alternate rep by rep
so machine noise hits all of them; figures are medians after warmup, with p10/p90. The
content digests a reader checks (protocol/kv_digest.py) are timed two ways against the plain
read of each rep: hashed after the read on the reader's thread ("after", how the engine did it
before), and hashed as the blocks land (kvtransfer/hashed_read.py, what the nodes do now) then
bound and compared as the engine does, overlapped with the read and once it is over (the
default where the host has no spare core); the plain read alternates its place rep by rep, and
each overhead is the median of the reps' paired ratios. The
1,024-token prompt figure is a 64-block read, both scattered and contiguous. Bytes (of the
transfer and of every baseline) are checked once per size. Progress goes to stderr; stdout
gets a table, or one JSON object with --json.

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

from bench.stats import spread

DESCRIPTION = __doc__.split("\n\n", 1)[1]

SMOLLM2_KV: dict[str, Any] = {
    "num_layers": 30,
    "num_kv_heads": 3,
    "head_dim": 64,
    "block_size": 16,
    "dtype": "bfloat16",
}
POOL_BLOCKS = 600  # > 2 × the largest transfer, so scattered ids really are scattered
QUICK_POOL_BLOCKS = 200
#: the contiguous 64-block runs sit at pool/6 (owner) and pool/2 (reader): room for both
MIN_POOL_BLOCKS = 200
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
        prog="python -m bench.kvtransfer",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Wall-clock figures need a quiet machine: check the load. UCX settings come from "
        "the environment (UCX_TLS, ...) of this process, which the owner inherits.",
    )
    p.add_argument(
        "--backends",
        default="available",
        help="comma-separated nixl,ucx,tcp, or 'available' (default: %(default)s)",
    )
    p.add_argument(
        "--blocks",
        type=_ints,
        default=None,
        help="transfer sizes in blocks (default 1,16,64,256; quick 1,16)",
    )
    p.add_argument(
        "--reps", type=int, default=None, help="timed repetitions per size (default 30; quick 5)"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed repetitions first (default 5; quick 2)"
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
    p.add_argument(
        "--pool-blocks",
        type=int,
        default=None,
        help=f"blocks per pool (default {POOL_BLOCKS}; quick {QUICK_POOL_BLOCKS}); "
        "at least twice the largest transfer",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="1,16 blocks, 5 reps, small pools: a smoke test, not a measurement",
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
    preset = (
        {"blocks": [1, 16], "reps": 5, "warmup": 2, "pool_blocks": QUICK_POOL_BLOCKS}
        if a.quick
        else {"blocks": [1, 16, 64, 256], "reps": 30, "warmup": 5, "pool_blocks": POOL_BLOCKS}
    )
    for k, v in preset.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.reps < 1 or a.warmup < 0 or not a.blocks or min(a.blocks) < 1:
        p.error("--reps must be >= 1, --warmup >= 0 and every --blocks size >= 1")
    need = (
        MIN_POOL_BLOCKS if a.owner else max(2 * max(a.blocks), MIN_POOL_BLOCKS)
    )  # the owner never reads
    if a.pool_blocks < need:
        p.error(f"--pool-blocks {a.pool_blocks} is too small: these sizes need at least {need}")
    return a


def _transport_options(backend: str, a: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {"hugepages": not a.no_hugepages}
    if backend == "nixl":
        for item in a.nixl_option:
            key, _, value = item.partition("=")
            opts[key] = int(value) if value.isdigit() else value
    return opts


def _layout(num_blocks: int) -> Any:
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

    layout = _layout(a.pool_blocks)
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
    cmd = [
        sys.executable,
        "-m",
        "bench.kvtransfer",
        "--owner",
        "--backend",
        backend,
        "--pool-blocks",
        str(a.pool_blocks),
    ]
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


def _ms(xs: list[float]) -> dict[str, float]:
    return {k: round(v * 1e3, 4) for k, v in spread(xs).items() if k != "n"}


class _Baselines:
    """Plain copies of one read's block pattern between two pools of this process."""

    def __init__(
        self, src: Any, dst: Any, remote_ids: list[int], local_ids: list[int], contiguous_at: int
    ) -> None:
        import torch

        from kvtransfer.regions import coalesce

        self.src, self.dst = src, dst
        self.runs = coalesce(remote_ids, local_ids)
        self.ridx = torch.tensor(remote_ids, dtype=torch.long)
        self.lidx = torch.tensor(local_ids, dtype=torch.long)
        self.gathered = torch.empty(len(remote_ids), src.shape[1], dtype=src.dtype)
        self.count = len(remote_ids)
        self.contiguous_at = contiguous_at

    def runs_copy(self) -> None:
        """One copy_ per run of blocks consecutive on both sides (what NIXL merges too)."""
        for r in self.runs:
            self.dst[r.local_start : r.local_start + r.num_blocks].copy_(
                self.src[r.remote_start : r.remote_start + r.num_blocks]
            )

    def index_copy(self) -> None:
        """A gather into a staging buffer, then a scatter: two passes, no Python loop."""
        import torch

        torch.index_select(self.src, 0, self.ridx, out=self.gathered)
        self.dst.index_copy_(0, self.lidx, self.gathered)

    def contiguous_copy(self) -> None:
        """The same number of bytes as one contiguous range: the floor of any block copy."""
        c, n = self.contiguous_at, self.count
        self.dst[c : c + n].copy_(self.src[:n])

    def correct(self) -> bool:
        import torch

        return bool(torch.equal(self.dst[self.lidx], self.src[self.ridx]))


BASELINES = ("runs_copy", "index_copy", "contiguous_copy")


def _digest_blocks(pool: Any, block_ids: list[int]) -> list[int]:
    """A check of the blocks read after the read, on the reader's thread: digest each one."""
    from protocol.kv_digest import block_digest

    return [block_digest(memoryview(pool[b].numpy()).cast("B"), b, 0) for b in block_ids]


async def _landed_read(
    transport: Any, peer: Any, remote_ids: list[int], local_ids: list[int], overlap: bool
) -> tuple[list[int], float]:
    """The nodes' read: blocks hashed as they land, then bound as the engine binds them (on the
    engine's thread: that time is returned too)."""
    from kvtransfer.hashed_read import read_hashed
    from protocol.kv_digest import finish_digest

    states = await read_hashed(transport, peer, remote_ids, local_ids, timeout=60, overlap=overlap)
    t0 = time.perf_counter()
    digests = [finish_digest(states[b], b, 0) for b in local_ids]
    return digests, time.perf_counter() - t0


def _paired_overhead(on: list[float], off: list[float]) -> float:
    return round(statistics.median(a / b - 1 for a, b in zip(on, off, strict=True)), 4)


async def _bench_backend(backend: str, a: argparse.Namespace, log: Any) -> dict[str, Any]:
    import torch

    from kvtransfer import make_transport

    layout = _layout(a.pool_blocks)
    pool_blocks = layout.num_blocks
    hugepages = not a.no_hugepages
    local = _pool(layout, hugepages)
    src, dst = _pool(layout, hugepages), _pool(layout, hugepages)
    _fill(src, OWNER_SEED)
    expected = src  # the owner fills its pool exactly like src
    proc, metadata = _start_owner(backend, a)
    opts = _transport_options(backend, a)
    transport = make_transport(backend, engine_id=f"bench-reader-{backend}", **opts)
    if transport.backend != backend:  # strict mode raises before this; say so in any case
        raise RuntimeError(f"asked for the {backend} backend but got {transport.backend}")
    rows = []
    try:
        await transport.register_pool(local, layout)
        peer = await transport.add_peer(metadata)
        rng = random.Random(a.seed)
        sizes = [*a.blocks, -PROMPT_TOKENS // layout.block_size]  # negative: contiguous run
        for n in sizes:
            count = abs(n)
            if n > 0:
                remote_ids = rng.sample(range(pool_blocks), count)
                local_ids = rng.sample(range(pool_blocks), count)
            else:
                remote_ids = list(range(pool_blocks // 6, pool_blocks // 6 + count))
                local_ids = list(range(pool_blocks // 2, pool_blocks // 2 + count))
            base = _Baselines(src, dst, remote_ids, local_ids, contiguous_at=pool_blocks - count)
            xfer: list[float] = []
            digests: list[float] = []
            after: list[float] = []  # the read, then its digests on this thread
            landed: list[float] = []  # the read hashing blocks as they land, then the binding
            plain: list[float] = []  # read_hashed without overlap: hashed once the read is over
            binding: list[float] = []  # the binding alone: what is left on the engine's thread
            times: dict[str, list[float]] = {k: [] for k in BASELINES}
            for rep in range(a.warmup + a.reps):
                t0 = time.perf_counter()
                await transport.read(peer, remote_ids, local_ids, timeout=60)
                t1 = time.perf_counter()
                if rep == 0 and not torch.equal(local[local_ids], expected[remote_ids]):
                    raise RuntimeError(f"{backend}: bytes differ after reading {count} blocks")
                for k in BASELINES:
                    if rep == 0 and k != "contiguous_copy":
                        dst.zero_()
                    t2 = time.perf_counter()
                    getattr(base, k)()
                    t3 = time.perf_counter()
                    if rep == 0 and k != "contiguous_copy" and not base.correct():
                        raise RuntimeError(
                            f"baseline {k} copied the wrong bytes for {count} blocks"
                        )
                    if rep >= a.warmup:
                        times[k].append(t3 - t2)
                t4 = time.perf_counter()
                want = _digest_blocks(local, local_ids)
                t5 = time.perf_counter()
                t6 = time.perf_counter()
                got, bound = await _landed_read(transport, peer, remote_ids, local_ids, True)
                t7 = time.perf_counter()
                got2, _ = await _landed_read(transport, peer, remote_ids, local_ids, False)
                t8 = time.perf_counter()
                if rep % 2:  # the other order too: a read right after another finds warmer caches
                    t0 = time.perf_counter()
                    await transport.read(peer, remote_ids, local_ids, timeout=60)
                    t1 = time.perf_counter()
                if rep == 0 and not got == got2 == want:
                    raise RuntimeError(f"{backend}: digests of landed blocks differ ({count})")
                if rep >= a.warmup:
                    xfer.append(t1 - t0)
                    digests.append(t5 - t4)
                    after.append(t1 - t0 + t5 - t4)
                    landed.append(t7 - t6)
                    plain.append(t8 - t7)
                    binding.append(bound)
            nbytes = count * layout.block_bytes
            x = _ms(xfer)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            method = min(("runs_copy", "index_copy"), key=med.__getitem__)
            c_ms, contig_ms = med[method], med["contiguous_copy"]
            row = {
                "backend": backend,
                "blocks": count,
                "pattern": "scattered" if n > 0 else "contiguous",
                "runs": len(base.runs),
                "bytes": nbytes,
                "latency_ms": x["median"],
                "latency_p10_ms": x["p10"],
                "latency_p90_ms": x["p90"],
                "gbps": round(nbytes / x["median"] / 1e6, 3),
                "memcpy_method": method,
                "memcpy_ms": round(c_ms, 4),
                "memcpy_gbps": round(nbytes / c_ms / 1e6, 3),
                "memcpy_candidates_ms": {k: _ms(times[k]) for k in ("runs_copy", "index_copy")},
                "contiguous_copy_ms": round(contig_ms, 4),
                "contiguous_copy_gbps": round(nbytes / contig_ms / 1e6, 3),
                "ratio": round(c_ms / x["median"], 3),
                "ratio_vs_contiguous_copy": round(contig_ms / x["median"], 3),
                # the reader's check of what it read (protocol/kv_digest.py): time and share
                "digest_ms": round(statistics.median(digests) * 1e3, 4),
                "digest_gbps": round(nbytes / statistics.median(digests) / 1e9, 3),
                "digest_share_of_transfer": round(
                    statistics.median(digests) * 1e3 / x["median"], 4
                ),
                # digest on vs off, paired rep by rep: after the read, and as the blocks land
                "checked_after_ms": round(statistics.median(after) * 1e3, 4),
                "checked_landed_ms": round(statistics.median(landed) * 1e3, 4),
                "overhead_after": _paired_overhead(after, xfer),
                "overhead_landed": _paired_overhead(landed, xfer),
                "checked_plain_ms": round(statistics.median(plain) * 1e3, 4),
                "overhead_plain": _paired_overhead(plain, xfer),
                # the engine thread's part of the check: all digests before, the binding now
                "engine_thread_before_ms": round(statistics.median(digests) * 1e3, 4),
                "engine_thread_now_ms": round(statistics.median(binding) * 1e3, 4),
            }
            rows.append(row)
            log(
                f"{backend:5s} {count:4d} blocks {row['pattern']:10s} {row['latency_ms']:9.3f} ms "
                f"{row['gbps']:7.2f} GB/s  memcpy ({method}) {row['memcpy_gbps']:7.2f} GB/s  "
                f"contiguous copy {row['contiguous_copy_gbps']:7.2f} GB/s  ratio "
                f"{row['ratio']:.2f}  digest {row['digest_gbps']:6.2f} GB/s; checked read "
                f"after {row['overhead_after']:+.1%}, as landed {row['overhead_landed']:+.1%}"
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
        cmd = [
            sys.executable,
            "-m",
            "bench.kvtransfer",
            "--backends",
            "nixl",
            "--json",
            "--blocks",
            ",".join(map(str, a.blocks)),
            "--reps",
            str(a.reps),
            "--warmup",
            str(a.warmup),
            "--seed",
            str(a.seed),
            "--pool-blocks",
            str(a.pool_blocks),
            *extra,
        ]
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
    head = (
        f"{'backend':8s}{'blocks':>7s} "
        f"{'pattern':11s}{'MB':>8s}{'latency ms':>12s}{'p10-p90':>16s}{'GB/s':>8s}"
        f"{'memcpy GB/s':>13s} {'(method)':12s}{'contig GB/s':>12s}{'ratio':>7s}"
    )
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        band = f"{r['latency_p10_ms']:.3f}-{r['latency_p90_ms']:.3f}"
        lines.append(
            f"{r['backend']:8s}{r['blocks']:7d} {r['pattern']:11s}{r['bytes'] / 1e6:8.2f}"
            f"{r['latency_ms']:12.3f}{band:>16s}{r['gbps']:8.2f}{r['memcpy_gbps']:13.2f} "
            f"{r['memcpy_method']:12s}"
            f"{r['contiguous_copy_gbps']:12.2f}{r['ratio']:7.2f}"
        )
    lines.append("ratio = memcpy time / transfer time (1.0: as fast as the best in-process copy)")
    lines.append("")
    lines.append(
        "digests checked (on) vs not (off), median of paired reps: hashed after the read on the "
        "engine's thread (before) / read_hashed overlapped with the read / read_hashed after it "
        f"(the default on a host {'with' if report['spare_core'] else 'without'} a spare core: "
        f"{'overlap' if report['spare_core'] else 'after'})"
    )
    for r in report["results"]:
        lines.append(
            f"  {r['backend']:5s}{r['blocks']:5d} {r['pattern']:11s} off {r['latency_ms']:8.3f} ms"
            f"  before {r['checked_after_ms']:8.3f} ms ({r['overhead_after']:+.1%})"
            f"  overlap {r['checked_landed_ms']:8.3f} ms ({r['overhead_landed']:+.1%})"
            f"  after {r['checked_plain_ms']:8.3f} ms ({r['overhead_plain']:+.1%})"
            f"  engine thread {r['engine_thread_before_ms']:7.3f} -> "
            f"{r['engine_thread_now_ms']:.3f} ms"
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
            "target nixl >= 50% of memcpy at >= 64 blocks: min ratio "
            f"{t['nixl_min_ratio_64_plus']:.2f} -> {'met' if t['met'] else 'NOT met'}"
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
    from kvtransfer.hashed_read import spare_core
    from kvtransfer.ucx_env import ucx_environment
    from runtime.strict import FallbackRefused, strict_mode

    torch.set_num_threads(a.memcpy_threads)
    wanted = list(BACKENDS) if a.backends == "available" else a.backends.split(",")
    layout = _layout(a.pool_blocks)
    report: dict[str, Any] = {
        "layout": {**SMOLLM2_KV, "block_bytes": layout.block_bytes, "pool_blocks": a.pool_blocks},
        "quick": a.quick,
        "reps": a.reps,
        "warmup": a.warmup,
        "statistic": "median (p10/p90 beside latency)",
        "memcpy_threads": a.memcpy_threads,
        "memcpy": "fastest of runs_copy (one copy_ per run of blocks consecutive on both sides) "
        "and index_copy (index_select gather + index_copy_ scatter), same block pattern and "
        "threads; contiguous_copy: one copy_ of the same total bytes",
        "hugepages": not a.no_hugepages,
        "nixl_options": a.nixl_option,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "spare_core": spare_core(),
        "ucx_env": ucx_environment(),
        "results": [],
        "prompt_1024_tokens": {},
        "skipped": {},
    }
    for backend in wanted:
        reason = unavailable_reason(backend)
        if reason is not None:
            if strict_mode():  # CI: a backend that cannot run is a failure, not a skipped row
                raise FallbackRefused(
                    f"kv transfer backend {backend} cannot run here ({reason}); "
                    "strict mode (CI/DUET_STRICT) refuses to skip it"
                )
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
