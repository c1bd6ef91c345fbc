"""bench.decode_ab on a tiny random model: every configuration is built with its own linear path
(DUET_BF16_LINEAR set while that engine's layers are packed, restored after), the rounds alternate
the engines with the order rotated, and every workload reports every configuration. No timing
bound: what is checked is the schedule and the shape of the result."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import decode_ab


def test_configurations_parse_and_bad_ones_are_refused() -> None:
    c = decode_ab.parse_config("bf16/int8:own")
    assert (c.dtype, c.quantization, c.linear) == ("bfloat16", "int8", "own")
    assert decode_ab.parse_config("fp32") == decode_ab.Config(
        name="fp32", dtype="float32", quantization=None, linear=None
    )
    c = decode_ab.parse_config("fp32@int8")
    assert (c.dtype, c.quantization, c.linear, c.kv) == ("float32", None, None, "int8")
    with pytest.raises(ValueError, match="KV dtype 'fp8'"):
        decode_ab.parse_config("bf16@fp8")
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        decode_ab.parse_config("fp8")
    with pytest.raises(ValueError, match="linear path 'mkl'"):
        decode_ab.parse_config("bf16:mkl")
    with pytest.raises(SystemExit):
        decode_ab.parse_args(["--configs", "bf16,bf16"])


def test_rounds_alternate_the_configurations(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine import linear
    from engine.core import EngineCore

    monkeypatch.setenv("DUET_BF16_LINEAR", "onednn")  # restored after each engine is built
    seen: list[str | None] = []
    engines: list[int] = []
    prefills: list[tuple[int, str]] = []
    real_init, real_add = EngineCore.__init__, EngineCore.add_request

    def init(self, config, *a, **kw) -> None:
        seen.append(os.environ.get("DUET_BF16_LINEAR"))
        engines.append(id(self))
        real_init(self, config, *a, **kw)

    def add_request(self, rid, *a, **kw):
        if rid.startswith("p"):
            prefills.append((engines.index(id(self)), rid))
        return real_add(self, rid, *a, **kw)

    monkeypatch.setattr(EngineCore, "__init__", init)
    monkeypatch.setattr(EngineCore, "add_request", add_request)
    argv = ["--model", str(tiny_llama), "--configs", "fp32,bf16:onednn,bf16:own"]
    argv += ["--batches", "1,2", "--prompt-len", "8", "--steps", "2", "--rounds", "3"]
    assert decode_ab.main([*argv, "--prefill-len", "24", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert seen == [None, "onednn", "own"] and os.environ["DUET_BF16_LINEAR"] == "onednn"
    assert linear.bf16_linear_choice() == "onednn"
    assert r["configs"] == ["fp32", "bf16:onednn", "bf16:own"]
    assert list(r["workloads"]) == ["decode 1", "decode 2", "prefill 24"]
    for rows in r["workloads"].values():
        assert list(rows) == r["configs"]
        assert rows["fp32"]["speed_vs_first"] == 1.0
        for row in rows.values():
            assert row["ms"] > 0 and row["tokens_per_s"] > 0
    assert r["workloads"]["decode 2"]["bf16:own"]["samples"] == 3 * 2
    assert r["workloads"]["prefill 24"]["bf16:own"]["samples"] == 3
    # a warm-up prefill each in the given order, then rounds whose order rotates by one
    assert prefills == [
        *((e, "p-1") for e in (0, 1, 2)),
        *((e, "p0") for e in (0, 1, 2)),
        *((e, "p1") for e in (1, 2, 0)),
        *((e, "p2") for e in (2, 0, 1)),
    ]
