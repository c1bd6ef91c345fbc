"""bench.batch_ttft drives a real gateway (batch tier on) in front of a real node and prints one
well-formed JSON report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import batch_ttft
from tests.gateway.helpers import MODEL, gateway_proc, http, make_team, tiny_model
from tests.procs import Proc, running


def test_batch_ttft_report(
    node: Proc, tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gw = gateway_proc(
        tmp_path,
        {MODEL: tiny_model(tiny_llama, both=[node.url])},
        batch={"concurrency": 2, "poll_s": 0.05},
    )
    with running(gw):
        key = make_team(gw.url, "bench")
        rc = batch_ttft.main(
            [
                "--gateway",
                gw.url,
                "--api-key",
                key,
                "--model",
                MODEL,
                "--interactive",
                "3",
                "--prompt-len",
                "16",
                "--batch-streams",
                "2",
                "--batch-lines",
                "300",
                "--batch-prompt-len",
                "32",
                "--batch-max-tokens",
                "8",
                "--json",
            ]
        )
        assert rc == 0
        report = json.loads(capsys.readouterr().out)
        # the background batch ran through the gateway and was cancelled at the end of its phase
        batch_id = report["phases"]["batch"]["batch_id"]
        status, _, b = http(f"{gw.url}/v1/batches/{batch_id}", key=key)
    assert status == 200 and b["status"] == "cancelled" and b["request_counts"]["completed"] > 0
    assert set(report["phases"]) == {"idle", "batch", "no_priority"}
    for name, ph in report["phases"].items():
        assert ph["requests"] == 3
        assert 0 < ph["ttft_p50_ms"] <= ph["ttft_p95_ms"]
        assert (ph["background_tokens_per_s"] > 0) == (name != "idle")
    idle = report["phases"]["idle"]["ttft_p50_ms"]
    assert report["ttft_p50_ratio_batch_vs_idle"] == pytest.approx(
        report["phases"]["batch"]["ttft_p50_ms"] / idle
    )
