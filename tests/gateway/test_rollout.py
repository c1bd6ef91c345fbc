"""A rollout's policy (gateway/config_versions.py) and its steps (backends/cluster/rollout.py),
on a clock the test moves: runtime weights split the very next requests, a rollout steps up
only after its interval and with its evidence, rolls back by itself on the error bar and on
the TTFT and ITL bars, and a hand's setting pauses it."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from gateway.backends.cluster.rollout import Phase
from gateway.backends.cluster.versions import VersionSet
from gateway.config import ConfigError, parse_config

VERSIONS = {"v1": {"served_name": "a", "weight": 100}, "v2": {"served_name": "b", "weight": 0}}
POLICY = {"steps": [10, 50, 100], "step_interval_s": 5, "window_s": 10, "min_requests": 4}


def _set(**rollout: Any) -> VersionSet:
    m = {"kind": "cluster", "tokenizer": "/m", "versions": VERSIONS, "rollout": rollout}
    return VersionSet(parse_config({"models": {"tiny": m}}).models["tiny"])


def _feed(vs: VersionSet, version: str, n: int, now: float, ok: bool = True, ttft: float = 0.1):
    for _ in range(n):
        vs.outcomes.record(version, ok, ttft, now=now)


def test_runtime_weights_split_the_next_requests_and_refuse_nonsense() -> None:
    vs = _set(**POLICY)
    assert {vs.pick() for _ in range(20)} == {0}
    vs.set_weights({"v1": 3, "v2": 1})
    assert Counter(vs.pick() for _ in range(40)) == {0: 30, 1: 10}
    for bad, says in [
        ({"v3": 1}, "no version 'v3'"),
        ({"v1": -1}, ">= 0"),
        ({"v1": float("inf")}, ">= 0"),
        ({"v1": 0, "v2": 0}, "weight > 0"),
    ]:
        with pytest.raises((KeyError, ValueError), match=says):
            vs.set_weights(bad)
    assert vs.weights == {"v1": 3, "v2": 1}  # a refused setting changes nothing


def test_steps_need_their_interval_and_evidence_then_finish() -> None:
    vs = _set(**POLICY)
    vs.start_rollout("v2")
    r, t0 = vs.rollout, vs.rollout.step_since
    assert vs.weights == {"v1": 90, "v2": 10}
    r.tick(t0 + 6, force=True)  # the interval passed, but no evidence
    assert vs.weights["v2"] == 10
    _feed(vs, "v2", 4, t0 + 6)
    r.tick(t0 + 6, force=True)
    assert vs.weights == {"v1": 50, "v2": 50}
    r.tick(t0 + 7, force=True)  # the next step's interval runs from its own start
    assert vs.weights["v2"] == 50
    r.step_since = t0  # the clock: the step began long enough ago
    r.tick(t0 + 7, force=True)
    assert vs.weights == {"v1": 0, "v2": 100} and r.phase == Phase.RUNNING
    r.tick(t0 + 8, force=True)  # the last step is judged like the others
    assert r.phase == Phase.RUNNING
    r.tick(t0 + 12, force=True)
    assert r.phase == Phase.DONE


def test_the_error_bar_rolls_back_at_once() -> None:
    vs = _set(**POLICY, max_error_rate=0.1)
    vs.start_rollout("v2", canary=5)
    r = vs.rollout
    assert r.steps == (5, 10, 50, 100)
    now = r.step_since
    _feed(vs, "v2", 3, now)
    _feed(vs, "v2", 1, now, ok=False)
    r.tick(now, force=True)
    assert r.phase == Phase.ROLLED_BACK and vs.weights == {"v1": 100, "v2": 0}
    assert "failed 1 of 4" in r.reason
    assert {vs.pick() for _ in range(20)} == {0}


def test_old_failures_leave_the_window() -> None:
    vs = _set(**POLICY, max_error_rate=0.1)
    vs.start_rollout("v2")
    r = vs.rollout
    now = r.step_since
    _feed(vs, "v2", 2, now - 11, ok=False)  # before the window
    _feed(vs, "v2", 4, now)
    r.tick(now, force=True)
    assert r.phase == Phase.RUNNING


def test_the_ttft_bar_compares_with_the_old_version() -> None:
    vs = _set(**POLICY, max_ttft_p90_ratio=1.5)
    vs.start_rollout("v2")
    r = vs.rollout
    now = r.step_since
    _feed(vs, "v1", 20, now, ttft=0.1)
    _feed(vs, "v2", 4, now, ttft=0.14)
    r.tick(now, force=True)
    assert r.phase == Phase.RUNNING
    _feed(vs, "v2", 4, now, ttft=0.2)
    r.tick(now, force=True)
    assert r.phase == Phase.ROLLED_BACK and "TTFT P90" in r.reason


def test_the_itl_bar_compares_with_the_old_version() -> None:
    vs = _set(**POLICY, max_itl_p90_ratio=1.5)
    vs.start_rollout("v2")
    r = vs.rollout
    now = r.step_since
    for _ in range(20):
        vs.outcomes.record_itl("v1", 0.010, now=now)
    _feed(vs, "v2", 4, now)
    for _ in range(4):
        vs.outcomes.record_itl("v2", 0.014, now=now)
    r.tick(now, force=True)
    assert r.phase == Phase.RUNNING  # 14 ms against 1.5 x 10 ms: within the bar
    for _ in range(4):
        vs.outcomes.record_itl("v2", 0.030, now=now)
    r.tick(now, force=True)
    assert r.phase == Phase.ROLLED_BACK and "ITL P90 30 ms" in r.reason, r.reason
    assert vs.outcomes.stats("v2", 10, now + 11).itl_p90_s is None  # out of the window


def test_a_hand_setting_pauses_a_rollout_and_resume_goes_on() -> None:
    vs = _set(**POLICY)
    vs.start_rollout("v2")
    vs.set_weights({"v2": 30})
    assert vs.rollout.phase == Phase.PAUSED
    vs.rollout.resume()
    assert vs.rollout.phase == Phase.RUNNING


def test_a_version_already_serving_most_is_not_started() -> None:
    with pytest.raises(ValueError, match="already serves most"):
        _set(**POLICY).start_rollout("v1")


@pytest.mark.parametrize(
    ("rollout", "says"),
    [
        ({"steps": [50, 20, 100]}, "steps must rise"),
        ({"steps": [5, 50]}, "end at 100"),
        ({"window_s": 0}, "window_s must be a positive"),
        ({"max_error_rate": 1.5}, "max_error_rate"),
        ({"max_ttft_p90_ratio": 0.5}, "max_ttft_p90_ratio"),
        ({"max_itl_p90_ratio": True}, "max_itl_p90_ratio"),
        ({"min_requests": 0}, "min_requests"),
        ({"colour": 1}, "unknown keys: colour"),
    ],
)
def test_a_bad_policy_is_refused_at_load(rollout: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        _set(**rollout)


def test_a_rollout_needs_versions() -> None:
    m = {"kind": "cluster", "tokenizer": "/m", "rollout": POLICY}
    with pytest.raises(ConfigError, match="needs"):
        parse_config({"models": {"tiny": m}})
