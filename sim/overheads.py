"""Per-request and per-token overheads, measured inside a running cluster (`duet bench profile
--overheads`): what a request costs outside the forward pass, for the profile's `Overheads`.

Method. A real cluster (`duet up`, its own DUET_HOME, one torch thread per node) serves two
request shapes one at a time (`duet bench serve --max-concurrency 1`, so nothing queues):
A = a short prompt and one output token, B = the same prompt and 1 + T tokens. Around each
shape the harness reads every process's own CPU clock (/proc): the gateway, the
coordinator, and per node its event-loop thread (the main thread: HTTP, tokenize, SSE) apart
from its step thread and the rest (torch's, the KV transport's), from the kernel's per-thread
accounts (sim/procstat.py), less each part's idle rate measured first. So:

- per token (B − A, over N·T tokens): the node loop's CPU per streamed token, the gateway's per
  relayed token; and B's TPOT less the step thread's CPU per token × the stretch it ran at: the
  time the step thread sat blocked (GIL, engine calls from the loop) between two tokens — the
  node's streaming work beside the step (`node_token_cpu_s`, as CPU: the simulator × contention);
- per request (A, less its one token): node loop, gateway, coordinator CPU;
- the pure decode steps inside the node (its engine thread's own clock, read from the node's
  `duet:engine_decode_step_*` counters around B): their wall time over the step model's
  prediction for them is `decode_step_factor` (what the streaming process adds inside a step:
  its loop holding the GIL, the caches it shares — the validation's TPOT was under-predicted by
  it), and B's TPOT less that in-node step is the time between two steps (`node_token_cpu_s`).
  Without the counters (a node older than them), the step thread's CPU stands in, as before;
- the wall residual of A's TTFT: client TTFT − the step thread's CPU × contention (the step
  itself, at the contention its own threads ran at, procstat's stretch) — the part of
  TTFT outside the step, which `Overheads.request_s` (+ the first token's way back) models;
- with `pd=True` a 1P+1D cluster serves shape A with a prompt long enough to be disaggregated;
  its residual, less the colocated residual and the modelled KV transfer, is the P→D hop.

The wall figures are stored at the profile's contention (× profile contention / the shape's), like
the step model, so `Profile.at_contention` moves them together; the CPU figures are kept as they
are. Every process started is stopped at the end, even on failure (sim/validate.py's start/stop).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from protocol.profile import Overheads, Profile, Provenance, StepFeatures
from runtime.cluster_secret import read_secret_file
from runtime.ports import free_port
from sim import procstat
from sim.contention import ContentionMeter


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int
    output_tokens: int
    requests: int


@dataclass
class ShapeRun:
    """Per request of one shape: CPU seconds of each part (less its idle rate), the client's
    figures, and the contention the nodes' step threads ran at (procstat's stretch)."""

    cpu: dict[str, float]
    ttft_ms: float  # median over the shape's requests
    tpot_ms: float | None
    contention: float  # (run + wait) / run of the nodes' step threads over the shape
    meter: float  # sim/contention.py's reading over the shape, for comparison
    wall_s: float
    #: wall seconds of one pure decode step inside the nodes (their counters), if they count it
    decode_step_s: float | None = None
    decode_steps: int = 0


#: the node counters read around a shape (node/metrics.py, engine/async_engine.py StepTiming)
_COUNTER = re.compile(
    r"^(duet:engine_decode_steps|duet:engine_decode_step_seconds)_total\{[^}]*\} (\S+)$", re.M
)


def node_counters(parts: dict[str, int], headers: dict[str, str]) -> dict[str, float]:
    """The nodes' decode-step counters, summed (GET /metrics on each node, with the cluster
    secret); {} when a node does not answer them (a node older than the counters)."""
    import urllib.request

    out: dict[str, float] = {}
    for name, pid in parts.items():
        if not name.startswith("node:"):
            continue
        argv = procstat.cmdline(pid)
        port = argv[argv.index("--port") + 1]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            found = {k: float(v) for k, v in _COUNTER.findall(r.read().decode())}
        if len(found) < 2:
            return {}
        for k, v in found.items():
            out[k] = out.get(k, 0.0) + v
    return out


def idle_rates(parts: dict[str, int], seconds: float = 5.0) -> dict[str, float]:
    """CPU seconds per second each part spends with no request (load frames, heartbeats, the
    engine's idle loop): subtracted from the shapes' CPU, which would otherwise charge the
    longer shape B with time, not tokens."""
    s0, t0 = procstat.snapshot(parts), time.perf_counter()
    time.sleep(seconds)  # an idle window is what is measured here
    d, dt = procstat.snapshot(parts) - s0, time.perf_counter() - t0
    return {k: c.cpu_s / dt for k, c in d.parts().items()}


def run_shape(
    parts: dict[str, int],
    idle: dict[str, float],
    serve: list[str],
    shape: Shape,
    seed: int,
    headers: dict[str, str] | None = None,
) -> ShapeRun:
    """One shape, one request at a time; with `headers` (the cluster secret's) the nodes' own
    decode-step counters are read around it too."""
    warmup = 2
    cmd = [
        *serve,
        "--max-concurrency",
        "1",
        "--num-requests",
        str(shape.requests),
        "--warmup",
        str(warmup),
        "--input-len",
        str(shape.prompt_tokens),
        "--output-len",
        str(shape.output_tokens),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--json",
        "--quiet",
    ]
    k0 = node_counters(parts, headers) if headers is not None else {}
    s0, t0 = procstat.snapshot(parts), time.perf_counter()
    with ContentionMeter() as meter:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    d, wall = procstat.snapshot(parts) - s0, time.perf_counter() - t0
    k1 = node_counters(parts, headers) if headers is not None and k0 else {}
    steps = (
        int(k1.get("duet:engine_decode_steps", 0) - k0.get("duet:engine_decode_steps", 0))
        if k1
        else 0
    )
    decode_step = (
        (k1["duet:engine_decode_step_seconds"] - k0["duet:engine_decode_step_seconds"]) / steps
        if steps
        else None
    )
    if r.returncode != 0:
        raise RuntimeError(f"bench serve failed ({r.returncode}): {r.stderr[-2000:]}")
    m = json.loads(r.stdout)
    if m["completed"] < shape.requests:
        raise RuntimeError(
            f"{shape.requests - m['completed']} of {shape.requests} requests failed: "
            f"{m['failures']}"
        )
    # the warm-up requests ran between the two readings too: divide by all of them
    n = shape.requests + warmup
    parts_cpu = d.parts()
    cpu = {k: max(0.0, c.cpu_s - idle.get(k, 0.0) * wall) / n for k, c in parts_cpu.items()}
    return ShapeRun(
        cpu=cpu,
        ttft_ms=m["median_ttft_ms"],
        tpot_ms=m.get("median_tpot_ms"),
        contention=d.sum("/step").stretch,
        meter=meter.median,
        wall_s=wall,
        decode_step_s=decode_step,
        decode_steps=steps,
    )


def _sum(cpu: dict[str, float], suffix: str) -> float:
    return sum(v for k, v in cpu.items() if k.endswith(suffix))


@dataclass(frozen=True)
class Measured:
    overheads: Overheads
    notes: list[str]
    raw: dict[str, object]


def derive(
    profile: Profile,
    a: ShapeRun,
    b: ShapeRun,
    tokens: int,
    pd: ShapeRun | None = None,
    pd_transfer_s: float = 0.0,
    prompt: int = 32,
) -> Measured:
    """The profile's Overheads from shape A (1 token), B (1 + `tokens` tokens of a `prompt`-token
    prompt) and optionally the disaggregated shape (its modelled KV transfer, wall seconds, is
    `pd_transfer_s`)."""
    ref = profile.contention or 1.0
    gw_tok = max(0.0, (b.cpu.get("gateway", 0.0) - a.cpu.get("gateway", 0.0)) / tokens)
    loop_tok = max(0.0, (_sum(b.cpu, "/loop") - _sum(a.cpu, "/loop")) / tokens)
    node_req = max(0.0, _sum(a.cpu, "/loop") - loop_tok)
    gw_req = max(0.0, a.cpu.get("gateway", 0.0) - gw_tok)
    co_req = a.cpu.get("coordinator", 0.0)
    # per token beside the step: B's TPOT less the step thread's own time per token (its CPU ×
    # the stretch it ran at) is the time the step thread was blocked, not runnable, between
    # two tokens — the GIL and the engine calls it shares with the node's event loop
    step_tok = (_sum(b.cpu, "/step") - _sum(a.cpu, "/step")) / tokens
    tpot = (b.tpot_ms or 0.0) / 1e3
    factor, modelled = 1.0, None
    if b.decode_step_s is not None:
        # B's decode steps as the simulator would time them: the model at B's mean context, at
        # B's contention (the model is stored at the profile's, `ref`)
        ctx = round(prompt + (tokens + 1) / 2)
        modelled = profile.step.seconds(StepFeatures(0, 1, ctx, 0)) * b.contention / ref
        factor = b.decode_step_s / modelled if modelled > 0 else 1.0
        blocked = tpot - b.decode_step_s  # between two steps: the rest of a token's time
    else:
        blocked = tpot - step_tok * b.contention
    node_tok = max(0.0, blocked / b.contention)  # as CPU: the simulator multiplies by contention
    c = a.contention
    # A's TTFT outside the step: the step thread's CPU (the prefill step) at its own stretch
    residual = a.ttft_ms / 1e3 - _sum(a.cpu, "/step") * c
    stream = gw_tok * c  # a token's relay through the gateway (the node's own share is token_s)
    request = residual - node_tok * c - stream
    pd_hop = 0.0
    if pd is not None:
        pd_residual = pd.ttft_ms / 1e3 - _sum(pd.cpu, "/step") * pd.contention - pd_transfer_s
        # less the colocated residual at the pd run's contention: the same gateway and node work
        pd_hop = pd_residual - residual * pd.contention / c
    ov = Overheads(
        request_s=max(0.0, request) * ref / c,
        pd_hop_s=max(0.0, pd_hop) * ref / (pd or a).contention,
        stream_s=stream * ref / c,
        node_token_cpu_s=node_tok,
        node_request_cpu_s=node_req,
        gateway_request_cpu_s=gw_req,
        gateway_token_cpu_s=gw_tok,
        coordinator_request_cpu_s=co_req,
        decode_step_factor=factor,
        provenance=Provenance.MEASURED,
    )
    notes = [
        "overheads measured in a running cluster (sim/overheads.py), requests one at a time, idle "
        f"CPU rates subtracted: CPU per request gateway {gw_req * 1e3:.2f} ms, coordinator "
        f"{co_req * 1e3:.2f} ms, node loop {node_req * 1e3:.2f} ms; per streamed token node loop "
        f"{loop_tok * 1e3:.2f} ms, gateway {gw_tok * 1e3:.2f} ms; "
        + (
            ""
            if modelled is None or b.decode_step_s is None  # both are known or neither
            else f"a pure decode step in the node {b.decode_step_s * 1e3:.2f} ms against the "
            f"model's {modelled * 1e3:.2f} ms (→ decode_step_factor {factor:.3f}; step thread CPU "
            f"{step_tok * 1e3:.2f} ms a token); "
        )
        + f"between two steps {blocked * 1e3:.1f} ms a token at contention "
        f"{b.contention:.2f} (→ node_token_cpu_s); TTFT outside the step {residual * 1e3:.1f} ms "
        f"at contention {c:.2f}"
        + (
            ""
            if pd is None
            else f"; P→D hop {pd_hop * 1e3:.1f} ms at contention {pd.contention:.2f}"
        )
    ]
    raw = {
        "colocated_1_token": asdict(a),
        "colocated_more_tokens": asdict(b),
        "tokens": tokens,
        "pd": None if pd is None else asdict(pd),
    }
    return Measured(ov, notes, raw)


def _up(
    model: str, up_args: list[str], home: Path, log: Callable[[str], None]
) -> tuple[subprocess.Popen, str, int]:
    from sim.validate import _wait_up

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "duet",
        "up",
        "--port",
        str(port),
        "--quiet",
        "--model",
        model,
        *up_args,
    ]
    log(f"overheads: DUET_HOME={home} duet up {' '.join(cmd[4:])}")
    out = (home / "up.log").open("w")
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "DUET_HOME": str(home)},
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out.close()
    return proc, _wait_up(proc, home / "up.log", 600), port


def measure(
    profile: Profile,
    model: str,
    log: Callable[[str], None],
    *,
    requests: int = 12,
    tokens: int = 16,
    prompt: int = 32,
    pd: bool = True,
    pd_prompt: int = 384,
) -> Measured:
    """Run the shapes on real clusters (colocated, then 1P+1D when `pd`) and derive the
    overheads."""
    from sim.validate import _stop

    def serve(port: int, key: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "duet",
            "bench",
            "serve",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--api-key",
            key,
            "--tokenizer",
            model,
        ]

    with tempfile.TemporaryDirectory(prefix="duet-overheads-") as tmp:
        proc, key, port = _up(model, ["--colocated", "1", "--threads", "1"], Path(tmp), log)
        try:
            parts = procstat.cluster(proc.pid)
            headers = read_secret_file(Path(tmp) / "up" / "cluster.secret").headers
            idle = idle_rates(parts)
            log(f"overheads: parts {sorted(parts)}; idle CPU {_fmt(idle)} per s")
            a = run_shape(parts, idle, serve(port, key), Shape(prompt, 1, requests), 1)
            log(
                f"overheads: 1 token: TTFT {a.ttft_ms:.1f} ms, contention {a.contention:.2f} "
                f"(meter {a.meter:.2f}), "
                f"CPU {_fmt(a.cpu)}"
            )
            b = run_shape(
                parts, idle, serve(port, key), Shape(prompt, 1 + tokens, requests), 2, headers
            )
            log(
                f"overheads: {1 + tokens} tokens: TPOT {b.tpot_ms or 0:.1f} ms, contention "
                f"{b.contention:.2f} "
                f"(meter {b.meter:.2f}), CPU {_fmt(b.cpu)}"
            )
        finally:
            _stop(proc)
    p = None
    transfer = 0.0
    if pd:
        with tempfile.TemporaryDirectory(prefix="duet-overheads-") as tmp:
            proc, key, port = _up(
                model, ["--prefill", "1", "--decode", "1", "--threads", "1"], Path(tmp), log
            )
            try:
                parts = procstat.cluster(proc.pid)
                p = run_shape(
                    parts, idle_rates(parts), serve(port, key), Shape(pd_prompt, 1, requests), 3
                )
                log(
                    f"overheads: 1P+1D, {pd_prompt}-token prompt: TTFT {p.ttft_ms:.1f} ms, "
                    "contention "
                    f"{p.contention:.2f}, CPU {_fmt(p.cpu)}"
                )
            finally:
                _stop(proc)
        blocks = -(-pd_prompt // profile.kind.block_size)
        transfer = profile.transport.seconds(
            blocks * profile.kind.block_size * profile.kind.kv_bytes_per_token
        )
    return derive(profile, a, b, tokens, p, transfer, prompt)


def _fmt(cpu: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(cpu.items()))
