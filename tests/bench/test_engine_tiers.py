"""`bench.engine_tiers` on a tiny random model: W1's prefills of the schemes are interleaved (one
of each in turn), so drift in the machine's speed moves every scheme alike; the figures and ratios
come out in the JSON. A smoke test of the harness, not a measurement."""

import json
from pathlib import Path

import pytest

from bench import engine_runs, engine_tiers
from bench.engine_tiers import main


def _calls(
    monkeypatch: pytest.MonkeyPatch, module, name: str, arg: int
) -> list[tuple[int, object]]:
    """Records (engine id, positional argument `arg`) of every call of module.name."""
    calls: list[tuple[int, object]] = []
    real = getattr(module, name)

    def spy(eng, *a):
        calls.append((id(eng), a[arg - 1]))
        return real(eng, *a)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_w1_interleaves_the_schemes(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _calls(
        monkeypatch, engine_runs, "prefill_once", 4
    )  # (eng, shape, prompt_len, rng, rid)
    assert (
        main(
            [
                "--model",
                str(tiny_llama),
                "--schemes",
                "none,int8",
                "--workloads",
                "W1",
                "--threads",
                "1",
                "--prefill-len",
                "32",
                "--prefill-reps",
                "3",
                "--json",
            ]
        )
        == 0
    )
    r = json.loads(capsys.readouterr().out)
    engines = list(dict.fromkeys(e for e, _ in calls))
    assert len(engines) == 2
    # a warm-up each, then rounds of one prefill per scheme
    assert calls == [(engines[i % 2], "w1-warm" if i < 2 else f"w1-{i // 2 - 1}") for i in range(8)]
    for scheme in ("none", "int8"):
        w1 = r["schemes"][scheme]["W1"]
        assert (
            w1["interleaved"] and w1["repeats"] == 3 and w1["tokens_per_s"] > 0 and w1["cpu_s"] > 0
        )
    assert r["schemes"]["int8"]["W1"]["vs_bf16"] == pytest.approx(
        r["schemes"]["int8"]["W1"]["tokens_per_s"] / r["schemes"]["none"]["W1"]["tokens_per_s"]
    )


def test_w2_interleaves_and_reports_its_memory_roofline(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """W2 runs one single stream of each scheme in turn per round (after a warm-up each), and
    carries the bytes a decode step reads, the read bandwidth measured in the same run and the
    fraction of the ceiling they give that the scheme reached; the table prints it."""
    calls = _calls(
        monkeypatch, engine_tiers, "single_stream", 2
    )  # (eng, shape, context, tokens, rng)
    assert (
        main(
            [
                "--model",
                str(tiny_llama),
                "--schemes",
                "none,int8",
                "--workloads",
                "W2",
                "--threads",
                "1",
                "--w2-context",
                "16",
                "--w2-tokens",
                "8",
                "--w2-reps",
                "2",
                "--json",
            ]
        )
        == 0
    )
    engines = list(dict.fromkeys(e for e, _ in calls))
    assert len(engines) == 2
    # warm-ups (32-token prompts) first, then rounds of one run per scheme
    assert calls == [(engines[i % 2], 32 if i < 2 else 16) for i in range(6)]
    r = json.loads(capsys.readouterr().out)
    assert r["schemes"]["int8"]["W2"]["interleaved"] and r["schemes"]["int8"]["W2"]["repeats"] == 2
    assert r["machine"]["read_gbps"] > 0
    none, int8 = r["schemes"]["none"]["W2"], r["schemes"]["int8"]["W2"]
    assert int8["weight_bytes_per_token"] < none["weight_bytes_per_token"]
    for w2 in (none, int8):
        assert w2["kv_bytes_per_token"] > 0
        ceiling = w2["read_gbps"] * 1e9 / (w2["weight_bytes_per_token"] + w2["kv_bytes_per_token"])
        assert w2["roofline_tokens_per_s"] == pytest.approx(ceiling)
        assert w2["of_roofline"] == pytest.approx(w2["tokens_per_s"] / ceiling)
    assert (
        main(
            [
                "--model",
                str(tiny_llama),
                "--schemes",
                "none",
                "--workloads",
                "W2",
                "--threads",
                "1",
                "--w2-context",
                "16",
                "--w2-tokens",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "W2 of roofline" in out and "memory read" in out
