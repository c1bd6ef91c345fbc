"""bench.serve's arithmetic on hand-built records, exactly: TTFT/TPOT/ITL/E2EL statistics
(numpy percentiles), output tokens from usage or chunks, DistServe goodput, failures by cause,
breakdowns, the sweep knee, arrivals, length specs, trace prompts and compare ratios."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

from bench import metrics_calc
from bench.arrivals import send_offsets
from bench.compare import compare
from bench.lengths import parse_length
from bench.prompts import PromptBuilder
from bench.records import RequestRecord
from bench.serve_args import build_parser, parse_slo, to_config
from bench.sweep import knee, parse_sweep
from bench.trace import load_trace, replay


def rec(
    i: int,
    ttft: float,
    chunks: list[float],
    e2el: float,
    *,
    tokens: int | None = None,
    cause: str | None = None,
    team: str | None = None,
) -> RequestRecord:
    r = RequestRecord(
        index=i,
        prompt_len=10,
        max_tokens=8,
        scheduled_s=0.1 * i,
        sent_s=0.1 * i + 0.01,
        team=team,
        ttft_s=ttft,
        chunk_s=chunks,
        chunk_tokens=[1] * len(chunks),
        e2el_s=e2el,
    )
    if cause:
        r.fail(cause, "boom")
    else:
        r.ok = True
        r.output_tokens = tokens if tokens is not None else len(chunks)
        r.usage_tokens = tokens is not None
    return r


def test_latency_statistics_follow_the_definitions() -> None:
    recs = [
        rec(0, 0.10, [0.10, 0.12, 0.15, 0.16], 0.17),
        rec(1, 0.30, [0.30, 0.31], 0.40, tokens=5),  # usage says 5 tokens in 2 chunks
        rec(2, 0.20, [0.20], 0.20),  # one token: no TPOT, no ITL
        rec(3, 0.0, [], 1.0, cause="http_429"),
        rec(4, 0.0, [], 2.0, cause="timeout"),
    ]
    m = metrics_calc.compute(recs, 2.0, configured_rate=5.0, percentiles=(50, 90, 99))
    assert (m["num_requests"], m["completed"], m["failed"]) == (5, 3, 2)
    assert m["failures"] == {"http_429": 1, "timeout": 1}
    assert m["total_output_tokens"] == 4 + 5 + 1
    assert m["output_throughput"] == pytest.approx(10 / 2.0)
    assert m["request_throughput"] == pytest.approx(3 / 2.0)
    ttft = np.array([0.10, 0.30, 0.20]) * 1e3
    for p in (50, 90, 99):
        assert m[f"p{p}_ttft_ms"] == pytest.approx(np.percentile(ttft, p))
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    tpot = [(0.17 - 0.10) / 3 * 1e3, (0.40 - 0.30) / 4 * 1e3]
    assert m["mean_tpot_ms"] == pytest.approx(np.mean(tpot))
    assert m["p99_tpot_ms"] == pytest.approx(np.percentile(tpot, 99))
    itl = [20.0, 30.0, 10.0, 10.0]  # pooled chunk gaps of requests 0 and 1
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itl))
    assert m["p90_itl_ms"] == pytest.approx(np.percentile(itl, 90))
    assert m["median_e2el_ms"] == pytest.approx(200.0)
    assert m["request_goodput"] is None and m["good_requests"] is None  # no SLO given
    assert m["configured_request_rate"] == 5.0
    assert m["achieved_request_rate"] == pytest.approx(4 / 0.4)
    assert m["usage_reported"] == 1
    # sent at 0.01, 0.11, 0.21, 0.31, 0.41; open until 0.18, 0.51, 0.41, 1.31, 2.41
    assert m["max_concurrent_requests"] == 3
    assert m["max_output_tokens_per_s"] == 10.0  # every chunk lands within the first second


def test_goodput_counts_requests_meeting_every_slo() -> None:
    recs = [
        rec(0, 0.10, [0.10, 0.12], 0.12),  # TTFT 100, TPOT 20: good
        rec(1, 0.30, [0.30, 0.31], 0.31),  # TTFT 300: misses the TTFT SLO
        rec(2, 0.10, [0.10, 0.20], 0.20),  # TPOT 100: misses the TPOT SLO
        rec(3, 0.05, [0.05], 0.05),  # one token: no TPOT, meets
        rec(4, 0.0, [], 0.5, cause="sse_error"),  # failed: never good
    ]
    m = metrics_calc.compute(recs, 4.0, configured_rate=math.inf, slo_ttft_ms=200, slo_tpot_ms=50)
    assert m["good_requests"] == 2 and m["request_goodput"] == pytest.approx(2 / 4.0)
    only_ttft = metrics_calc.compute(recs, 4.0, configured_rate=math.inf, slo_ttft_ms=200)
    assert only_ttft["good_requests"] == 3
    assert m["configured_request_rate"] == "inf"


def test_empty_and_all_failed_runs_report_nulls_not_crashes() -> None:
    m = metrics_calc.compute(
        [rec(0, 0, [], 1.0, cause="connection_error")], 1.0, configured_rate=1.0
    )
    assert m["completed"] == 0 and m["p99_ttft_ms"] is None and m["mean_itl_ms"] is None
    assert metrics_calc.timeline([]) == []


def test_breakdown_by_team_and_per_request_arrays() -> None:
    recs = [
        rec(0, 0.1, [0.1, 0.2], 0.2, team="a"),
        rec(1, 0.3, [0.3], 0.3, team="b"),
        rec(2, 0, [], 1, cause="http_401", team="b"),
    ]
    by = metrics_calc.breakdown(recs, "team", (50, 99), 150, None)
    assert by["a"]["completed"] == 1 and by["a"]["good_requests"] == 1
    assert (
        by["b"]["failed"] == 1
        and by["b"]["failures"] == {"http_401": 1}
        and by["b"]["good_requests"] == 0
    )
    arr = metrics_calc.per_request(recs)
    assert arr["ttfts"] == [0.1, 0.3, None] and arr["causes"] == [None, None, "http_401"]
    assert arr["itls"][0] == pytest.approx([0.1]) and arr["output_lens"] == [2, 1, 0]


def test_timeline_spreads_usage_tokens_over_chunks() -> None:
    r = rec(0, 0.1, [0.1, 1.1], 1.2, tokens=6)  # sent at 0.01
    tl = metrics_calc.timeline([r], bucket_s=1.0)
    assert [p["output_tokens_per_s"] for p in tl] == [3.0, 3.0]
    assert sum(p["completed_per_s"] for p in tl) == 1


def test_knee_is_the_highest_value_meeting_the_ttft_slo() -> None:
    def run(p99: float | None, failed: int = 0) -> dict[str, object]:
        return {"p99_ttft_ms": p99, "failed": failed, "num_requests": 100}

    values = (1.0, 2.0, 4.0, 8.0)
    runs = [run(50), run(90), run(400), run(900)]
    assert knee(values, runs, 100)["value"] == 2.0
    assert knee(values, [run(50), run(60, failed=5), run(70), run(900)], 100)["value"] == 4.0
    assert knee(values, [run(50), run(60), run(70, failed=5), run(900)], 100)["value"] == 2.0
    assert knee(values, runs, 10)["value"] is None
    assert knee(values, runs, None)["reason"]
    assert parse_sweep("request-rate=1,2,inf").values == (1.0, 2.0, math.inf)
    for bad in ("rate=1", "request-rate=", "max-concurrency=1.5", "request-rate=0"):
        with pytest.raises(ValueError):
            parse_sweep(bad)


def test_arrivals_poisson_mean_gap_and_infinite_rate() -> None:
    gen = send_offsets(10.0, 1.0, random.Random(0))
    ts = [next(gen) for _ in range(4000)]
    assert ts[-1] / len(ts) == pytest.approx(0.1, rel=0.05)
    gaps = np.diff(ts)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    bursty = np.diff(
        [t for t, _ in zip(send_offsets(10.0, 0.25, random.Random(0)), range(4000), strict=False)]
    )
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(
        2.0, rel=0.15
    )  # gamma(k): CV 1/sqrt(k)
    inf = send_offsets(math.inf, 1.0, random.Random(0))
    assert [next(inf) for _ in range(3)] == [0.0, 0.0, 0.0]


def test_length_specs() -> None:
    rng = random.Random(0)
    assert parse_length("64").sample(rng) == 64
    u = parse_length("uniform:10,20")
    assert {u.sample(rng) for _ in range(500)} == set(range(10, 21))
    ln = parse_length("lognormal:100,0.5")
    assert np.median([ln.sample(rng) for _ in range(3000)]) == pytest.approx(100, rel=0.08)
    for bad in ("0", "x", "uniform:5", "uniform:9,3", "lognormal:-1,1", "beta:1,2"):
        with pytest.raises(ValueError):
            parse_length(bad)


def test_trace_replay_reuses_blocks_for_equal_hash_ids(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(
        '{"timestamp": 1000, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]}\n'
        '{"timestamp": 1500, "input_length": 30, "output_length": 7, "hash_ids": [1, 2, 9]}\n'
        '\n{"timestamp": 1200, "input_length": 10, "output_length": 3}\n'
    )
    builder = PromptBuilder("tokens", vocab_size=1000)
    reqs = list(replay(load_trace(f), builder, 16, 0.5, seed=0))
    assert [r.arrival_s for r in reqs] == [0.0, 0.1, 0.25]  # sorted, (t - t0) ms × 0.5
    assert [r.output_len for r in reqs] == [5, 3, 7] and [r.prompt_len for r in reqs] == [
        40,
        10,
        30,
    ]
    a, b, c = reqs[0].prompt, reqs[1].prompt, reqs[2].prompt
    assert c == a[:30]  # hash ids 1, 2 shared: the same 30 tokens
    assert b != a[:10]
    assert next(replay(load_trace(f), builder, 16, 0.5, seed=0)).prompt == a  # deterministic
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_trace(tmp_path / "bad.jsonl")


def test_config_refuses_incoherent_flags() -> None:
    p = build_parser()
    base = ["--base-url", "http://127.0.0.1:1"]
    cases = {
        (
            "--endpoint",
            "/v1/chat/completions",
            "--prompt-format",
            "tokens",
            "--vocab-size",
            "9",
        ): "chat",
        ("--prompt-format", "tokens"): "vocab",
        ("--duration", "5"): "max-concurrency",
        ("--duration", "5", "--sweep", "request-rate=1,inf"): "max-concurrency",
        ("--dataset", "trace"): "dataset-path",
        ("--prefix-groups", "3"): "prefix",
        ("--slo", "ttft=abc"): "slo",
        ("--extra-body", "[1]"): "JSON object",
        ("--team", "nokey"): "team",
    }
    for extra, words in cases.items():
        with pytest.raises(ValueError, match=words):
            to_config(p.parse_args([*base, *extra]))
    with pytest.raises(ValueError, match="http"):
        to_config(p.parse_args(["--base-url", "127.0.0.1:8000"]))
    cfg = to_config(
        p.parse_args(
            [
                *base,
                "--prompt-format",
                "tokens",
                "--vocab-size",
                "50",
                "--api-key",
                "sk-x",
                "--team",
                "a:2=sk-secret",
            ]
        )
    )
    assert cfg.num_requests == 100  # the default bound
    pub = cfg.public()
    assert "sk-x" not in str(pub) and "sk-secret" not in str(pub) and pub["request_rate"] == "inf"
    for bounded in (
        ["--duration", "5", "--request-rate", "3"],
        ["--duration", "5", "--sweep", "request-rate=1,2"],
        ["--duration", "5", "--sweep", "max-concurrency=1,2"],
    ):
        assert to_config(
            p.parse_args([*base, "--vocab-size", "9", "--prompt-format", "tokens", *bounded])
        )
    assert parse_slo("ttft=500,tpot=50") == (500.0, 50.0) and parse_slo("ttft:200") == (200.0, None)


def test_compare_ratios_and_verdicts() -> None:
    a = {
        "completed": 10,
        "failed": 0,
        "request_throughput": 2.0,
        "p99_ttft_ms": 100.0,
        "request_goodput": None,
    }
    b = {
        "completed": 10,
        "failed": 1,
        "request_throughput": 3.0,
        "p99_ttft_ms": 50.0,
        "request_goodput": None,
    }
    rows = {r["metric"]: r for r in compare(a, b)["rows"]}
    assert (
        rows["request_throughput"]["ratio"] == pytest.approx(1.5)
        and rows["request_throughput"]["better"] == "b"
    )
    assert (
        rows["p99_ttft_ms"]["ratio"] == pytest.approx(0.5) and rows["p99_ttft_ms"]["better"] == "b"
    )
    assert rows["failed"]["better"] == "a" and rows["completed"]["better"] is None
    assert "request_goodput" not in rows
    with pytest.raises(ValueError, match="sweep"):
        compare(a, {"runs": []})


def test_prefix_groups_share_their_prefix() -> None:
    from bench.lengths import LengthDist
    from bench.workloads import synthetic

    builder = PromptBuilder("tokens", vocab_size=5000)
    reqs = [
        r
        for r, _ in zip(
            synthetic(builder, LengthDist(a=8), LengthDist(a=4), 1, prefix_groups=3, prefix_len=20),
            range(60),
            strict=False,
        )
    ]
    by_group: dict[int, set[tuple[int, ...]]] = {}
    for r in reqs:
        assert r.group is not None and r.prompt_len == 28 and r.output_len == 4
        by_group.setdefault(r.group, set()).add(tuple(r.prompt[:20]))
    assert sorted(by_group) == [0, 1, 2] and all(len(p) == 1 for p in by_group.values())
    assert len({next(iter(p)) for p in by_group.values()}) == 3
    assert len({tuple(r.prompt[20:]) for r in reqs}) == 60  # unique suffixes


def test_duet_cli_dispatches_serve_and_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from duet.cli import main as duet

    assert duet(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "x.json").write_text('{"not": "a result"}')
    assert duet(["bench", "compare", str(tmp_path / "x.json"), str(tmp_path / "x.json")]) == 2
    assert "not a `duet bench serve --json` result" in capsys.readouterr().err
    assert (
        duet(
            [
                "bench",
                "serve",
                "--base-url",
                "http://127.0.0.1:1",
                "--endpoint",
                "/v1/chat/completions",
                "--prompt-format",
                "tokens",
                "--vocab-size",
                "10",
            ]
        )
        == 2
    )
    assert "chat" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        duet(["bench", "serve", "--help"])
    assert e.value.code == 0 and "--request-rate" in capsys.readouterr().out
