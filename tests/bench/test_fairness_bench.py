"""`duet bench fairness --json` runs end to end (echo node, two real gateways, two teams) and
prints one JSON object with each phase's figures and the plot; no timing is asserted."""

import json
import subprocess
import sys
from pathlib import Path


def test_fairness_bench_prints_json(tiny_llama: Path, tmp_path: Path) -> None:
    plot = tmp_path / "fair.png"
    args = ["--json", "--tokenizer", str(tiny_llama), "--slots", "2", "--flood", "2"]
    args += ["--duration-s", "2", "--max-tokens", "4", "--first-token-delay-s", "0.05"]
    args += ["--fair-headroom", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "duet", "bench", "fairness", *args, "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["bench"] == "fairness" and out["flood_outstanding"] == 2
    assert out["capacity"]["errors"] == 0 and out["capacity"]["tokens_per_s"] > 0
    assert out["b_alone"]["errors"] == 0 and out["b_alone"]["ttft_p90_s"] > 0
    for order in ("fair", "fcfs"):
        run = out["flood"][order]
        assert run["a"]["errors"] == run["b"]["errors"] == 0
        assert run["a"]["requests"] > 0 and run["b"]["requests"] > 0
        assert {"b_ttft_p90_ratio", "a_of_leftover", "meets_targets"} <= set(run)
        assert {"queue_wait_mean_s", "queue_wait_p90_le_s"} <= set(run["b"])
        assert set(out["timelines"][order]) == {"a", "b"}
    assert plot.stat().st_size > 0
