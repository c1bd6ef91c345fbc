"""Aggregate metrics of a run, with vLLM's `bench serve` definitions and JSON keys.

- TTFT: send → first content chunk. E2EL: send → end of stream. ITL: gaps between
  consecutive content chunks (all of them, pooled). TPOT: (E2EL − TTFT) / (output tokens − 1),
  over requests with at least two output tokens.
- Output tokens: the final usage chunk's completion_tokens when the server sent one, else
  the tokens counted in the stream.
- Goodput (DistServe): successful requests that meet every SLO given (TTFT and/or TPOT, ms;
  a one-token output has no TPOT and meets a TPOT SLO), per second of the run.
- Percentiles are numpy's linear interpolation (as vLLM); a metric without samples is null.
- Failed requests count in `failed` and `failures` by cause, never in latency statistics.
- achieved_request_rate: sends per second over the send window (first to last send),
  against the configured rate; send lag is how late requests left against their plan.
- max_output_tokens_per_s: the busiest one-second bucket; max_concurrent_requests: the most
  requests open at once (as vLLM reports them).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from bench.records import RequestRecord

LATENCIES = ("ttft", "tpot", "itl", "e2el")


def stats(
    name: str, values_s: Sequence[float], percentiles: Iterable[float]
) -> dict[str, float | None]:
    """mean/median/std/p{P} of a sample in seconds, as `<stat>_<name>_ms` keys."""
    ms = np.asarray(values_s, dtype=float) * 1e3
    out: dict[str, float | None] = {}
    empty = ms.size == 0
    out[f"mean_{name}_ms"] = None if empty else float(ms.mean())
    out[f"median_{name}_ms"] = None if empty else float(np.median(ms))
    out[f"std_{name}_ms"] = None if empty else float(ms.std())
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = None if empty else float(np.percentile(ms, p))
    return out


def samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    ok = [r for r in records if r.ok]
    return {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot": [t for r in ok if (t := r.tpot_s) is not None],
        "itl": [g for r in ok for g in r.itl_s],
        "e2el": [r.e2el_s for r in ok],
    }


def is_good(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not r.ok or r.ttft_s is None:
        return False
    if slo_ttft_ms is not None and r.ttft_s * 1e3 > slo_ttft_ms:
        return False
    tpot = r.tpot_s
    return not (slo_tpot_ms is not None and tpot is not None and tpot * 1e3 > slo_tpot_ms)


def compute(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    configured_rate: float,
    percentiles: Sequence[float] = (50, 90, 99),
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    dur = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(
        r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_len for r in ok
    )
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(is_good(r, slo_ttft_ms, slo_tpot_ms) for r in ok) if has_slo else None
    sends = sorted(r.sent_s for r in records)
    window = sends[-1] - sends[0] if len(sends) > 1 else 0.0
    lag = [max(0.0, r.sent_s - r.scheduled_s) for r in records]
    m: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failures": dict(sorted(Counter(r.cause for r in records if not r.ok).items())),
        "duration": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "request_goodput": None if good is None else good / dur,
        "good_requests": good,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "configured_request_rate": "inf" if math.isinf(configured_rate) else configured_rate,
        "achieved_request_rate": (len(sends) - 1) / window if window > 0 else None,
        "mean_send_lag_ms": float(np.mean(lag)) * 1e3 if lag else None,
        "max_send_lag_ms": max(lag) * 1e3 if lag else None,
        "max_concurrent_requests": max_in_flight(records),
        "max_output_tokens_per_s": max(
            (p["output_tokens_per_s"] for p in timeline(records)), default=None
        ),
        "usage_reported": sum(r.usage_tokens for r in ok),
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in ok),
    }
    s = samples(records)
    for name in LATENCIES:
        m.update(stats(name, s[name], percentiles))
    return m


def max_in_flight(records: Sequence[RequestRecord]) -> int:
    """Most requests open at once (send to end), from the records' own intervals."""
    edges = sorted(
        [(r.sent_s, 1) for r in records] + [(r.sent_s + r.e2el_s, -1) for r in records],
        key=lambda e: (e[0], e[1]),
    )  # an end before a start at the same instant
    most = cur = 0
    for _, d in edges:
        cur += d
        most = max(most, cur)
    return most


