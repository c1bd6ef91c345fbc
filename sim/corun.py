"""How much a step slows down while another node runs steps on the same machine (the profile's
`CoRun`), and the busy neighbour process that measurement runs beside (`python -m sim.corun`).

`measure()` takes the profiling process's own EngineCore and times two shapes — a prefill step
of `max_num_batched_tokens` prompt tokens, and a pure decode step of 8 sequences at 256 tokens
of context — first alone, then beside a neighbour (a second engine process of the same node
kind, started here, that keeps 8 sequences decoding and adds a full prefill chunk every fourth
step: a busy colocated node), then alone again. Each shape's factor is the median CPU seconds
beside the neighbour over the mean of the two alone medians. CPU seconds, not wall: the
neighbour must not be counted as a run-queue wait, which sim.validate's contention reading
already covers; what is left is the slower instructions of a shared core, cache and memory bus.

Invariants: the neighbour is stopped before `measure` returns, whatever happens (SIGTERM, then
SIGKILL); the core is left with no request.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from protocol.profile import CoRun, CoRunShape, Provenance
from sim.speed import DECODE_CTX, DECODE_SEQS, Driver, time_shapes

READY = "corun-neighbour-ready"


def _config(model: str, dtype: str, threads: int, quantization: str | None, kv_memory: str,
            max_model_len: int, max_num_batched_tokens: int):  # -> EngineConfig  # fmt: skip
    from engine.config import EngineConfig

    return EngineConfig(model=model, dtype=dtype, device="cpu", threads=threads, kv_memory=kv_memory,
                        max_model_len=max_model_len, max_num_seqs=64, max_num_batched_tokens=max_num_batched_tokens,
                        enable_prefix_caching=False, quantization=quantization, max_waiting_requests=4096)  # fmt: skip


def measure(core, *, model: str, dtype: str, threads: int, quantization: str | None, kv_memory: str,
            max_model_len: int, log: Callable[[str], None], reps: int = 7, timeout_s: float = 300.0) -> CoRun:  # type: ignore[no-untyped-def]  # fmt: skip
    chunk = core.config.max_num_batched_tokens
    d = Driver(core, seed=1)
    time_shapes(d, chunk, 2)  # warm
    alone1 = time_shapes(d, chunk, reps)
    cmd = [sys.executable, "-m", "sim.corun", "--model", model, "--dtype", dtype, "--threads", str(threads),
           "--kv-memory", kv_memory, "--max-model-len", str(max_model_len), "--chunk", str(chunk),
           *(["--quantization", quantization] if quantization else [])]  # fmt: skip
    log(f"co-run: timing steps beside a busy neighbour ({' '.join(cmd[1:])})")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        assert proc.stdout is not None
        while True:  # readline blocks until the neighbour's first line; its exit ends it with ""
            line = proc.stdout.readline()
            if READY in line:
                break
            if not line or time.monotonic() > deadline:
                err = proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
                raise RuntimeError(f"the co-run neighbour did not start: {err.strip()[-800:]}")
        beside = time_shapes(d, chunk, reps)
    finally:
        _stop(proc)
    alone2 = time_shapes(d, chunk, reps)
    shapes = []
    for name in ("prefill", "decode"):
        alone = (alone1[name] + alone2[name]) / 2
        shapes.append(CoRunShape(name=name, alone_cpu_s=alone, beside_cpu_s=beside[name]))
    f = {s.name: max(1.0, s.beside_cpu_s / s.alone_cpu_s) for s in shapes}
    log("co-run: " + ", ".join(f"{s.name} {s.alone_cpu_s * 1e3:.1f} → {s.beside_cpu_s * 1e3:.1f} ms CPU "
                               f"(×{s.beside_cpu_s / s.alone_cpu_s:.2f}; alone before {alone1[s.name] * 1e3:.1f}, "
                               f"after {alone2[s.name] * 1e3:.1f})" for s in shapes))  # fmt: skip
    return CoRun(prefill_factor=f["prefill"], decode_factor=f["decode"], cpus=os.cpu_count() or 0, shapes=shapes,
                 provenance=Provenance.MEASURED)  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def neighbour(a: argparse.Namespace) -> int:
    """A busy node: 8 sequences decoding, a full prefill chunk riding along every fourth step."""
    from engine.core import EngineCore

    core = EngineCore(_config(a.model, a.dtype, a.threads, a.quantization, a.kv_memory, a.max_model_len, a.chunk))
    d = Driver(core, seed=2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    for _ in range(DECODE_SEQS):
        d.add(DECODE_CTX, 10_000)
    while d.prefilling():
        core.step()
    print(READY, flush=True)
    steps = 0
    while True:
        if steps % 4 == 0:
            d.add(a.chunk, 1)
        core.step()
        steps += 1
        if steps % 400 == 0:  # the decoders' contexts stay near DECODE_CTX
            d.drain()
            for _ in range(DECODE_SEQS):
                d.add(DECODE_CTX, 10_000)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.corun", description="the busy neighbour of `duet bench "
                                "profile`'s co-run measurement (runs until SIGTERM)")  # fmt: skip
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-memory", default="1GiB")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512)
    return neighbour(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
