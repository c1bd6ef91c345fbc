"""`bench.engine` end to end on a tiny random model with tiny sizes: a smoke test of the
harness (keys, units, the transformers baseline), not a measurement."""

import json
from pathlib import Path

import pytest

from bench.engine import main

TINY = [
    "--threads",
    "1",
    "--prefill-len",
    "32",
    "--context",
    "16",
    "--decode-steps",
    "2",
    "--batches",
    "2,4",
    "--concurrency",
    "1,3",
    "--e2e-input",
    "16",
    "--e2e-output",
    "4",
    "--online-requests",
    "5",
    "--online-rate",
    "200",
    "--online-batch",
    "2",
    "--peak-size",
    "128",
]


def _spread_ok(r: dict, key: str) -> bool:
    return 0 < r[f"{key}_p10"] <= r[key] <= r[f"{key}_p90"]


def test_bench_engine_json(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--model",
                str(tiny_llama),
                "--json",
                "--dtype",
                "bfloat16",
                "--prefill-reps",
                "3",
                *TINY,
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    r = json.loads(captured.out)
    assert "prefill" in captured.err  # progress goes to stderr
    assert r["machine"]["threads"] == 1 and r["machine"]["torch"]
    assert r["config"]["dtype"] == "bfloat16" and "median" in r["config"]["statistic"]
    pk = r["gemm_peak_gflops"]
    # The peak is measured in the engine's dtype through the engine's own linear path.
    assert pk["dtype"] == "bfloat16" and pk["engine_linear"] > 0 and pk["matmul_size"] == 128
    assert pk["engine_linear_path"] in ("linear_bf16", "onednn_prepacked", "F.linear")
    assert pk["torch_mm"]["bfloat16"] > 0 and pk["torch_mm"]["float32"] > 0
    p = r["prefill"]
    assert p["prompt_tokens"] == 32 and p["repeats"] == 3 and _spread_ok(p, "tokens_per_s")
    assert (
        p["seconds_p10"] <= p["seconds"] <= p["seconds_p90"] and p["seconds_best"] <= p["seconds"]
    )
    assert p["frac_peak"] == pytest.approx(p["gflops"] / pk["engine_linear"])
    assert r["decode_single"]["batch"] == 1 and _spread_ok(r["decode_single"], "tokens_per_s")
    assert [d["batch"] for d in r["decode_steady"]] == [2, 4]
    for d in r["decode_steady"]:
        assert _spread_ok(d, "tokens_per_s") and d["gflops"] > 0 and d["frac_peak"] > 0
        assert d["ms_per_step_p10"] <= d["ms_per_step_median"] <= d["ms_per_step_p90"]
    assert [e["concurrency"] for e in r["end_to_end"]] == [1, 3]
    assert all(e["output_tokens_per_s"] > 0 for e in r["end_to_end"])
    online = r["online"]
    assert online["requests"] == 5 and online["batch"] == 2
    tps = {k: online[k]["output_tokens_per_s"] for k in ("engine", "engine_static", "transformers")}
    assert all(v > 0 for v in tps.values())
    assert online["transformers"]["dtype"] == "bfloat16"
    # The ablation splits the ratio exactly: continuous batching x (engine static / transformers).
    assert online["ratio_continuous_batching"] == pytest.approx(
        tps["engine"] / tps["engine_static"]
    )
    assert online["ratio_engine_static_over_transformers"] == pytest.approx(
        tps["engine_static"] / tps["transformers"]
    )
    assert online["ratio"] == pytest.approx(
        online["ratio_continuous_batching"] * online["ratio_engine_static_over_transformers"]
    )
    for name in ("engine", "engine_static", "transformers"):
        # Every request has a first and a last token, in that order, after it arrived.
        s = online[name]
        assert 0 < s["ttft_s"]["p50"] <= s["e2e_latency_s"]["p50"], (name, s)
    assert {t["target"] for t in r["targets"]} and all(
        isinstance(t["met"], bool) for t in r["targets"]
    )


def test_bench_engine_table(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_llama), "--skip-transformers", *TINY]) == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "decode x4" in out and "online" in out and "targets" in out
