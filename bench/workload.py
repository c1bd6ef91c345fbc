"""Seeded synthetic workloads: random-token prompts, long-tailed lengths, Poisson arrivals.

Pure Python and deterministic for a seed, so two systems measured in one run (or two runs on
two machines) see exactly the same requests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkItem:
    arrival_s: float  # offset from the start of the run
    prompt: list[int]
    output_len: int


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Token ids away from the low (special) ids, so no prompt contains a control token."""
    lo = min(100, vocab // 4)
    return [rng.randrange(lo, vocab) for _ in range(length)]


def lognormal_len(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A long-tailed length: lognormal around `median`, clipped to [lo, hi]."""
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def online_workload(
    n: int,
    rate_per_s: float,
    vocab: int,
    seed: int = 0,
    input_median: float = 128,
    output_median: float = 40,
    sigma: float = 0.8,
    max_input: int = 768,
    max_output: int = 256,
) -> list[WorkItem]:
    """`n` requests with exponential inter-arrival gaps (Poisson process of `rate_per_s`).

    Lengths are lognormal (median 128 in / 40 out, sigma 0.8: a long tail, ~1 in 20 outputs
    past 150 tokens), the shape that makes static batching wait on its longest member."""
    rng = random.Random(seed)
    t = 0.0
    items = []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        n_in = lognormal_len(rng, input_median, sigma, 8, max_input)
        n_out = lognormal_len(rng, output_median, sigma, 4, max_output)
        items.append(WorkItem(t, random_prompt(rng, n_in, vocab), n_out))
    return items


def summarize(xs: list[float]) -> dict[str, float]:
    """mean / p50 / p90 / p99 / max of a sample (empty: zeros)."""
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, round(p * (len(s) - 1)))]

    return {"mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1]}
