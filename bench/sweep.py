"""`--sweep request-rate=1,2,4,8` (or `max-concurrency=1,4,16`): one run per value, in the given
order, and the knee: the highest value whose p99 TTFT meets the TTFT SLO.

A run with more than 1% failed requests does not meet the SLO, whatever its p99: failures
carry no TTFT, so a server shedding load with 429s would otherwise look fast.
"""

from __future__ import annotations

import math
from typing import Any

from bench.serve_config import SWEEP_PARAMS, Sweep

MAX_FAILED_FRACTION = 0.01


def parse_sweep(spec: str) -> Sweep:
    param, sep, values = spec.partition("=")
    param = param.strip().replace("_", "-")
    if not sep or param not in SWEEP_PARAMS:
        raise ValueError(
            f"cannot read --sweep {spec!r}: use {SWEEP_PARAMS[0]}=1,2,4 or {SWEEP_PARAMS[1]}=1,4,16"
        )
    try:
        vals = tuple(float(v) for v in values.split(",") if v.strip())
    except ValueError:
        raise ValueError(
            f"--sweep {spec!r}: values must be numbers (inf allowed for request-rate)"
        ) from None
    if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"--sweep {spec!r}: give one or more positive values")
    if param == "max-concurrency" and any(math.isinf(v) or v != int(v) for v in vals):
        raise ValueError(f"--sweep {spec!r}: concurrency values are whole numbers")
    return Sweep(param=param, values=vals)


def meets_slo(run: dict[str, Any], slo_ttft_ms: float | None) -> bool | None:
    if slo_ttft_ms is None:
        return None
    p99 = run.get("p99_ttft_ms")
    total = run["num_requests"] or 1
    return p99 is not None and p99 <= slo_ttft_ms and run["failed"] / total <= MAX_FAILED_FRACTION


def knee(
    values: tuple[float, ...], runs: list[dict[str, Any]], slo_ttft_ms: float | None
) -> dict[str, Any]:
    if slo_ttft_ms is None:
        return {"value": None, "slo_ttft_ms": None, "reason": "no TTFT SLO given (--slo ttft=MS)"}
    ok = [v for v, r in zip(values, runs, strict=True) if meets_slo(r, slo_ttft_ms)]
    if not ok:
        return {"value": None, "slo_ttft_ms": slo_ttft_ms, "reason": "no value met the SLO"}
    best = max(ok)
    return {
        "value": "inf" if math.isinf(best) else best,
        "slo_ttft_ms": slo_ttft_ms,
        "reason": None,
    }


def sweep_result(
    sweep: Sweep, runs: list[dict[str, Any]], slo_ttft_ms: float | None, config: dict[str, Any]
) -> dict[str, Any]:
    return {
        "config": config,
        "sweep": {
            "param": sweep.param,
            "values": ["inf" if math.isinf(v) else v for v in sweep.values],
        },
        "runs": runs,
        "meets_slo": [meets_slo(r, slo_ttft_ms) for r in runs],
        "knee": knee(sweep.values, runs, slo_ttft_ms),
    }
