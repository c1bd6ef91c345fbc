"""`bench.engine` end to end on a tiny random model with tiny sizes: a smoke test of the
harness (keys, units, the transformers baseline), not a measurement."""

import json
from pathlib import Path

import pytest

from bench.engine import main

TINY = ["--threads", "1", "--prefill-len", "32", "--context", "16", "--decode-steps", "2",
        "--batches", "2,4", "--concurrency", "1,3", "--e2e-input", "16", "--e2e-output", "4",
        "--online-requests", "5", "--online-rate", "200", "--online-batch", "2", "--peak-size", "128"]  # fmt: skip


def test_bench_engine_json(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_llama), "--json", *TINY]) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out)
    assert "prefill" in captured.err  # progress goes to stderr
    assert r["machine"]["threads"] == 1 and r["machine"]["torch"]
    assert r["gemm_peak_gflops"]["bfloat16"] > 0 and r["gemm_peak_gflops"]["float32"] > 0
    assert r["prefill"]["prompt_tokens"] == 32 and r["prefill"]["tokens_per_s"] > 0
    assert r["prefill"]["frac_bf16_peak"] > 0 and r["prefill"]["frac_fp32_peak"] > 0
    assert r["decode_single"]["batch"] == 1 and r["decode_single"]["tokens_per_s"] > 0
    assert [d["batch"] for d in r["decode_steady"]] == [2, 4]
    assert all(d["tokens_per_s"] > 0 and d["gflops"] > 0 for d in r["decode_steady"])
    assert [e["concurrency"] for e in r["end_to_end"]] == [1, 3]
    assert all(e["output_tokens_per_s"] > 0 for e in r["end_to_end"])
    online = r["online"]
    assert online["requests"] == 5 and online["batch"] == 2
    assert online["engine"]["output_tokens_per_s"] > 0 and online["transformers"]["output_tokens_per_s"] > 0
    assert online["ratio"] > 0
    assert {t["target"] for t in r["targets"]} and all(isinstance(t["met"], bool) for t in r["targets"])


def test_bench_engine_table(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_llama), "--skip-transformers", *TINY]) == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "decode x4" in out and "online" in out and "targets" in out