def breakdown(
    records: Sequence[RequestRecord],
    attr: str,
    percentiles: Sequence[float],
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
) -> dict[str, dict[str, Any]]:
    """Per team or per tier: counts, failures, TTFT/TPOT stats and good requests."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        v = getattr(r, attr)
        if v is not None:
            groups.setdefault(str(v), []).append(r)
    out = {}
    for name, recs in sorted(groups.items()):
        ok = [r for r in recs if r.ok]
        s = samples(recs)
        row: dict[str, Any] = {
            "num_requests": len(recs),
            "completed": len(ok),
            "failed": len(recs) - len(ok),
            "failures": dict(Counter(r.cause for r in recs if not r.ok)),
            "output_tokens": sum(r.output_tokens for r in ok),
        }
        row.update(stats("ttft", s["ttft"], percentiles))
        row.update(stats("tpot", s["tpot"], percentiles))
        if slo_ttft_ms is not None or slo_tpot_ms is not None:
            row["good_requests"] = sum(is_good(r, slo_ttft_ms, slo_tpot_ms) for r in ok)
        out[name] = row
    return out


def bucket_for(duration_s: float) -> float:
    """A round bucket width giving at most ~60 points over the run."""
    for b in (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0):
        if duration_s / b <= 60:
            return b
    return 300.0


def timeline(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> list[dict[str, float]]:
    """Output tokens and completions per `bucket_s` of the run (from chunk arrival times; a
    request's usage count, when it differs, is spread over its chunks)."""
    tokens: defaultdict[int, float] = defaultdict(float)  # a usage count spread: fractions
    done: Counter[int] = Counter()
    for r in records:
        if not r.ok or not r.chunk_s:
            continue
        scale = r.output_tokens / max(1, sum(r.chunk_tokens))
        for t, n in zip(r.chunk_s, r.chunk_tokens, strict=True):
            tokens[int((r.sent_s + t) // bucket_s)] += n * scale
        done[int((r.sent_s + r.e2el_s) // bucket_s)] += 1
    if not tokens and not done:
        return []
    last = max([*tokens, *done])
    return [
        {
            "t": k * bucket_s,
            "output_tokens_per_s": tokens[k] / bucket_s,
            "completed_per_s": done[k] / bucket_s,
        }
        for k in range(last + 1)
    ]


def per_request(records: Sequence[RequestRecord]) -> dict[str, list[Any]]:
    """vLLM's per-request arrays (seconds), plus duet's: send times, causes, team, tier, and the
    shared-prefix group of each prompt and how many of its tokens it shares with that prefix as
    sent (`--prefix-groups`; None without: a replay needs to know which prompts share a prefix,
    and how long it is once text prompts are tokenized, sim/workload.py)."""
    return {
        "input_lens": [r.usage_prompt_tokens or r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.ok else 0 for r in records],
        "ttfts": [r.ttft_s if r.ok else None for r in records],
        "itls": [r.itl_s if r.ok else [] for r in records],
        "e2els": [r.e2el_s if r.ok else None for r in records],
        "start_times": [r.sent_s for r in records],
        "scheduled_times": [r.scheduled_s for r in records],
        "errors": [r.message if not r.ok else "" for r in records],
        "causes": [r.cause for r in records],
        "teams": [r.team for r in records],
        "tiers": [r.tier for r in records],
        "cached_tokens": [r.cached_tokens for r in records],
        "groups": [r.group for r in records],
        "prefix_tokens": [r.prefix_tokens for r in records],
        "turns": [r.turn for r in records],
    }
