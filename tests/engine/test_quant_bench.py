"""bench.quality and bench.quant_engine: they run, print correct JSON, and the perplexity they
report is the one transformers computes for the same weights."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from bench.quality import agreement, corpus_text, perplexity
from engine import LLM
from tests.engine.oracle import hf_model


def test_perplexity_equals_transformers(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64)
    ids = llm.tokenizer.encode(corpus_text())[:300]
    got = perplexity(llm, ids, window=128)
    assert got["scored_tokens"] == 127 + 127 + 43
    nll, count = 0.0, 0
    with torch.inference_mode():
        for s in range(0, 300, 128):
            chunk = torch.tensor([ids[s : s + 128]])
            loss = hf_model(tiny_llama)(chunk, labels=chunk).loss.item()
            nll += loss * (chunk.shape[1] - 1)
            count += chunk.shape[1] - 1
    assert math.isclose(got["perplexity"], math.exp(nll / count), rel_tol=1e-4)


def test_agreement_counts() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = [[1, 2, 9, 4], [5, 6, 7, 8]]
    assert agreement(ref, got) == {
        "first_token": 1.0,
        "tokens_before_divergence": 6 / 8,
        "positions_equal": 7 / 8,
        "identical_sequences": 0.5,
    }


def test_benches_print_json(tiny_llama: Path) -> None:
    q = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.quality",
            "--model",
            str(tiny_llama),
            "--json",
            "--tokens",
            "200",
            "--window",
            "64",
            "--prompts",
            "4",
            "--prompt-len",
            "8",
            "--max-tokens",
            "4",
            "--schemes",
            "int8,int4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert q.returncode == 0, q.stderr
    res = json.loads(q.stdout)
    assert set(res["schemes"]) == {"bf16", "int8", "int4"}
    assert res["corpus"]["tokens"] == 200 and len(res["corpus"]["sha256"]) == 64
    for name in ("int8", "int4"):
        row = res["schemes"][name]
        assert row["perplexity"] > 1 and 0 <= row["greedy_agreement"]["first_token"] <= 1
        assert "met" in row["target"]

    e = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.quant_engine",
            "--model",
            str(tiny_llama),
            "--json",
            "--steps",
            "3",
            "--context",
            "16",
            "--batches",
            "1,4",
            "--threads",
            "1",
            "--linear-rows",
            "1,16",
            "--linear-reps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert e.returncode == 0, e.stderr
    res = json.loads(e.stdout)
    rows = res["schemes"]
    assert set(rows) == {"none", "int8", "int4"}
    # int8 weights are half of bf16 (plus per-row scales); int4 layers are 5/16 of bf16
    assert rows["int8"]["weight_bytes"] < 0.6 * rows["none"]["weight_bytes"]
    assert rows["int4"]["weight_bytes"] < rows["int8"]["weight_bytes"]
    for row in rows.values():
        assert row["decode_1"]["tokens_per_s"] > 0 and row["decode_4"]["batch"] == 4
        assert row["profile"]["linears_ms"] > 0
        assert row["linears"]["rows_1_ms"] > 0 and row["linears"]["rows_16_ms"] > 0
    # the dequantization figure exists exactly where a weight-only scheme takes the bf16 GEMM path
    # (the engine's dtype here is the default for the CPU: bf16 where it has bf16 dot products)
    assert rows["none"]["linears"]["panel_dequant_ms"] is None
    from engine.qlinear import bf16_gemm_isa

    bf16_path = bf16_gemm_isa() > 0 and res["config"]["dtype"] == "bfloat16"
    for s in ("int8", "int4"):
        assert (rows[s]["linears"]["panel_dequant_ms"] is not None) == bf16_path, rows[s]["linears"]
