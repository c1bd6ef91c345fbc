"""`duet bench profile` (also `python -m bench.profile`): measure one node kind and write its
profile (JSON, sim/profile.py's schema) for the simulator, `duet plan` and the autoscaler.

A node kind = model × dtype × quantization × threads × engine (the native engine here). The
engine's real EngineCore runs designed step mixes — prefill alone (short prompts, and long ones
in chunks so the attention term shows), decode batches of 1..N sequences at several contexts,
and decode batches with a prefill chunk riding along — and every step is timed (wall clock
around `EngineCore.step`, which is what a node's step loop costs: schedule + forward +
sample). Each step's features come from the chunks the scheduler handed the runner. The
step-time model is fitted to all samples (non-negative least squares, relative error) and
the profile keeps the samples, the fit error and the held-out error.

KV bytes per token come from the engine's own KV layout. The transport figures come from
`bench.kvtransfer` between two real processes (latency + bytes/bandwidth fitted to its
scattered reads of 1..64 blocks). Per-request and per-token overheads outside the forward pass
are measured with --overheads in a running cluster (`duet up`, sim/overheads.py: the gateway's,
coordinator's and node loop's own CPU clocks, and the TTFT left outside the step); without it
they are the --overhead-ms / --pd-hop-ms defaults, marked modelled. --overheads-only measures them
alone and updates the profile at --out. The co-run factors (--corun, on by default; --corun-only
on an existing profile) time a prefill and a decode step in pairs beside a second, busy engine
process of the same kind, stopped for one step and running for the next (sim/corun.py): what a
step costs while another node runs on the same machine (`duet plan --one-host`).

Wall-clock figures need a quiet machine: the load average is recorded in the profile.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from sim import profile as pf

if TYPE_CHECKING:
    from engine.config import Quantization
    from engine.core import EngineCore
    from engine.scheduler import ScheduledChunk

#: a progress line to stderr
Log = Callable[[str], None]

DESCRIPTION = __doc__.split("\n\n", 1)[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="duet bench profile",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", default=None, help="model name or directory (default: duet's default model)"
    )
    p.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    p.add_argument("--quantization", choices=["none", "int8", "int4", "int4-g64"], default="none")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument(
        "--kv-memory", default="1GiB", help="KV pool size of the profiled node kind (default 1GiB)"
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--decode-batches", default="1,4,16,32,64", help="decode batch sizes to time")
    p.add_argument(
        "--contexts", default="128,512,1024", help="context lengths of the decode batches"
    )
    p.add_argument(
        "--reps", type=int, default=3, help="timed decode steps per (batch, context) (default 3)"
    )
    p.add_argument(
        "--transport", default="nixl", help="KV transport to measure: nixl, ucx, tcp, or none"
    )
    p.add_argument(
        "--overhead-ms",
        type=float,
        default=2.0,
        help="per-request time outside the forward pass (gateway + route + leg HTTP), ms",
    )
    p.add_argument(
        "--pd-hop-ms",
        type=float,
        default=3.0,
        help="extra time of a disaggregated request's P→D hop, ms",
    )
    p.add_argument(
        "--overheads",
        choices=["none", "colocated", "pd"],
        default="none",
        help="measure per-request/per-token overheads in a running cluster (duet up): colocated, "
        "or colocated + 1P1D for the P→D hop (default none: the --overhead-ms defaults)",
    )
    p.add_argument(
        "--overheads-only",
        action="store_true",
        help="measure only the overheads (--overheads, default pd) and update the profile at --out",
    )
    p.add_argument(
        "--overhead-requests", type=int, default=12, help="requests per overhead shape (default 12)"
    )
    p.add_argument(
        "--corun",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time a prefill and a decode step beside a second, busy engine process of the same "
        "kind (the slowdown of nodes sharing one machine: sim/corun.py; default on)",
    )
    p.add_argument(
        "--corun-only",
        action="store_true",
        help="measure only the co-run factors (the node kind of "
        "--model/--dtype/--threads/--quantization) and update the profile at --out",
    )
    p.add_argument("--name", default=None, help="node kind name (default: model-dtype-quant-tN)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument(
        "--refit",
        action="store_true",
        help="refit the samples of the profile at --out (no measurement)",
    )
    p.add_argument(
        "--quick", action="store_true", help="a few points only: a smoke test, not a measurement"
    )
    return p.parse_args(argv)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


class _Recorder:
    """Wraps the runner's `execute` of one EngineCore instance to see each step's chunks."""

    def __init__(self, core: EngineCore) -> None:
        self.chunks: list[Any] = []
        real = core.runner.execute

        def execute(chunks: list[ScheduledChunk]) -> Any:
            self.chunks = list(chunks)
            return real(chunks)

        core.runner.execute = execute  # type: ignore[method-assign]  # wrapped to see each step


def _step(core: EngineCore, rec: _Recorder, samples: list[pf.StepSample]) -> None:
    from sim.node import features

    rec.chunks = []
    c0, t0 = time.process_time(), time.perf_counter()
    core.step()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if rec.chunks:
        f = features(rec.chunks)
        samples.append(
            pf.StepSample(
                f.prefill_tokens,
                f.decode_seqs,
                f.context_tokens,
                f.attention,
                dt,
                cpu,
                f.cached_attention,
            )
        )


def _measure(core: EngineCore, a: argparse.Namespace, log: Log) -> list[pf.StepSample]:
    from sim.driver import Driver

    rec = _Recorder(core)
    d = Driver(core, seed=0)
    samples: list[pf.StepSample] = []

    # warm up (first steps allocate and compile)
    d.add(64, 4)
    while core.has_work():
        core.step()
    prompts = [16, 64, 256, 512] if a.quick else [16, 32, 64, 128, 256, 384, 512]
    for plen in prompts:
        for _ in range(1 if a.quick else 2):
            d.add(plen, 1)
            while core.has_work():
                _step(core, rec, samples)
    log(f"prefill: {len(samples)} steps")
    long = [1024] if a.quick else [1024, 2048]
    for plen in long:  # chunked: chunks at growing starts, so attention's quadratic part shows
        d.add(min(plen, a.max_model_len - 8), 1)
        while core.has_work():
            _step(core, rec, samples)
    # prefix-cache hits: a suffix atop a prefix an earlier request computed — the step a
    # prefix-routed request runs (few new tokens, a long start). Without these the fit saw starts
    # > 0 only in 512-token chunk continuations and extrapolated this shape (well, it turned out:
    # 190 ms modelled against 186 measured for 128 tokens atop 384, round 8, 05 Dec).
    block = core.pool.block_size
    hits = (
        [(8, 16), (16, 64)]
        if a.quick
        else [(p, n) for p in (8, 24, 48) for n in (16, 64, 128, 256)]
    )
    for blocks, suffix in hits:
        prefix = d.tokens(blocks * block)
        if len(prefix) + max(suffix, block) > a.max_model_len - 8:
            continue
        d.add(block, 1, prefix=prefix)  # computes the prefix; its full blocks stay cached
        while core.has_work():
            core.step()
        d.add(suffix, 1, prefix=prefix)
        while core.has_work():
            _step(core, rec, samples)
    log(f"prefix hits: {len(samples)} steps so far")
    batches, contexts = _ints(a.decode_batches), _ints(a.contexts)
    if a.quick:
        batches, contexts = batches[:3], contexts[:2]
    for ctx in contexts:
        for b in batches:
            if b > a.max_num_seqs:
                continue
            for _ in range(b):
                d.add(ctx, 10_000)
            # prefill them (those steps are samples too: mixed prefill + decode)
            while d.prefilling():
                _step(core, rec, samples)
            for _ in range(a.reps):
                _step(core, rec, samples)
            # a prefill chunk riding along a decode batch
            d.add(min(256, a.max_num_batched_tokens), 1)
            _step(core, rec, samples)
            d.drain()
            log(f"decode batch {b} at context {ctx}: {len(samples)} steps so far")
    return samples


def _corun(
    core: EngineCore, a: argparse.Namespace, quant: Quantization | None, log: Log
) -> pf.CoRun:
    from sim import corun as cr

    return cr.measure(
        core,
        model=str(core.config.model),
        dtype=a.dtype,
        threads=a.threads,
        quantization=quant,
        kv_memory=a.kv_memory,
        max_model_len=a.max_model_len,
        log=log,
    )


def _transport(backend: str, log: Log) -> pf.Transport:
    if backend == "none":
        return pf.Transport(
            backend="none",
            bandwidth_bytes_per_s=1e12,
            latency_s=0.0,
            provenance=pf.Provenance.MODELLED,
        )
    log(f"measuring the {backend} transport (bench.kvtransfer)")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.kvtransfer",
            "--backends",
            backend,
            "--blocks",
            "1,16,64",
            "--reps",
            "10",
            "--warmup",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"bench.kvtransfer failed: {out.stderr.strip()[-500:]}")
    rows = [r for r in json.loads(out.stdout)["results"] if r.get("pattern") == "scattered"]
    import numpy as np

    x = np.array([[1.0, r["bytes"]] for r in rows])
    y = np.array([r["latency_ms"] / 1e3 for r in rows])
    (lat, per_byte), *_ = np.linalg.lstsq(x, y, rcond=None)
    return pf.Transport(
        backend=backend,
        bandwidth_bytes_per_s=float(1.0 / max(per_byte, 1e-15)),
        latency_s=float(max(lat, 0.0)),
        provenance=pf.Provenance.MEASURED,
        sizes_bytes=[r["bytes"] for r in rows],
    )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.overheads_only:
        prof = update_overheads(
            Path(a.out),
            a.model,
            "pd" if a.overheads == "none" else a.overheads,
            a.overhead_requests,
        )
        print(json.dumps({"overheads": msgspec.to_builtins(prof.overheads), "notes": prof.notes}))
        return 0
    if a.refit:
        prof = refit(Path(a.out), a.threads)
        print(
            json.dumps(
                {
                    "fit_mape": prof.step.fit_mape,
                    "holdout_mape": prof.step.holdout_mape,
                    "step": msgspec.to_builtins(prof.step),
                    "notes": prof.notes,
                }
            )
        )
        return 0

    def log(msg: str) -> None:
        print(f"[bench.profile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    from engine.config import EngineConfig
    from engine.core import EngineCore
    from runtime.models import DEFAULT_MODEL

    quant = None if a.quantization == "none" else a.quantization
    # --corun-only times the chunk the profile at --out was measured with
    existing = pf.load(a.out) if a.corun_only else None
    cfg = EngineConfig(
        model=a.model or DEFAULT_MODEL,
        dtype=a.dtype,
        device="cpu",
        threads=a.threads,
        kv_memory=a.kv_memory,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=existing.kind.max_num_batched_tokens
        if existing
        else a.max_num_batched_tokens,
        enable_prefix_caching=True,
        quantization=quant,
        max_waiting_requests=4096,
    )
    load0 = os.getloadavg()[0]
    core = EngineCore(cfg)
    layout = core.runner.kv_layout
    kv_per_token = layout.block_bytes // layout.block_size
    dtype = str(layout.dtype).replace("torch.", "")
    if existing is not None:
        if dtype != existing.kind.dtype or quant != existing.kind.quantization:
            raise SystemExit(
                f"--corun-only: {a.out} profiles "
                f"{existing.kind.dtype}/{existing.kind.quantization}, not {a.dtype}/{quant}"
            )
        existing.corun = _corun(core, a, quant, log)
        pf.save(existing, Path(a.out))
        print(json.dumps({"corun": msgspec.to_builtins(existing.corun)}))
        return 0
    log(
        f"engine ready: {core.model_name} {dtype} quant={quant} threads={a.threads}, KV "
        f"{kv_per_token} B/token"
    )
    samples = _measure(core, a, log)
    model, raw, ratio = fit_samples(samples, a.threads)
    log(
        f"fitted on {len(samples)} steps: MAPE {model.fit_mape:.1%} (held out "
        f"{model.holdout_mape or 0:.1%}), max {model.fit_max_ape:.1%}; on raw wall times: MAPE "
        f"{raw.fit_mape:.1%}; contention {ratio:.2f}"
    )
    transport = _transport(a.transport, log)
    corun = _corun(core, a, quant, log) if a.corun and not a.quick else pf.CoRun()
    name = a.name or f"{core.model_name}-{dtype}-{quant or 'noquant'}-t{a.threads}"
    prof = pf.Profile(
        kind=pf.NodeKind(
            name=name,
            model=core.model_name,
            dtype=dtype,
            quantization=quant,
            device=f"cpu ({a.threads} threads, {platform.processor() or platform.machine()})",
            engine="native",
            block_size=layout.block_size,
            kv_bytes_per_token=kv_per_token,
            kv_capacity_tokens=core.pool.num_blocks * layout.block_size,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            # the serving limit is a deployment choice (duet up: the model's own), not
            # --max-model-len, which only bounds the prompts this profile times
            max_model_len=core.model_config.max_position_embeddings,
        ),
        step=model,
        transport=transport,
        corun=corun,
        overheads=pf.Overheads(
            request_s=a.overhead_ms / 1e3,
            pd_hop_s=a.pd_hop_ms / 1e3,
            stream_s=0.0005,
            provenance=pf.Provenance.MODELLED,
        ),
        samples=samples,
        notes=[
            f"step samples: wall clock and CPU time around EngineCore.step on {os.cpu_count()} "
            "CPUs; load average "
            f"{load0:.2f} before, {os.getloadavg()[0]:.2f} after",
            *fit_notes(raw, ratio),
            "measured: step samples, the fit, KV bytes/token, the transport"
            + (", the co-run factors" if corun.provenance == pf.Provenance.MEASURED else "")
            + "; modelled: per-request "
            "overheads (--overhead-ms, --pd-hop-ms)",
        ],
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        contention=ratio,
        host=platform.node(),
    )
    if a.overheads != "none":
        prof = _with_overheads(prof, a.model, a.overheads, a.overhead_requests, log)
    pf.save(prof, Path(a.out))
    log(f"wrote {a.out}")
    print(
        json.dumps(
            {
                "name": name,
                "samples": len(samples),
                "fit_mape": model.fit_mape,
                "holdout_mape": model.holdout_mape,
                "step": msgspec.to_builtins(model),
                "transport_gbps": transport.bandwidth_bytes_per_s / 1e9,
                "transport_latency_ms": transport.latency_s * 1e3,
                "corun": msgspec.to_builtins(corun),
            }
        )
    )
    return 0


def fit_samples(
    samples: list[pf.StepSample], threads: int
) -> tuple[pf.StepModel, pf.StepModel, float]:
    """(the model, the model of the raw wall times, the contention ratio). On a shared machine
    a step's wall time is its CPU time stretched by whatever else runs — noise that swamps the
    features. The model is therefore fitted to each step's CPU time / threads × the *median*
    contention of the run (wall × threads / CPU): the step's own cost, at the machine's typical
    share. Without CPU times (older profiles) it is the raw wall fit."""
    raw = pf.fit(samples)
    ratio = _contention(samples, threads)
    if not math.isfinite(ratio):
        return raw, raw, ratio
    clean = [msgspec.structs.replace(s, seconds=s.cpu_seconds / threads * ratio) for s in samples]
    return pf.fit(clean), raw, ratio


def fit_notes(raw: pf.StepModel, ratio: float) -> list[str]:
    return [
        f"step model: fitted to CPU time / threads × the median contention {ratio:.2f} (wall × "
        "threads / CPU; "
        "1.0 = the step had its CPUs to itself); the same fit on raw wall times has MAPE "
        f"{raw.fit_mape:.1%} (held out {raw.holdout_mape or 0:.1%}) — the machine's noise"
    ]


def refit(path: Path, threads: int) -> pf.Profile:
    """Refit a saved profile's samples (the model and its notes change; samples stay)."""
    prof = pf.load(path)
    model, raw, ratio = fit_samples(prof.samples, threads)
    notes = [n for n in prof.notes if not n.startswith("step model:")]
    prof.step, prof.notes, prof.contention = model, [*fit_notes(raw, ratio), *notes], ratio
    pf.save(prof, path)
    return prof


