"""The step-time model: the fit recovers known coefficients, reports its error, never goes
negative, and a profile survives a JSON round trip."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sim import profile as pf
from tests.sim.helpers import toy_profile


def _samples(noise: float) -> list[pf.StepSample]:
    rng = random.Random(1)
    out = []
    for _ in range(200):
        p = rng.choice([0, 0, 16, 128, 512])
        d = rng.randint(0 if p else 1, 32)
        ctx = d * rng.randint(10, 800) + p
        attn = p * p
        t = 0.004 + 2e-5 * p + 3e-4 * d + 1e-6 * ctx + 2e-9 * attn
        out.append(pf.StepSample(p, d, ctx, attn, t * (1 + rng.uniform(-noise, noise))))
    return out


def test_fit_recovers_the_coefficients() -> None:
    m = pf.fit(_samples(0.0))
    assert m.intercept_s == pytest.approx(0.004, rel=1e-3)
    assert m.prefill_s == pytest.approx(2e-5, rel=1e-3)
    assert m.decode_s == pytest.approx(3e-4, rel=1e-3)
    assert m.fit_mape is not None and m.fit_mape < 1e-6
    assert m.num_samples == 200 and m.max_decode_seqs == 32


def test_fit_error_is_reported_and_coefficients_stay_non_negative() -> None:
    samples = _samples(0.05)
    # a feature that does not matter, with noise, would fit slightly negative by plain lstsq
    m = pf.fit(samples)
    assert 0.005 < (m.fit_mape or 0) < 0.05
    assert m.holdout_mape is not None and m.holdout_mape < 0.06
    assert min(m.intercept_s, m.prefill_s, m.decode_s, m.context_s, m.attention_s) >= 0


def _chunked(recorded: bool) -> list[pf.StepSample]:
    """Prefill chunks of n tokens at start s: attention n·(s + n) costs 1e-9 a pair, and the n·s
    pairs that read earlier chunks' KV 2e-9 more (the paged pool)."""
    out = []
    for n in (16, 64, 128, 256, 512):
        for s in (0, 256, 512, 1024, 1536):
            a, b = n * (s + n), n * s
            t = 0.01 + 2e-5 * n + 1e-6 * (s + n) + 1e-9 * a + 2e-9 * b
            out.append(pf.StepSample(n, 0, s + n, a, t, t, b if recorded else 0))
    for d in (1, 8, 32):
        out.append(pf.StepSample(0, d, d * 300, 0, 0.01 + 3e-4 * d + 1e-6 * d * 300))
    return out


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "older-samples"])
def test_attention_to_earlier_chunks_is_its_own_coefficient(recorded: bool) -> None:
    # older samples have no n·start: one chunk per step, so the fit reads it as attention − prefill²
    m = pf.fit(_chunked(recorded))
    assert m.attention_s == pytest.approx(1e-9, rel=1e-3) and m.cached_attention_s == pytest.approx(
        2e-9, rel=1e-3
    )
    assert m.fit_max_ape is not None and m.fit_max_ape < 1e-6
    late = pf.StepFeatures(512, 0, 2048, 512 * 2048, 512 * 1536)
    assert m.seconds(late) == pytest.approx(
        0.01 + 2e-5 * 512 + 1e-6 * 2048 + 1e-9 * 512 * 2048 + 2e-9 * 512 * 1536
    )
    # a profile written before the feature existed predicts as it did
    old = pf.StepModel(
        intercept_s=0.01,
        prefill_s=0,
        decode_s=0,
        context_s=0,
        attention_s=1e-9,
        provenance=pf.Provenance.MEASURED,
    )
    assert old.seconds(late) == pytest.approx(0.01 + 1e-9 * 512 * 2048)


def test_too_few_samples_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot fit"):
        pf.fit(_samples(0)[:3])


def test_profile_round_trip(tmp_path: Path) -> None:
    p = toy_profile()
    pf.save(p, tmp_path / "p.json")
    assert pf.load(tmp_path / "p.json") == p
    (tmp_path / "bad.json").write_text('{"kind": 3}')
    with pytest.raises(ValueError, match="not a duet profile"):
        pf.load(tmp_path / "bad.json")


def test_at_contention_scales_cpu_kinds_only() -> None:
    import msgspec

    p = msgspec.structs.replace(toy_profile(), contention=2.0)
    q = p.at_contention(3.0)
    assert q.contention == 3.0
    assert q.step.intercept_s == pytest.approx(p.step.intercept_s * 1.5)
    assert q.overheads.request_s == pytest.approx(p.overheads.request_s * 1.5)
    assert (
        toy_profile().at_contention(3.0) == toy_profile()
    )  # a GPU-like kind: no contention recorded


def test_contention_meter_reads_about_one_when_idle_or_more() -> None:
    import time

    from sim.contention import ContentionMeter

    with ContentionMeter(interval_s=0.02, work_s=0.001) as m:
        time.sleep(0.3)
    assert len(m.samples) >= 3 and m.median >= 0.99


def test_the_schema_lives_in_protocol_and_needs_only_msgspec() -> None:
    """The coordinator's autoscaler may import only protocol/: the schema must not pull in the
    simulator, numpy or the engine, and every shipped profile must load through it."""
    import ast

    import protocol.profile as pp

    tree = ast.parse(Path(pp.__file__).read_text())
    mods = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    mods |= {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert mods <= {"__future__", "enum", "pathlib", "msgspec"}, mods
    assert pf.Profile is pp.Profile and pf.load is pp.load  # sim's callers keep working
    shipped = sorted((Path(__file__).resolve().parents[2] / "data/profiles").glob("*.json"))
    assert len(shipped) >= 4
    for path in shipped:
        assert isinstance(pp.load(path), pp.Profile)


def test_cpu_overheads_do_not_scale_with_contention() -> None:
    import msgspec

    p = msgspec.structs.replace(toy_profile(), contention=2.0)
    p = msgspec.structs.replace(
        p, overheads=msgspec.structs.replace(p.overheads, node_token_cpu_s=1e-3)
    )
    q = p.at_contention(4.0)
    assert q.overheads.node_token_cpu_s == 1e-3  # CPU is the machine's cost, not its state
    assert q.cpu_to_wall(1e-3) == pytest.approx(4e-3) and p.cpu_to_wall(1e-3) == pytest.approx(2e-3)
