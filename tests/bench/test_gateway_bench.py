"""`python -m bench.gateway --json` runs end to end (echo node + real gateway) and prints one
JSON object with the overhead and concurrency figures; no timing is asserted."""

import json
import subprocess
import sys
from pathlib import Path

from bench.gateway import slow_share


def test_gateway_bench_prints_json(tiny_llama: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gateway",
            "--json",
            "--tokenizer",
            str(tiny_llama),
            "--requests",
            "5",
            "--streams",
            "30",
            "--stream-tokens",
            "4",
            "--token-delay",
            "0.01",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["bench"] == "gateway" and out["overhead"]["requests"] == 5
    for name in ("ttft", "latency"):
        x = out["overhead"][name]
        assert (
            x["node"]["p50_ms"] > 0 and x["gateway"]["p50_ms"] > 0 and x["bare_relay"]["p50_ms"] > 0
        )
        assert "overhead_p99_ms" in x and "bare_relay_overhead_p99_ms" in x
        assert isinstance(out["overhead"]["meets_target"][name], bool)
        assert set(x["slow_share"]) == {"node", "gateway", "bare_relay"}
        assert all(0 <= v <= 1 for v in x["slow_share"].values())
    assert set(out["overhead"]["cpu_ms_per_request"]) == {"gateway", "bare_relay"}
    assert all(v >= 0 for v in out["overhead"]["cpu_ms_per_request"].values())
    c = out["concurrency"]
    assert c["streams"] == 30 and c["completed"] == 30 and c["errors"] == {}
    assert c["tokens_per_s"] > 0
    mem = c["gateway_memory"]
    assert mem["rss_peak_mib"] >= mem["rss_idle_mib"] > 0 and mem["kib_per_stream"] >= 0


def test_gateway_bench_on_postgres(tiny_llama: Path) -> None:
    """--store postgres: the same run with the gateway on a PostgreSQL server (pgserver) the
    bench starts and stops; --first-token-delay makes the echo node wait before its first token."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gateway",
            "--json",
            "--tokenizer",
            str(tiny_llama),
            "--store",
            "postgres",
            "--requests",
            "3",
            "--first-token-delay",
            "0.01",
            "--streams",
            "5",
            "--stream-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["config"]["store"] == "postgres" and out["concurrency"]["completed"] == 5
    # the echo node's wait is in both paths' time to first token
    assert (
        out["overhead"]["ttft"]["node"]["p50_ms"] >= 10
        and out["overhead"]["ttft"]["gateway"]["p50_ms"] >= 10
    )


def test_slow_share_counts_requests_over_their_own_median() -> None:
    xs = [0.001] * 96 + [0.0019, 0.0021, 0.005, 0.009]  # median 1 ms: three more than 1 ms over it
    assert slow_share(xs) == 0.03
    assert slow_share(xs, over_s=0.005) == 0.01
    assert slow_share([]) is None


def test_gateway_bench_otlp_pays_for_its_export(tiny_llama: Path) -> None:
    """--otlp: a third gateway exports its spans over OTLP/HTTP to the bench's receiver, which
    decodes them (opentelemetry-proto) before the CPU is read. Each of the traced paths' requests
    has its spans there; the ring-only gateway is still measured beside it."""
    n = 4
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gateway",
            "--json",
            "--tokenizer",
            str(tiny_llama),
            "--otlp",
            "--requests",
            str(n),
            "--streams",
            "3",
            "--stream-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    o = json.loads(proc.stdout)["overhead"]
    assert set(o["cpu_ms_per_request"]) == {
        "gateway",
        "bare_relay",
        "gateway_traced",
        "gateway_otlp",
    }
    for name in ("gateway_traced", "gateway_otlp"):
        assert (
            o["latency"][f"{name}_overhead_p50_ms"] is not None and o["latency"][name]["p50_ms"] > 0
        )
    # every request's server span and its children arrived: several spans per request, in real
    # exports
    assert o["otlp"]["spans"] >= 3 * n and o["otlp"]["exports"] >= 1 and o["otlp"]["bytes"] > 0
