"""The validation plan covers what docs/capacity.md's validation needs (≥ 6 runs: 1 colocated
node, 1P1D, 2 colocated, ≥ 2 rates each, one with shared prefixes, one with the long-prompt mix),
and the table's MAPE is the mean of the per-case errors."""

from __future__ import annotations

from collections import defaultdict

from duet.cmd_plan import parse_layout
from sim import validate


def test_cases_cover_the_issue() -> None:
    cases = [c for c in validate.CASES if c.bar]  # the cases the MAPE is taken over
    assert len(cases) >= 6
    rates: dict[str, set[str]] = defaultdict(set)
    for c in cases:
        parse_layout(c.layout)  # every layout parses
        rates[c.layout].add(c.serve[c.serve.index("--request-rate") + 1])
    assert {k: len(v) >= 2 for k, v in rates.items()} == {"1C": True, "1P+1D": True, "2C": True}
    assert any("--prefix-groups" in c.serve for c in cases)
    assert any(x.startswith("lognormal:1024") for c in cases for x in c.serve)


def test_table_and_mape() -> None:
    def rows(ttft: float, pred: float) -> list[dict]:
        return [
            {"metric": m[0], "measured": ttft, "predicted": pred, "ape": abs(pred - ttft) / ttft}
            for m in validate.METRICS
        ]

    text = validate.table(
        [
            {"case": "a", "load_avg_before": 1.0, "rows": rows(100, 110)},
            {"case": "b", "load_avg_before": 2.0, "rows": rows(100, 70)},
        ]
    )
    last = text.splitlines()[-1]
    assert last.startswith("| **MAPE** |") and "20% (max 30%)" in last


def test_a_case_outside_the_bar_is_shown_but_not_averaged() -> None:
    def rows(ttft: float, pred: float) -> list[dict]:
        return [
            {"metric": m[0], "measured": ttft, "predicted": pred, "ape": abs(pred - ttft) / ttft}
            for m in validate.METRICS
        ]

    text = validate.table(
        [
            {"case": "a", "load_avg_before": 1.0, "rows": rows(100, 110)},
            {
                "case": "over",
                "load_avg_before": 1.0,
                "rows": rows(100, 300),
                "bar": False,
                "outside": "overloaded",
            },
            {"case": "b", "load_avg_before": 2.0, "rows": rows(100, 70)},
        ]
    )
    lines = text.splitlines()
    mape = next(i for i, x in enumerate(lines) if x.startswith("| **MAPE** |"))
    assert "20% (max 30%)" in lines[mape]  # a and b only: the 200 % case is not in it
    assert (
        lines[mape + 1].startswith("| over (") and "outside the MAPE: overloaded" in lines[mape + 1]
    )
    assert "300.0 / 200%" in lines[mape + 1]
    assert all(c.outside for c in validate.CASES if not c.bar)  # every case left out says why
