"""bench.peers: each peer in its own process, on a tiny random Llama; a peer whose environment is
absent is reported as absent with the reason (the others still run), and bench.engine_tiers'
comparison picks the fastest peer present. No timing bound: what is checked is that the figures
exist and the bookkeeping is right."""

from __future__ import annotations

import json
from pathlib import Path

from bench import peers


def test_transformers_runs_and_an_absent_peer_says_why(tiny_llama: Path, capsys) -> None:
    argv = ["--model", str(tiny_llama), "--peers", "transformers,vllm,llama.cpp"]
    argv += ["--workloads", "W1,W2", "--threads", "1", "--reps", "1", "--json"]
    argv += ["--transformers-dtypes", "float32"]  # one process: each imports torch (seconds)
    argv += ["--vllm-python", "/nonexistent/python", "--llama-python", "/nonexistent/python"]
    rc = peers.main([*argv, "--gguf", "/nonexistent/model.Q4_1.gguf"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    r = result["transformers float32"]
    assert r.get("W1", 0) > 0 and r.get("W2", 0) > 0, r
    assert "no interpreter at /nonexistent/python" in result["vLLM-CPU fp32"]["absent"]
    assert "absent" in result["llama.cpp Q4_1"]
    assert peers.best_peer(result, "W1")[0].startswith("transformers")
    assert peers.best_peer(result, "W3") is None


def test_against_takes_the_best_scheme_and_the_best_peer() -> None:
    result = {
        "schemes": {
            "none": {"W1": {"tokens_per_s": 100.0}},
            "int8": {"W1": {"tokens_per_s": 150.0}},
        },
        "peers": {"a": {"W1": 50.0}, "b": {"W1": 75.0}, "c": {"absent": "no"}},
    }
    peers.against(result)
    assert result["vs_peers"]["W1"] == {
        "duet": "int8",
        "duet_tokens_per_s": 150.0,
        "peer": "b",
        "peer_tokens_per_s": 75.0,
        "ratio": 2.0,
    }
