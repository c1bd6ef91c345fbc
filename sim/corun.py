"""How much a step slows down while another node runs steps on the same machine (the profile's
`CoRun`), and the busy neighbour process that measurement runs beside (`python -m sim.corun`).

`measure()` takes the profiling process's own EngineCore and times two shapes — a prefill step
of `max_num_batched_tokens` prompt tokens, and a pure decode step of 8 sequences at 256 tokens
of context — in pairs: one step with the neighbour stopped (SIGSTOP), the next with it running
(SIGCONT). The neighbour is a second engine process of the same node kind, started here, that
keeps 8 sequences decoding and adds a full prefill chunk every fourth step (a busy colocated
node). Pairs, not an "alone" block then a "beside" block: a shared VM's host drifts by ±25 %
within a minute (measured: the same decode step took 50 ms of CPU at 09:58 and 66 ms at 10:29),
far more than the effect measured, and the two steps of a pair are a second apart. Each shape's
factor is the median of its pairs' ratios (not below 1.0). CPU seconds, not wall: the neighbour
must not be counted as a run-queue wait, which sim.validate's contention reading already
covers; what is left is the slower instructions of a shared core, cache and memory bus.

Invariants: the neighbour is stopped before `measure` returns, whatever happens (SIGTERM, then
SIGKILL); the core is left with no request.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol.profile import CoRun, CoRunShape, Provenance
from sim.driver import Driver

if TYPE_CHECKING:
    from engine.config import EngineConfig, Quantization
    from engine.core import EngineCore

READY = "corun-neighbour-ready"


def _config(
    model: str,
    dtype: str,
    threads: int,
    quantization: Quantization | None,
    kv_memory: str,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> EngineConfig:
    from engine.config import EngineConfig

    return EngineConfig(
        model=model,
        dtype=dtype,
        device="cpu",
        threads=threads,
        kv_memory=kv_memory,
        max_model_len=max_model_len,
        max_num_seqs=64,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,
        quantization=quantization,
        max_waiting_requests=4096,
    )


def measure(
    core: EngineCore,
    *,
    model: str,
    dtype: str,
    threads: int,
    quantization: Quantization | None,
    kv_memory: str,
    max_model_len: int,
    log: Callable[[str], None],
    reps: int = 9,
    timeout_s: float = 300.0,
) -> CoRun:
    chunk = core.config.max_num_batched_tokens
    d = Driver(core, seed=1)
    for _ in range(2):  # warm: the first steps of each shape allocate
        d.prefill_step(chunk)
    d.start_decoders()
    for _ in range(2):
        d.cpu_step()
    d.drain()
    cmd = [
        sys.executable,
        "-m",
        "sim.corun",
        "--model",
        model,
        "--dtype",
        dtype,
        "--threads",
        str(threads),
        "--kv-memory",
        kv_memory,
        "--max-model-len",
        str(max_model_len),
        "--chunk",
        str(chunk),
        *(["--quantization", quantization] if quantization else []),
    ]
    log(f"co-run: timing steps alone and beside a busy neighbour, in pairs ({' '.join(cmd[1:])})")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    pairs: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": []}
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

        def pair(step: Callable[[], float]) -> tuple[float, float]:
            os.killpg(proc.pid, signal.SIGSTOP)
            try:
                alone = step()
            finally:
                os.killpg(proc.pid, signal.SIGCONT)
            return alone, step()

        for _ in range(reps):
            pairs["prefill"].append(pair(lambda: d.prefill_step(chunk)))
        d.start_decoders()
        for _ in range(reps):
            pairs["decode"].append(pair(d.cpu_step))
        d.drain()
    finally:
        _stop(proc)
        d.drain()
    shapes = [
        CoRunShape(
            name=n,
            alone_cpu_s=statistics.median(a for a, _ in ps),
            beside_cpu_s=statistics.median(b for _, b in ps),
        )
        for n, ps in pairs.items()
    ]
    ratio = {n: statistics.median(b / a for a, b in ps) for n, ps in pairs.items()}
    log(
        "co-run: "
        + ", ".join(
            f"{s.name} {s.alone_cpu_s * 1e3:.1f} → {s.beside_cpu_s * 1e3:.1f} ms CPU (median "
            f"ratio of {reps} pairs ×{ratio[s.name]:.2f})"
            for s in shapes
        )
    )
    return CoRun(
        prefill_factor=max(1.0, ratio["prefill"]),
        decode_factor=max(1.0, ratio["decode"]),
        cpus=os.cpu_count() or 0,
        shapes=shapes,
        provenance=Provenance.MEASURED,
    )


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

    core = EngineCore(
        _config(a.model, a.dtype, a.threads, a.quantization, a.kv_memory, a.max_model_len, a.chunk)
    )
    d = Driver(core, seed=2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    d.start_decoders()
    print(READY, flush=True)
    steps = 0
    while True:
        if steps % 4 == 0:
            d.add(a.chunk, 1)
        core.step()
        steps += 1
        if steps % 400 == 0:  # the decoders' contexts stay near DECODE_CTX
            d.drain()
            d.start_decoders()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sim.corun",
        description="the busy neighbour of `duet bench "
        "profile`'s co-run measurement (runs until SIGTERM)",
    )
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
