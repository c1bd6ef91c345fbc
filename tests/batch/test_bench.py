"""bench.batch_ttft runs against a real node and prints one well-formed JSON report."""

from __future__ import annotations

import json

import pytest

from bench import batch_ttft
from tests.procs import Proc


def test_batch_ttft_report(node: Proc, capsys: pytest.CaptureFixture[str]) -> None:
    rc = batch_ttft.main(["--url", node.url, "--interactive", "3", "--prompt-len", "16",
                          "--batch-streams", "2", "--batch-prompt-len", "32",
                          "--batch-max-tokens", "8", "--json"])  # fmt: skip
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["phases"]) == {"idle", "batch", "no_priority"}
    for name, ph in report["phases"].items():
        assert ph["requests"] == 3
        assert 0 < ph["ttft_p50_ms"] <= ph["ttft_p95_ms"]
        assert (ph["background_tokens_per_s"] > 0) == (name != "idle")
    idle = report["phases"]["idle"]["ttft_p50_ms"]
    assert report["ttft_p50_ratio_batch_vs_idle"] == pytest.approx(report["phases"]["batch"]["ttft_p50_ms"] / idle)
