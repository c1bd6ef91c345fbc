"""planner.toml: the defaults, the most specific bounds, and clear errors (unknown keys refused)."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.config import PlannerMode, load_config
from planner.pools import PoolKey


def test_file_flags_and_bounds(tmp_path: Path) -> None:
    f = tmp_path / "planner.toml"
    f.write_text(
        '[planner]\nmode = "load"\ncooldown_s = 10\n[planner.bounds]\nprefill = [1, 2]\n'
        '"decode/batch" = [0, 1]\n"decode/m/interactive" = [2, 5]\n[planner.slo.batch]\nttft_s = '
        "20\nitl_s = 2\n"
    )
    cfg = load_config(f, mode="throughput", node_budget=7)
    assert (cfg.mode, cfg.cooldown_s, cfg.node_budget) == (PlannerMode.THROUGHPUT, 10, 7)
    assert cfg.bounds_of(PoolKey("prefill", "m", "shared")) == (1, 2)
    assert cfg.bounds_of(PoolKey("decode", "m", "batch")) == (0, 1)
    assert cfg.bounds_of(PoolKey("decode", "m", "interactive")) == (2, 5)
    assert cfg.bounds_of(PoolKey("decode", "other", "interactive")) == (
        cfg.default_min,
        cfg.default_max,
    )
    assert cfg.slo_of(PoolKey("decode", "m", "batch")).ttft_s == 20
    assert cfg.slo_of(PoolKey("decode", "m", "interactive")).ttft_s == 1.0  # the default


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[planner]\nmodee = 'load'\n", "unknown field `modee`"),
        ("[planner]\ninterval_s = 0\n", "interval_s and window_s must be > 0"),
        ("[planner]\n[planner.bounds]\nprefill = [3, 1]\n", "need 0 ≤ min ≤ max"),
        ("[planner]\nkv_high = 1.5\n", "kv_high must be in (0, 1]"),
        ("[planner]\nmode = 'guess'\n", "Invalid enum value 'guess'"),
        ("[planner\n", "planner.toml"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "planner.toml"
    f.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config(f)
    assert message in str(e.value)


def test_missing_file() -> None:
    with pytest.raises(ValueError, match="no planner config file"):
        load_config("/nonexistent/planner.toml")


def test_a_planner_without_a_profile_warns_that_it_predicts_with_cpu_step_costs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Load mode's TTFT/ITL predictions come from the step cost; the default one is SmolLM2 on one
    CPU thread. A GPU deployment that gives no profile must be told at start."""
    import argparse
    import logging

    from planner.cli import add_args, from_args
    from runtime.plane import PlaneSecurity

    p = argparse.ArgumentParser()
    add_args(p)
    profile = Path(__file__).parents[2] / "data" / "profiles" / "llama-3-70b-fp8-h200-tp2.json"
    with caplog.at_level(logging.WARNING, logger="duet.planner"):
        assert from_args(p.parse_args(["--planner", "load"]), PlaneSecurity()) is not None
    assert any("no node profile" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="duet.planner"):
        from_args(
            p.parse_args(["--planner", "load", "--planner-set", f"profile={profile}"]),
            PlaneSecurity(),
        )
    assert not any("no node profile" in r.getMessage() for r in caplog.records), caplog.text


def test_planner_set_overrides_the_file_key_by_key(tmp_path: Path) -> None:
    """`--planner-set KEY=VALUE`: TOML values, text taken as it is (a numeric-looking name stays
    text), one dot into a table; `--planner MODE` over both."""
    f = tmp_path / "planner.toml"
    f.write_text('node_budget = 4\nactuator = "virtual"\n[bounds]\nprefill = [1, 2]\n')
    sets = [
        "node_budget=9",
        "actuator=kubernetes",
        "decision_file=123",
        "k8s_deployments.decode/batch=42",
        "bounds.decode=[0, 3]",
        "slo.batch={ttft_s = 20, itl_s = 2}",
        "drain_deadline_s=7.5",
    ]
    cfg = load_config(f, sets, mode="throughput")
    assert (cfg.node_budget, cfg.actuator, cfg.decision_file) == (9, "kubernetes", "123")
    assert cfg.k8s_deployments == {"decode/batch": "42"} and cfg.drain_deadline_s == 7.5
    assert cfg.bounds == {"prefill": (1, 2), "decode": (0, 3)}
    assert cfg.slo_of(PoolKey("decode", "m", "batch")).ttft_s == 20
    assert cfg.mode == PlannerMode.THROUGHPUT


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("node_budget", "expected KEY=VALUE"),
        ("budget=3", "planner.toml has no key 'budget'"),
        ("node_budget.x=3", "node_budget is not a table"),
        ("node_budget=lots", "planner config"),
        ("actuator=ssh", "planner config"),
    ],
)
def test_a_bad_planner_set_is_a_clear_error(item: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, [item])


def test_the_planner_runs_when_configured_or_asked(tmp_path: Path) -> None:
    import argparse

    from planner.cli import add_args, from_args
    from runtime.plane import PlaneSecurity

    p = argparse.ArgumentParser()
    add_args(p)
    f = tmp_path / "planner.toml"
    f.write_text('mode = "load"\n')
    on = PlaneSecurity()
    assert from_args(p.parse_args([]), on) is None
    assert from_args(p.parse_args(["--planner-config", str(f)]), on) is not None
    assert from_args(p.parse_args(["--planner-set", "node_budget=2"]), on) is not None
    assert from_args(p.parse_args(["--planner-config", str(f), "--planner", "off"]), on) is None
    with pytest.raises(ValueError, match="local_control"):
        from_args(p.parse_args(["--planner-set", "actuator=local"]), on)
