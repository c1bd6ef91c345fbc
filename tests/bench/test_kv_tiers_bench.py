"""bench.kv_tiers on the tiny model: it prices the hierarchy's pieces in prefill tokens, and every
figure it reports is a real measurement (positive, from the engine's own pool)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kv_tiers import main


def test_it_measures_every_piece_against_the_prefill(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(tiny_llama), "--dtype", "float32", "--threads", "1"]
    assert main([*args, "--prompt-len", "64", "--reps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_len"] == 64 and out["block_size"] == 16
    assert out["prefill_ms"]["median"] > 0 and out["prefill_digests_ms"]["n"] == 2
    assert set(out["per_block_us"]) == {
        "digest",
        "copy",
        "host_spill",
        "host_load",
        "disk_spill",
        "disk_load",
    }
    assert all(v["median"] > 0 for v in out["per_block_us"].values())
    assert set(out["token_equivalents"]) == {"host_token", "disk_token", "digest_per_token"}
