"""sim/jitter.py: step-time noise for sensitivity runs — mean-1 factors, seeded per node, none
at sigma 0 — and `python -m sim.validate --jitter-runs` on a real replay: each figure's largest
move under the noise, printed beside the table."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from duet.cmd_plan import parse_layout
from sim import profile as pf
from sim import validate
from sim import workload as wl
from sim.jitter import StepJitter
from sim.run import simulate
from tests.sim.helpers import write_serve_result

PROFILE = validate.PROFILES / validate.T1


def test_factors_have_mean_one_and_the_given_spread() -> None:
    j = StepJitter(0.1, seed=3)
    xs = [j.factor() for _ in range(20000)]
    # E = 1 exactly; the sample mean's standard error is ~0.1 / sqrt(20000) = 0.0007
    assert abs(statistics.fmean(xs) - 1.0) < 0.004
    assert statistics.stdev(math.log(x) for x in xs) == pytest.approx(0.1, rel=0.05)
    again = StepJitter(0.1, seed=3)
    assert [again.factor() for _ in range(5)] == xs[:5]  # seeded
    assert StepJitter(0.0, seed=3).factor() == 1.0


@pytest.mark.parametrize("sigma", [-0.1, float("nan"), float("inf")])
def test_a_bad_sigma_is_refused(sigma: float) -> None:
    with pytest.raises(ValueError, match="sigma"):
        StepJitter(sigma, seed=0)


def _run(**kw) -> list[float]:
    items = wl.synthetic(
        wl.Synthetic(
            rate=2.0, duration_s=1e9, input_len="200", output_len="16", seed=1, num_requests=12
        )
    )
    _, col = simulate(pf.load(PROFILE), parse_layout("2C", one_host=True), items, **kw)
    return [r.last_token for r in col.results]


def test_a_simulation_with_noise_is_reproducible_and_differs_from_none() -> None:
    plain = _run()
    assert _run(step_jitter=0.0, seed=5) == plain  # sigma 0 is no noise at all
    noisy = _run(step_jitter=0.1, seed=5)
    assert _run(step_jitter=0.1, seed=5) == noisy  # the same seed, the same run
    assert noisy != plain and _run(step_jitter=0.1, seed=6) != noisy


def test_validate_prints_how_far_the_noise_moves_each_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_serve_result(
        tmp_path / "2C-r0.5",
        12,
        gap_s=0.4,
        input_len=300,
        output_len=16,
        ttft_s=0.3,
        e2el_s=0.6,
        p50_tpot_ms=20.0,
        output_throughput=30.0,
    )
    assert (
        validate.main(
            [
                "--out",
                str(tmp_path),
                "--simulate-only",
                "--cases",
                "2C-r0.5",
                "--jitter-runs",
                "3",
                "--jitter",
                "0.2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "sigma 20%, 3 seeded replays" in out
    row = next(x for x in out.splitlines() if x.startswith("| 2C-r0.5 |"))
    devs = [float(c.strip().rstrip("%")) for c in row.strip("|").split("|")[1:]]
    assert len(devs) == len(validate.METRICS) and all(d >= 0 for d in devs) and max(devs) > 0
    saved = json.loads((tmp_path / "validation-threads.json").read_text())[0]["jitter"]
    assert saved["runs"] == 3 and set(saved["max_dev"]) == {m[0] for m in validate.METRICS}
    with pytest.raises(SystemExit):  # argparse's error: a negative count
        validate.main(["--out", str(tmp_path), "--simulate-only", "--jitter-runs", "-1"])
