"""`python -m bench.router --json` on the shipped evaluation set: the report's figures agree with
each other (a harness check, not a quality bound)."""

import json
import subprocess
import sys
from pathlib import Path

from bench.router import main


def test_bench_router_json(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    n = r["prompts"]
    assert n >= 75 and r["split"] == "test"
    diag = sum(r["confusion"][t][t] for t in r["confusion"])
    assert sum(sum(row.values()) for row in r["confusion"].values()) == n
    assert r["accuracy"] == round(diag / n, 4)
    assert sum(r["routed_to"].values()) == n
    c = r["cost_usd"]
    assert c["auto"] > 0 and c["strongest"] > 0 and c["oracle"] <= c["strongest"]
    assert r["cost_ratio_auto_vs_strongest"] == round(c["auto"] / c["strongest"], 4)
    assert r["weights"]["fresh"] is True  # weights.json was fit on the data shipped with it


def test_bench_router_cli_table_and_bad_args() -> None:
    root = Path(__file__).parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "bench.router"], capture_output=True, text=True, cwd=root
    )
    assert out.returncode == 0 and "confusion" in out.stdout and "accuracy" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "bench.router", "--completion-tokens", "simple=1"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert bad.returncode != 0 and "completion-tokens" in bad.stderr
