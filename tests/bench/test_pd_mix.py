"""`bench.pd --mix long-prompt` (bench/pd_mix.py): what counts as an inter-token gap, the summary's
figures, and its argument checks. (The end-to-end run is the benchmark itself, docs/benchmarks.md:
two node starts of a real model, too long for the suite.)"""

import os

import pytest

from bench.pd import main as pd_main
from bench.pd_client import Result
from bench.pd_mix import Window, gaps_within, proc_cpu_seconds, summary


def test_gaps_are_within_one_request_and_the_window() -> None:
    r = Result("a", token_times=[1.0, 1.1, 1.3, 2.0, 2.05])
    # the first token is a TTFT, not a gap; a gap counts when its later token is in the window
    assert gaps_within(r, 1.2, 2.0) == pytest.approx([0.2, 0.7])
    assert gaps_within(r, 0.0, 9.0) == pytest.approx([0.1, 0.2, 0.7, 0.05])
    assert gaps_within(Result("b", token_times=[1.5]), 0.0, 9.0) == []


def test_summary_pools_rounds_and_reports_the_tail() -> None:
    a = Window(
        itl=[0.01] * 98 + [0.5, 0.5],
        long_ttft=[1.0, 3.0],
        node_cpu_s=4.0,
        wall_s=4.0,
        decode_tokens=100,
    )
    b = Window(
        itl=[0.02] * 100,
        long_ttft=[2.0],
        node_cpu_s=2.0,
        wall_s=4.0,
        decode_tokens=100,
        load=(1.0, 2.0),
    )
    s = summary([a, b], cpus=2)
    assert s["itl_ms"]["n"] == 200 and s["itl_ms"]["max"] == pytest.approx(500.0)
    assert s["itl_ms"]["p50"] == pytest.approx(
        20.0
    )  # pooled: 98 gaps of 10 ms, 100 of 20, 2 of 500
    assert s["itl_ms"]["p99"] > 20.0  # the two 500 ms gaps are the top 1 %
    assert s["long_ttft_ms"]["median"] == pytest.approx(2000.0) and s["long_ttft_ms"]["n"] == 3
    assert s["node_cpu_s"] == 6.0 and s["node_cpu_share"] == pytest.approx(0.75)
    assert s["node_cpu_of_its_cores"] == pytest.approx(0.375)
    assert s["node_cpu_ms_per_decode_token"] == pytest.approx(30.0)
    assert s["load_avg_1m"] == [[0.0, 0.0], [1.0, 2.0]]


def test_cpu_time_of_a_process_grows_with_its_work() -> None:
    before = proc_cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert proc_cpu_seconds(os.getpid()) > before


@pytest.mark.parametrize(
    "bad", [["--streams", "0"], ["--itl-target-ms", "0"], ["--decode-tokens", "1"]]
)
def test_bad_arguments_are_usage_errors(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        pd_main(["--mix", "long-prompt", *bad])
    assert e.value.code == 2 and "must be" in capsys.readouterr().err
