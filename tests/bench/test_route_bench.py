"""`bench.route` end to end with tiny sizes: a smoke test of the harness (keys, outcomes, the
HTTP child process), not a measurement."""

import json

import pytest

from bench.route import main


def test_bench_route_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "--nodes",
        "6",
        "--blocks",
        "400",
        "--prompt-blocks",
        "40",
        "--decisions",
        "200",
        "--http-decisions",
        "60",
        "--concurrency",
        "3",
        "--json",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out)
    assert "in-process" in captured.err  # progress goes to stderr
    assert r["config"] == {"nodes": 6, "index_blocks": 400, "prompt_blocks": 40, "seed": 0}
    ip, http = r["in_process"], r["http"]
    assert ip["decisions"] == 200 and sum(ip["outcomes"].values()) == 200
    assert 0 < ip["p50_ms"] <= ip["p99_ms"] <= ip["max_ms"] and ip["decisions_per_s"] > 0
    assert 0 < ip["cpu_p50_ms"] <= ip["cpu_p99_ms"]
    assert http["decisions"] == 60 and http["errors"] == {} and http["concurrency"] == 3
    assert 0 < http["p50_ms"] <= http["p99_ms"]
    assert r["meets_target"] == (ip["p99_ms"] < 1.0)
