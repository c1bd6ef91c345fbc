"""`duet bench serve` end to end against the synthetic latency server (a real process on
loopback). Its latencies are configured, so the percentiles the bench reports are checked
against values computed from the configuration: each measured latency is its configured value
plus a non-negative overhead, so every percentile must lie in [expected, expected + TOL]. That
is a correctness check of the measurement, not a timing bound on any system."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import numpy as np
import pytest

from bench.compare import main as compare_main
from bench.serve import main
from tests.procs import Proc, free_port, running

TOL_MS = 60.0  # client + server overhead allowed on a loaded 2-core machine


@pytest.fixture
def latency_server(tmp_path: Path) -> Iterator[Any]:
    procs: list[Proc] = []

    def start(*flags: str) -> Proc:
        port = free_port()
        p = Proc(
            [sys.executable, "-m", "bench.latency_server", "--port", str(port), *flags],
            port,
            tmp_path / f"latency-{port}.log",
        )
        procs.append(p)
        p.wait_healthy(60)
        return p

    with running():
        try:
            yield start
        finally:
            for p in procs:
                p.terminate()


def stats(server: Proc) -> dict[str, Any]:
    with urlopen(server.url + "/stats", timeout=10) as r:
        return json.loads(r.read())


def bench_json(capsys: pytest.CaptureFixture[str], *args: str, rc: int = 0) -> dict[str, Any]:
    assert main([*args, "--json", "--quiet"]) == rc
    return json.loads(capsys.readouterr().out)


def within(measured: float, expected: float, tol: float = TOL_MS) -> bool:
    return expected - 0.5 <= measured <= expected + tol


def test_percentiles_goodput_and_output_files(
    latency_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = latency_server("--ttft-ms", "100", "--ttft-ms-per-token", "2", "--itl-ms", "20")
    result_file, plot_dir = tmp_path / "run.json", tmp_path / "plots"
    r = bench_json(
        capsys,
        "--base-url",
        srv.url,
        "--prompt-format",
        "tokens",
        "--vocab-size",
        "1000",
        "--input-len",
        "uniform:10,90",
        "--output-len",
        "8",
        "--num-requests",
        "24",
        "--slo",
        "ttft=200,tpot=40",
        "--result-file",
        str(result_file),
        "--plot",
        str(plot_dir),
    )
    for key in (
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "p99_e2el_ms",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "config",
        "duration",
        "completed",
    ):
        assert key in r, key
    assert r["completed"] == 24 and r["failed"] == 0 and r["usage_reported"] == 24
    assert r["output_lens"] == [8] * 24 and r["total_output_tokens"] == 8 * 24
    assert r["model_id"] == "latency-model"  # discovered from /v1/models
    exp_ttft = 100 + 2 * np.asarray(r["input_lens"], dtype=float)
    exp_e2el = exp_ttft + 7 * 20
    for p in (50, 90, 99):
        # P99 of 24 requests is nearly their maximum: one request the loaded machine delayed moves
        # it by hundreds of ms (493 vs ~330 ms in a CI run, the vLLM setup running beside it), so
        # there only the server's own delays bound it, from below; P50 and P90 are checked both ways
        tol = TOL_MS if p < 99 else float("inf")
        assert within(r[f"p{p}_ttft_ms"], np.percentile(exp_ttft, p), tol), (p, r[f"p{p}_ttft_ms"])
        assert within(r[f"p{p}_e2el_ms"], np.percentile(exp_e2el, p), tol), (p, r[f"p{p}_e2el_ms"])
        if p < 99:
            assert abs(r[f"p{p}_tpot_ms"] - 20) <= 10, (p, r[f"p{p}_tpot_ms"])
    assert within(r["mean_ttft_ms"], float(exp_ttft.mean()))
    assert abs(r["mean_itl_ms"] - 20) <= 10 and abs(r["median_itl_ms"] - 20) <= 10
    # goodput: every request meets TPOT 40; TTFT ≤ 200 holds for those configured below 200 - TOL
    # and fails for those configured above 200
    sure = int((exp_ttft <= 200 - TOL_MS).sum())
    possible = int((exp_ttft <= 200).sum())
    assert sure <= r["good_requests"] <= possible
    assert r["good_requests"] == sum(t * 1e3 <= 200 for t in r["ttfts"])
    assert r["request_goodput"] == pytest.approx(r["good_requests"] / r["duration"])
    assert json.loads(result_file.read_text()) == r
    for name in ("ttft_cdf.png", "itl_cdf.png", "throughput.png"):
        assert (plot_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failures_are_counted_by_cause_and_never_stop_the_run(
    latency_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = latency_server(
        "--ttft-ms",
        "20",
        "--itl-ms",
        "5",
        "--fail-every",
        "5",
        "--hang-every",
        "11",
        "--sse-error-every",
        "7",
        "--truncate-every",
        "9",
    )
    out_file = tmp_path / "r.json"
    assert (
        main(
            [
                "--base-url",
                srv.url,
                "--prompt-format",
                "tokens",
                "--vocab-size",
                "500",
                "--input-len",
                "8",
                "--output-len",
                "6",
                "--num-requests",
                "22",
                "--request-timeout",
                "2",
                "--quiet",
                "--result-file",
                str(out_file),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    # arrivals 1..22: HTTP 500 on 5,10,15,20; hang on 11,22; SSE error on 7,14,21; cut on 9,18
    assert "11 / 11" in table and "http_500 4" in table and "timeout 2" in table
    r = json.loads(out_file.read_text())
    assert r["failures"] == {"http_500": 4, "incomplete_stream": 2, "sse_error": 3, "timeout": 2}
    assert sorted(c for c in r["causes"] if c) == sorted(
        ["http_500"] * 4 + ["incomplete_stream"] * 2 + ["sse_error"] * 3 + ["timeout"] * 2
    )
    assert all(e for e, c in zip(r["errors"], r["causes"], strict=True) if c)
    assert stats(srv)["arrivals"] == 22
    # nothing listening: every request fails, the run still ends and reports, exit status 1
    dead = bench_json(
        capsys,
        "--base-url",
        f"http://127.0.0.1:{free_port()}",
        "--model",
        "m",
        "--prompt-format",
        "tokens",
        "--vocab-size",
        "500",
        "--num-requests",
        "3",
        rc=1,
    )
    assert dead["failures"] == {"connection_error": 3} and dead["p99_ttft_ms"] is None


def test_trace_replay_follows_the_timestamps(
    latency_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = latency_server("--ttft-ms", "5", "--itl-ms", "1")
    stamps = [0, 700, 200, 1000, 250]  # ms, out of order on purpose
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": 5000 + t,
                    "input_length": 20 + i,
                    "output_length": 3,
                    "hash_ids": [1, 2 + i],
                }
            )
            + "\n"
            for i, t in enumerate(stamps)
        )
    )
    r = bench_json(
        capsys,
        "--base-url",
        srv.url,
        "--dataset",
        "trace",
        "--dataset-path",
        str(trace),
        "--trace-block-size",
        "16",
        "--prompt-format",
        "tokens",
        "--vocab-size",
        "500",
        "--warmup",
        "2",
    )
    planned = sorted(t / 1e3 for t in stamps)
    assert r["num_prompts"] == 5 and r["completed"] == 5 and r["warmup"] == {"sent": 2, "failed": 0}
    assert r["scheduled_times"] == pytest.approx(planned)
    for sent, plan in zip(r["start_times"], planned, strict=True):
        assert plan - 1e-3 <= sent <= plan + TOL_MS / 1e3  # never early (1 ms: timer granularity)
    arrivals = [e["t"] for e in stats(srv)["requests"]][2:]  # after the two warm-up requests
    for got, plan in zip(arrivals, planned, strict=True):
        assert abs((got - arrivals[0]) - plan) <= TOL_MS / 1e3
    assert r["input_lens"] == [20, 22, 24, 21, 23]  # by timestamp: 0, 200, 250, 700, 1000


def test_chat_teams_tiers_and_metrics_scrapes(
    latency_server: Any,
    tiny_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    srv = latency_server("--ttft-ms", "30", "--itl-ms", "10", "--api-keys", "key-a,key-b")
    monkeypatch.setenv("BENCH_KEY_B", "key-b")
    r = bench_json(
        capsys,
        "--base-url",
        srv.url,
        "--endpoint",
        "/v1/chat/completions",
        "--tokenizer",
        str(tiny_llama),
        "--input-len",
        "12",
        "--output-len",
        "4",
        "--num-requests",
        "16",
        "--request-rate",
        "40",
        "--seed",
        "3",
        "--team",
        "a:3=key-a",
        "--team",
        "b=env:BENCH_KEY_B",
        "--tier-mix",
        "interactive:1,batch:1",
        "--tier-via",
        "both",
        "--scrape-metrics",
        srv.url,
        "--scrape-interval",
        "0.1",
    )
    assert r["completed"] == 16 and r["backend"] == "openai-chat"
    assert set(r["by_team"]) == {"a", "b"} and set(r["by_tier"]) == {"interactive", "batch"}
    assert sum(t["completed"] for t in r["by_team"].values()) == 16
    assert "key-a" not in json.dumps(r) and "key-b" not in json.dumps(r)
    seen = stats(srv)["requests"]
    teams = dict(zip(range(16), r["teams"], strict=True))
    assert {e["authorization"] for e in seen} <= {"Bearer key-a", "Bearer key-b"}
    assert sum(e["authorization"] == "Bearer key-a" for e in seen) == list(teams.values()).count(
        "a"
    )
    assert all(
        e["tier"] == e["service_tier"] and e["tier"] in ("interactive", "batch") for e in seen
    )
    assert all(e["path"] == "/v1/chat/completions" and e["model"] == "latency-model" for e in seen)
    scrape = r["scrapes"][srv.url + "/metrics"]
    phases = [s["phase"] for s in scrape["scrapes"]]
    assert (
        phases[0] == "before" and phases[-1] == "after" and scrape["summary"]["failed_scrapes"] == 0
    )
    after = scrape["scrapes"][-1]["samples"]
    assert (
        after["duet:requests_total"] - scrape["scrapes"][0]["samples"]["duet:requests_total"] == 16
    )


def test_sweep_finds_the_knee_and_compare_reads_results(
    latency_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # TTFT grows by 100 ms per request already in flight: concurrency 1 → 50 ms, 4 → ≤ 350 ms,
    # 16 → up to 1,550 ms; with an 800 ms SLO on the p99 (of 16 requests: about the slowest) the
    # knee is 4. The margins are hundreds of ms each way: at 20 + 30 ms per request and a 200 ms
    # SLO, one request of concurrency 4 stalled 90+ ms on a loaded CI machine and moved the knee.
    srv = latency_server("--ttft-ms", "50", "--ttft-ms-per-running", "100", "--itl-ms", "1")
    args = [
        "--base-url",
        srv.url,
        "--prompt-format",
        "tokens",
        "--vocab-size",
        "500",
        "--input-len",
        "8",
        "--output-len",
        "2",
        "--num-requests",
        "16",
        "--slo",
        "ttft=800",
    ]
    sweep_file = tmp_path / "sweep.json"
    s = bench_json(
        capsys,
        *args,
        "--sweep",
        "max-concurrency=1,4,16",
        "--plot",
        str(tmp_path / "p"),
        "--result-file",
        str(sweep_file),
    )
    assert s["sweep"] == {"param": "max-concurrency", "values": [1.0, 4.0, 16.0]}
    assert [run["config"]["max_concurrency"] for run in s["runs"]] == [1, 4, 16]
    assert s["meets_slo"] == [True, True, False] and s["knee"]["value"] == 4.0
    assert (tmp_path / "p" / "latency_throughput.png").stat().st_size > 0
    assert main([*args, "--sweep", "max-concurrency=1,16", "--quiet"]) == 0
    table = capsys.readouterr().out
    assert "knee: max-concurrency = 1" in table
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(s["runs"][0]))
    b.write_text(json.dumps(s["runs"][2]))
    assert compare_main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "p99 TTFT (ms)" in out and "B/A" in out
    assert compare_main([str(a), str(b), "--json"]) == 0
    rows = {x["metric"]: x for x in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["p99_ttft_ms"]["ratio"] == pytest.approx(
        s["runs"][2]["p99_ttft_ms"] / s["runs"][0]["p99_ttft_ms"]
    )
    assert compare_main([str(a), str(b), "--plot", str(tmp_path / "ab")]) == 0
    assert (tmp_path / "ab" / "ttft_over_time.png").stat().st_size > 0
    capsys.readouterr()
    assert compare_main([str(sweep_file), str(sweep_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["knee"] == {"a": 4.0, "b": 4.0}
    assert compare_main([str(a), str(sweep_file)]) == 2


def test_duration_bounds_a_closed_loop_run(
    latency_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = latency_server("--ttft-ms", "40", "--itl-ms", "1", "--output-len", "1")
    r = bench_json(
        capsys,
        "--base-url",
        srv.url,
        "--prompt-format",
        "tokens",
        "--vocab-size",
        "500",
        "--input-len",
        "4",
        "--duration",
        "1",
        "--max-concurrency",
        "2",
    )
    assert r["num_prompts"] >= 4 and r["failed"] == 0
    assert max(r["start_times"]) < 1.0 and r["config"]["duration_s"] == 1.0
    assert r["mean_tpot_ms"] is None  # one-token outputs have no TPOT
    assert stats(srv)["arrivals"] == r["num_prompts"]


def test_ctrl_c_stops_sending_and_reports_what_finished(
    latency_server: Any, tmp_path: Path
) -> None:
    srv = latency_server("--ttft-ms", "30", "--itl-ms", "5")
    out = tmp_path / "out.json"
    with out.open("wb") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.serve",
                "--base-url",
                srv.url,
                "--prompt-format",
                "tokens",
                "--vocab-size",
                "500",
                "--input-len",
                "4",
                "--output-len",
                "4",
                "--duration",
                "120",
                "--max-concurrency",
                "2",
                "--json",
                "--quiet",
            ],
            stdout=f,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 60
            while stats(srv)["arrivals"] < 6:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)  # polling the server's counter, not covering a race
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    r = json.loads(out.read_text())
    assert r["interrupted"] and r["failed"] == 0 and r["num_prompts"] >= 6
    assert stats(srv)["arrivals"] == r["num_prompts"]  # nothing sent after the stop


def test_sharegpt_prompts_and_reply_lengths(
    latency_server: Any, tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from text.tokenizer import Tokenizer

    tok = Tokenizer(tiny_llama)
    convs = [
        (
            "The quick brown fox jumps over the lazy dog.",
            "Paris is the capital of France, and Berlin too.",
        ),
        ("def main():\n    return 42\n", "The quick brown fox jumps over the lazy dog twice."),
        ("Paris is the capital of France.", "Ünïcödé text, emojis and more text here."),
    ]
    data = [
        {
            "id": str(i),
            "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}],
        }
        for i, (q, a) in enumerate(convs)
    ]
    data += [
        {
            "id": "short",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
        },
        {
            "id": "no-reply",
            "conversations": [{"from": "human", "value": "a long enough question here"}],
        },
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    srv = latency_server("--ttft-ms", "5", "--itl-ms", "1")
    r = bench_json(
        capsys,
        "--base-url",
        srv.url,
        "--dataset",
        "sharegpt",
        "--dataset-path",
        str(path),
        "--tokenizer",
        str(tiny_llama),
        "--num-requests",
        "6",
    )
    assert r["completed"] == 6
    n_out = {len(tok.encode(a, add_special_tokens=False)) for _, a in convs}
    seen = stats(srv)["requests"]
    assert {e["max_tokens"] for e in seen} <= n_out  # the reply's length in tokens
    assert len({e["max_tokens"] for e in seen}) > 1 and set(r["output_lens"]) <= n_out
    # the prompts sent are the human turns (the server counts words, and its usage is reported)
    assert {e["prompt_tokens"] for e in seen} <= {len(q.split()) for q, _ in convs}
    assert sorted(r["input_lens"]) == sorted(e["prompt_tokens"] for e in seen)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data[3:]))
    assert (
        main(
            [
                "--base-url",
                srv.url,
                "--dataset",
                "sharegpt",
                "--dataset-path",
                str(bad),
                "--tokenizer",
                str(tiny_llama),
            ]
        )
        == 2
    )
    assert "no usable conversation" in capsys.readouterr().err


def test_multi_turn_conversations_resend_their_growing_history(
    latency_server: Any, tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = latency_server(
        "--ttft-ms",
        "5",
        "--itl-ms",
        "1",
        "--api-keys",
        "key-a,key-b",
        "--fail-every",
        "7",
        "--fail-status",
        "503",
    )
    r = bench_json(
        capsys,
        "--base-url",
        srv.url,
        "--endpoint",
        "/v1/chat/completions",
        "--tokenizer",
        str(tiny_llama),
        "--workload",
        "multi-turn",
        "--conversations",
        "5",
        "--users",
        "2",
        "--turns",
        "3",
        "--system-prompt-len",
        "20",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--think-time-s",
        "0.01",
        "--team",
        "a=key-a",
        "--team",
        "b=key-b",
    )
    # every 7th arrival was refused (503): sent again, so every turn completed, the refusals
    # counted as the failures they were
    assert r["completed"] == 15 and set(r["by_turn"]) == {"0", "1", "2"}
    assert r["failed"] == r["failures"]["http_503"] == r["num_requests"] - 15 >= 2
    assert r["multi_turn"]["conversations"] == 5 and r["multi_turn"]["working_set_tokens"] > 0
    by_conv: dict[str, list[dict[str, Any]]] = {}
    for e in stats(srv)["requests"]:
        if e["n"] % 7 == 0:
            continue  # refused
        conv, turn = e["request_id"].split("-r")[0].rsplit("-", 2)[-2:]
        by_conv.setdefault(conv, []).append({**e, "turn": int(turn)})
    assert len(by_conv) == 5
    for turns in by_conv.values():
        turns.sort(key=lambda e: e["turn"])
        # system + user; then each earlier user and assistant message, and the new user's
        assert [e["messages"] for e in turns] == [2, 4, 6]
        lens = [e["prompt_tokens"] for e in turns]
        assert lens[0] < lens[1] < lens[2]
        # one key per conversation: a team's conversation stays its team's
        assert len({e["authorization"] for e in turns}) == 1