def _with_overheads(
    prof: pf.Profile, model: str | None, mode: str, requests: int, log: Log
) -> pf.Profile:
    from runtime.models import DEFAULT_MODEL, resolve_model
    from sim import overheads

    if model is None or not Path(model).is_dir():
        model = str(resolve_model(model or DEFAULT_MODEL).directory)
    m = overheads.measure(prof, model, log, requests=requests, pd=mode == "pd")
    notes = [
        n for n in prof.notes if not n.startswith(("overheads measured", "measured: step samples"))
    ]
    what = (
        "measured: step samples, the fit, KV bytes/token, the transport, "
        + ("the co-run factors, " if prof.corun.provenance == pf.Provenance.MEASURED else "")
        + "per-request/per-token overheads"
        + ("" if mode == "pd" else " (the P→D hop: the --pd-hop-ms default)")
    )
    if mode != "pd":
        m = overheads.Measured(
            msgspec.structs.replace(m.overheads, pd_hop_s=prof.overheads.pd_hop_s), m.notes, m.raw
        )
    return msgspec.structs.replace(prof, overheads=m.overheads, notes=[*notes, *m.notes, what])


def update_overheads(path: Path, model: str | None, mode: str, requests: int) -> pf.Profile:
    """Measure the overheads of the profile at `path` and write them into it (samples stay)."""

    def log(msg: str) -> None:
        print(f"[bench.profile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    prof = _with_overheads(pf.load(path), model, mode, requests, log)
    pf.save(prof, path)
    return prof


def _contention(samples: list[pf.StepSample], threads: int) -> float:
    """Median of wall × threads / CPU over the steps: ~1 when the step had its threads' CPUs to
    itself, k when it got 1/k of them (the machine's other work)."""
    r = [s.seconds * threads / s.cpu_seconds for s in samples if s.cpu_seconds > 0]
    return statistics.median(r) if r else float("nan")


if __name__ == "__main__":
    sys.exit(main())
