"""sim/per_request.py: a validation case's requests, measured beside simulated — paired by
scheduled time (the replay's order), TPOT per request as `duet bench serve` computes it, and
the whole path through `python -m sim.validate --simulate-only --per-request` on a real replay."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim import validate
from sim.per_request import pair, tsv
from sim.stats import RequestResult
from tests.sim.helpers import write_serve_result


def _measured() -> dict:
    # sent out of order (the second scheduled first), one failed (no TTFT), one of a single token
    return {
        "scheduled_times": [10.5, 10.0, 11.0, 12.0],
        "input_lens": [30, 20, 40, 50],
        "ttfts": [0.2, 0.1, None, 0.3],
        "e2els": [1.2, 0.5, None, 0.3],
        "output_lens": [11, 5, 0, 1],
        "cached_tokens": [16, 0, 0, 0],
        "groups": [1, 0, 1, None],
    }


def test_requests_pair_in_scheduled_order_with_their_own_tpot() -> None:
    sims = [
        RequestResult(
            arrival=5.0,
            prompt_tokens=20,
            tier="interactive",
            first_token=5.12,
            last_token=5.52,
            output_tokens=5,
            path="local",
        ),
        RequestResult(
            arrival=5.5,
            prompt_tokens=30,
            tier="interactive",
            first_token=5.75,
            last_token=6.75,
            output_tokens=11,
            path="disaggregated",
        ),
        RequestResult(arrival=6.0, prompt_tokens=40, tier="interactive", failure="shed"),
        RequestResult(
            arrival=7.0,
            prompt_tokens=50,
            tier="interactive",
            first_token=7.25,
            last_token=7.25,
            output_tokens=1,
            path="local",
        ),
    ]
    rows = pair(_measured(), list(reversed(sims)))  # the collector's order does not matter
    assert [(r.t, r.prompt_tokens, r.group) for r in rows] == [
        (0.0, 20, 0),
        (0.5, 30, 1),
        (1.0, 40, 1),
        (2.0, 50, None),
    ]
    a, b, c, d = rows
    assert a.measured_ttft_ms == pytest.approx(100) and a.simulated_ttft_ms == pytest.approx(120)
    assert a.measured_tpot_ms == pytest.approx(100) and a.simulated_tpot_ms == pytest.approx(
        100
    )  # 0.4 s / 4
    assert b.measured_tpot_ms == pytest.approx(100) and b.simulated_path == "disaggregated"
    assert b.measured_cached_tokens == 16
    assert (c.measured_ttft_ms, c.simulated_ttft_ms, c.measured_tpot_ms, c.simulated_path) == (
        None,
        None,
        None,
        "",
    )
    assert d.measured_tpot_ms is None and d.simulated_tpot_ms is None  # one token: no gap
    text = tsv(rows).splitlines()
    assert text[0].startswith("i\tt_s\tprompt\tgroup") and len(text) == 5
    assert text[3].split("\t")[4:8] == ["-", "-", "-", "-"]


def test_a_simulation_of_another_run_is_refused() -> None:
    with pytest.raises(ValueError, match="4 requests, the simulation 1"):
        pair(_measured(), [RequestResult(arrival=0.0, prompt_tokens=1, tier="interactive")])


def test_validate_writes_and_prints_each_cases_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A measured case (a hand-written `duet bench serve` result in the validation layout)
    re-simulated with the shipped profile: the table has one row per request, in order."""
    case = tmp_path / "1C-r0.5"
    n = 6
    write_serve_result(
        case,
        n,
        gap_s=0.5,
        input_len=64,
        output_len=8,
        ttft_s=0.3,
        e2el_s=0.5,
        p50_tpot_ms=28.6,
        output_throughput=16.0,
    )
    assert (
        validate.main(
            ["--out", str(tmp_path), "--simulate-only", "--per-request", "--cases", "1C-r0.5"]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = (case / "per_request.tsv").read_text().splitlines()
    assert len(rows) == n + 1 and out.startswith("# 1C-r0.5\n" + rows[0])
    measured_ttft = [r.split("\t")[4] for r in rows[1:]]
    simulated_ttft = [float(r.split("\t")[5]) for r in rows[1:]]
    assert measured_ttft == ["300"] * n and all(s > 0 for s in simulated_ttft)
    assert "| 1C-r0.5 " in out  # the summary table follows
