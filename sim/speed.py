"""The machine's speed, read with a fixed pair of engine steps, so a profile measured earlier can be
moved to the speed the machine has during a run (sim.validate).

A shared VM's host changes under it: on this project's 2-vCPU machines the same bf16 decode step
took 50 ms of CPU at 09:58 and 66 ms at 10:29 (the same process, nothing else running; its CPU
time grew, not its wait), so a profile measured before a run can be 30 % off by the time the run
starts — more than any other error the validation has. `time_shapes` times the two shapes the
co-run measurement uses (a full prefill chunk, a decode step of 8 sequences at 256 tokens) by
CPU clock; `duet bench profile` stores them with the profile (`Profile.probe`), sim.validate
times them again around every case with the cluster idle, and the simulation scales the step
model's prefill terms by the prefill ratio and the rest by the decode ratio
(`Profile.at_speed`). Nothing here reads the latencies the validation compares.
"""

from __future__ import annotations

import random
import statistics
import time

from protocol.profile import SpeedProbe

DECODE_SEQS, DECODE_CTX = 8, 256


class Driver:
    """Adds random-token requests to a core and times its steps by CPU clock."""

    def __init__(self, core, seed: int) -> None:  # type: ignore[no-untyped-def]
        self.core = core
        self.rng = random.Random(seed)
        self.n = 0

    def add(self, prompt_len: int, max_tokens: int) -> None:
        from engine.sampling_params import SamplingParams

        self.n += 1
        vocab = self.core.model_config.vocab_size
        self.core.add_request(f"c{self.n}", [self.rng.randrange(3, vocab) for _ in range(prompt_len)],
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))  # fmt: skip

    def cpu_step(self) -> float:
        c0 = time.process_time()
        self.core.step()
        return time.process_time() - c0

    def prefilling(self) -> bool:
        s = self.core.scheduler
        return bool(s.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running)

    def drain(self) -> None:
        for rid in list(self.core.scheduler.requests):
            self.core.abort(rid)
        while self.core.has_work():
            self.core.step()


def time_shapes(d: Driver, chunk: int, reps: int) -> dict[str, float]:
    """Median CPU seconds of a full prefill chunk and of a pure decode step."""
    prefill = []
    for _ in range(reps):
        d.add(chunk, 1)
        prefill.append(d.cpu_step())
        d.drain()
    for _ in range(DECODE_SEQS):
        d.add(DECODE_CTX, 10_000)
    while d.prefilling():
        d.core.step()
    decode = [d.cpu_step() for _ in range(reps)]
    d.drain()
    return {"prefill": statistics.median(prefill), "decode": statistics.median(decode)}


def probe(core, reps: int = 5) -> SpeedProbe:  # type: ignore[no-untyped-def]
    """The two shapes' median CPU seconds on `core` (warmed first; the core is left empty)."""
    d = Driver(core, seed=7)
    chunk = core.config.max_num_batched_tokens
    time_shapes(d, chunk, 1)
    t = time_shapes(d, chunk, reps)
    return SpeedProbe(prefill_cpu_s=t["prefill"], decode_cpu_s=t["decode"], chunk=chunk)
