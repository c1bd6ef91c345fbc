"""`duet bench profile` on a tiny random Llama: the profile JSON loads with the simulator's
schema, holds samples of every kind of step (prefill alone, prefix-cache hits, decode batches,
mixed), a fit with its errors, the KV geometry of the model, and drives a simulation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import profile as bp
from sim import profile as pf
from sim.cluster import Layout, NodeGroup
from sim.run import simulate
from sim.workload import WorkItem


def test_profile_of_a_tiny_model(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    rc = bp.main(
        [
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--quick",
            "--transport",
            "none",
            "--kv-memory",
            "8MiB",
            "--max-model-len",
            "1024",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    prof = pf.load(out)
    s = prof.samples
    assert summary["samples"] == len(s) > 30
    assert any(x.prefill_tokens and not x.decode_seqs for x in s)  # prefill alone
    assert any(x.decode_seqs >= 16 and not x.prefill_tokens for x in s)  # decode batches
    assert any(x.decode_seqs and x.prefill_tokens for x in s)  # mixed
    assert any(
        x.attention > x.prefill_tokens**2 for x in s
    )  # chunks at a later start (chunked prefill)
    # Σ n·start, recorded: attention − prefill² for a step of one chunk, more for several (Σn² < P²)
    assert any(
        x.cached_attention > 0 and x.cached_attention == x.attention - x.prefill_tokens**2
        for x in s
    )
    assert all(
        x.attention - x.prefill_tokens**2 <= x.cached_attention < x.attention
        for x in s
        if x.prefill_tokens
    )
    # a prefix-cache hit: 16 new tokens atop a computed 8-block (128-token) prefix, alone in its
    # step
    assert any(
        x.prefill_tokens == 16 and x.cached_attention == 16 * 128 and not x.decode_seqs for x in s
    )
    m = prof.step
    assert m.provenance is pf.Provenance.MEASURED and m.num_samples == len(s)
    assert m.fit_mape is not None and m.holdout_mape is not None and m.fit_max_ape is not None
    # tiny Llama: 2 layers × 2 KV heads × head_dim 16 × (K, V) × 4 bytes (fp32)
    assert prof.kind.kv_bytes_per_token == 2 * 2 * 16 * 2 * 4
    assert prof.kind.kv_capacity_tokens == (8 << 20) // (prof.kind.kv_bytes_per_token * 16) * 16
    assert any("measured" in n for n in prof.notes)
    assert (
        prof.corun.provenance is pf.Provenance.MODELLED and prof.corun.prefill_factor == 1.0
    )  # --quick: not timed
    r, _ = simulate(
        prof, Layout((NodeGroup("both", 1),)), [WorkItem(t=0.0, prompt=[5] * 100, max_tokens=8)]
    )
    assert r.completed == 1
