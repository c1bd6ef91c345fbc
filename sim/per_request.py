"""Each request of a validation case, measured beside simulated: how the simulator's defects
and the real system's show up (a percentile says *that* they differ, a request says *why*).

Two defects were found this way: the real coordinator routing a long prompt to a node already
prefilling one (its load frames did not count a request just taken; e8309d2), and the replay
giving prompts other prefix groups than the run drew (49d4c6f). `python -m sim.validate
--per-request` prints the table for each case; every run writes it to
`<out>/<case>/per_request.tsv`.

The pairing: a replay (sim/workload.py::from_result_file) keeps the run's requests in order of
their scheduled send time, one work item each, so the i-th measured request by scheduled time and
the i-th simulated one by arrival are the same request. TPOT of one request is (last token −
first token) / (tokens − 1), as `duet bench serve` computes it from its e2e latency and TTFT.
"""

from __future__ import annotations

import msgspec

from sim.stats import RequestResult


class RequestPair(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    #: scheduled send time from the run's start (s)
    t: float
    prompt_tokens: int
    group: int | None
    measured_ttft_ms: float | None
    simulated_ttft_ms: float | None
    measured_tpot_ms: float | None
    simulated_tpot_ms: float | None
    measured_cached_tokens: int | None
    #: the simulated route: "local" (one node), "disaggregated" (P then D), or "" when shed
    simulated_path: str


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def pair(measured: dict, simulated: list[RequestResult]) -> list[RequestPair]:
    """Rows of `measured` (a `duet bench serve` result of one run) beside `simulated`
    (a Collector's results from replaying it). Raises ValueError when the counts differ."""
    n = len(measured["scheduled_times"])
    if len(simulated) != n:
        raise ValueError(
            f"the run has {n} requests, the simulation {len(simulated)}: not a replay of it"
        )
    order = sorted(range(n), key=lambda i: measured["scheduled_times"][i])
    sims = sorted(simulated, key=lambda r: r.arrival)
    t0 = min(measured["scheduled_times"]) if n else 0.0
    groups = measured.get("groups") or [None] * n
    cached = measured.get("cached_tokens") or [None] * n
    rows = []
    for k, (i, s) in enumerate(zip(order, sims, strict=True)):
        ttft, e2e, out = measured["ttfts"][i], measured["e2els"][i], measured["output_lens"][i]
        m_tpot = (
            (e2e - ttft) / (out - 1) if ttft is not None and e2e is not None and out > 1 else None
        )
        s_ttft = s.first_token - s.arrival if s.first_token is not None else None
        s_tpot = (
            (s.last_token - s.first_token) / (s.output_tokens - 1)
            if s.first_token is not None and s.last_token is not None and s.output_tokens > 1
            else None
        )
        rows.append(
            RequestPair(
                index=k,
                t=measured["scheduled_times"][i] - t0,
                prompt_tokens=measured["input_lens"][i],
                group=groups[i],
                measured_ttft_ms=_ms(ttft),
                simulated_ttft_ms=_ms(s_ttft),
                measured_tpot_ms=_ms(m_tpot),
                simulated_tpot_ms=_ms(s_tpot),
                measured_cached_tokens=cached[i],
                simulated_path=s.path,
            )
        )
    return rows


def _f(x: float | int | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def tsv(rows: list[RequestPair]) -> str:
    head = (
        "i\tt_s\tprompt\tgroup\tttft_ms_measured\tttft_ms_simulated\ttpot_ms_measured\ttpot_ms_simulated\t"
        "cached_measured\tpath_simulated"
    )
    lines = [head]
    for r in rows:
        lines.append(
            "\t".join(
                [
                    str(r.index),
                    _f(r.t, ".2f"),
                    str(r.prompt_tokens),
                    _f(r.group),
                    _f(r.measured_ttft_ms),
                    _f(r.simulated_ttft_ms),
                    _f(r.measured_tpot_ms),
                    _f(r.simulated_tpot_ms),
                    _f(r.measured_cached_tokens),
                    r.simulated_path or "-",
                ]
            )
        )
    return "\n".join(lines) + "\n"
