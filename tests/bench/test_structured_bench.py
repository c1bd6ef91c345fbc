"""`bench.structured` end to end on the tiny random model with tiny sizes: a smoke test of the
harness (the corpus compile, plain and guided decode runs, the mask's share), not a measurement."""

import json
from pathlib import Path

import pytest

from bench.structured import main


def test_bench_structured_json(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--model",
                str(tiny_llama),
                "--json",
                "--threads",
                "1",
                "--tokens",
                "4",
                "--batches",
                "1,2",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    r = json.loads(captured.out)
    assert "compiling the corpus" in captured.err  # progress goes to stderr
    c = r["compile"]
    assert c["schemas"] >= 40 and 0 < c["compile_ms_p50"] <= c["compile_ms_p99"]
    assert r["grammar_engine"].startswith("llguidance ")
    for b in (1, 2):
        run = r[f"batch_{b}"]
        # every request decodes its 4 tokens (ignore_eos), the first from prefill: 3 decode steps
        # each
        assert run["plain"]["decode_tokens"] == run["guided"]["decode_tokens"] == 3 * b
        # no guided row in the plain run; in the guided one every decoded token was masked (what
        # was timed, not how long it took: a loaded machine can stall either run's calls)
        assert run["plain"]["masked_rows"] == 0 and run["guided"]["masked_rows"] == 3 * b
        assert run["plain"]["mask_ms_per_step"] >= 0 and run["guided"]["mask_ms_per_step"] > 0
        assert 0 < run["mask_share_of_step_median"] < 1
    assert isinstance(r["meets_target"], bool) and r["target_mask_share"] == 0.10
