"""duet plan: layouts parse, the capacity search brackets the SLO, fleets and the Pareto front
are consistent, and both CLI forms run end to end (real processes, files written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from duet.cmd_plan import DEFAULT_SCENARIO, parse_layout
from sim import plan as pl
from sim import profile as pf
from tests.sim.helpers import toy_profile

ROOT = Path(__file__).resolve().parents[2]


def test_parse_layout() -> None:
    assert parse_layout("2C").label() == "2C"
    lay = parse_layout("1P+2D", max_num_seqs=8)
    assert [(g.role, g.count) for g in lay.groups] == [
        ("prefill", 1),
        ("decode", 2),
    ] and lay.max_num_seqs == 8
    for bad in ("", "3X", "2P", "1P+1Q"):
        with pytest.raises(ValueError):
            parse_layout(bad)


def test_target_scenario_and_its_assumptions() -> None:
    sc = pl.load_scenario(DEFAULT_SCENARIO)
    assert sc.users_peak == 10000 and sc.teams == 10 and sc.team_peak_users == 2000
    assert sc.peak_rate == pytest.approx(10000 / 38)
    assert 0 < sc.day_utilisation < 1
    text = " ".join(sc.assumptions())
    assert "10,000 concurrent users" in text and "TTFT P90" in text


def _small_scenario(**kw: object) -> pl.Scenario:
    base = dict(
        name="t",
        users_peak=400,
        think_time_s=30,
        e2e_guess_s=2,
        input_len="256",
        output_len="32",
        ttft_p90_ms=400.0,
        e2e_p90_ms=3000.0,
    )
    return pl.Scenario(**{**base, **kw})


def test_capacity_brackets_the_slo() -> None:
    prof, sc = toy_profile(), _small_scenario()
    v = pl.Variant("colocated", parse_layout("2C").groups)
    cfg = pl.SearchConfig(warmup_s=3, measure_s=12, iterations=2)
    cap = pl.capacity(prof, v, sc, cfg, guess=2.0)
    assert cap.rate > 0 and cap.at_capacity is not None and cap.at_capacity.meets_slo
    assert any(not p.summary.meets_slo and p.rate > cap.rate for p in cap.probes)
    assert all(p.summary.meets_slo for p in cap.probes if p.rate <= cap.rate)
    fl = pl.fleets(prof, [cap], sc.peak_rate, usd_per_gpu_hour=2.0)
    factors = [f.factor for f in fl]
    assert factors[0] == 1.0 and len(factors) >= 2 and all(1.05 < x <= 2.5 for x in factors[1:])
    # the larger fleets are the passing probes the search ran (no extra simulations)
    assert all(any(s is p.summary for p in cap.probes) for _, _, s in cap.relaxed)
    assert fl[0].cells * cap.rate >= sc.peak_rate and fl[0].usd_per_hour == fl[0].gpus * 2.0
    front = pl.pareto(fl)
    costs = [f.usd_per_hour for f in front]
    ttfts = [f.summary.latency_ms["p90_ttft"] for f in front]
    assert costs == sorted(costs) and ttfts == sorted(ttfts, reverse=True)
    # $/1M tokens: halving utilisation doubles it
    assert fl[0].usd_per_m_tokens(0.5, 288) == pytest.approx(2 * fl[0].usd_per_m_tokens(1.0, 288))


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "duet", "plan", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_cli_one_layout(tmp_path: Path) -> None:
    pf.save(toy_profile(), tmp_path / "toy.json")
    r = _run(
        "--layout",
        "1P+1D",
        "--profile",
        str(tmp_path / "toy.json"),
        "--rate",
        "2",
        "--duration",
        "20",
        "--input-len",
        "300",
        "--output-len",
        "16",
        "--slo",
        "ttft_p90=500",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["layout"] == "1P+1D" and out["completed"] == out["requests"] > 20
    assert out["paths"] == {"disaggregated": out["completed"]} and out["meets_slo"] is True
    bad = _run("--layout", "2Q", "--profile", str(tmp_path / "toy.json"), "--rate", "1")
    assert bad.returncode == 2 and "cannot read --layout" in bad.stderr


def test_cli_plan_writes_answer_and_plots(tmp_path: Path) -> None:
    pf.save(toy_profile(), tmp_path / "toy.json")
    (tmp_path / "s.toml").write_text(
        'name = "small"\nusers_peak = 300\nthink_time_s = 30.0\ne2e_guess_s = 2.0\n'
        'input_len = "256"\noutput_len = "32"\nttft_p90_ms = 400.0\ne2e_p90_ms = 3000.0\n'
    )
    r = _run(
        "--scenario",
        str(tmp_path / "s.toml"),
        "--profile",
        str(tmp_path / "toy.json"),
        "--node-price",
        "1.5",
        "--quick",
        "--measure-s",
        "8",
        "--warmup-s",
        "3",
        "--jobs",
        "1",
        "--out",
        str(tmp_path / "plan"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cheapest fleet" in r.stdout and "Pareto front" in r.stdout and "answer" in r.stdout
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["cheapest"] and plan["comparisons"] and plan["pareto"]
    assert len(plan["comparisons"]) == 5  # one per commercial model in the price table
    for png in ("pareto.png", "cost_vs_utilisation.png", "timeline.png"):
        assert (tmp_path / "plan" / png).read_bytes()[:4] == b"\x89PNG"
