"""A model's rollout from one version to another: the split moves up the policy's steps
(gateway/config_versions.py `RolloutPolicy`) and rolls back by itself when the new version
regresses.

The new version is judged over the policy's sliding window on this gateway's own attempt
outcomes (version_outcomes.py): once it has `min_requests` attempts there, an error rate past
`max_error_rate` — or a TTFT P90 past `max_ttft_p90_ratio` times the old version's, or an
inter-token latency P90 past `max_itl_p90_ratio` times the old version's — puts it
back to 0 % at once (`rolled_back`). A step lasts at least `step_interval_s` and ends only
with that much evidence in the window and no bar crossed, so a version nobody calls never
advances; the last step (100 %) is judged like the others before the rollout is `done`.

The rollout is run by `tick`, which the gateway calls as requests are routed (at most every
`TICK_S`) and when the admin API reads it: no task of its own. Its state is this gateway
process's: a restart serves the configured weights again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.backends.cluster.version_outcomes import VersionOutcomes, WindowStats
from gateway.config_versions import RolloutPolicy

#: the least seconds between two judgements made on the request path
TICK_S = 0.25


class Phase(StrEnum):
    IDLE = "idle"
    RUNNING = "running"
    PAUSED = "paused"
    DONE = "done"
    ROLLED_BACK = "rolled_back"


@dataclass(frozen=True)
class RolloutEvent:
    """One change of a rollout, for the timeline (`at`: unix seconds)."""

    at: float
    what: str
    weights: dict[str, float]


@dataclass
class Rollout:
    """The rollout of one model; `apply` sets the model's weights (versions.py)."""

    policy: RolloutPolicy
    outcomes: VersionOutcomes
    apply: Callable[[dict[str, float]], None]
    phase: Phase = Phase.IDLE
    old: str = ""
    new: str = ""
    steps: tuple[float, ...] = ()
    step: int = 0
    step_since: float = 0.0
    reason: str = ""
    events: list[RolloutEvent] = field(default_factory=list)
    _last_tick: float = 0.0

    def start(self, old: str, new: str, canary: float | None = None) -> None:
        """From `old` to `new`, at the canary's share first (default: the policy's first
        step), then the policy's steps above it."""
        steps = self.policy.steps
        if canary is not None:
            steps = (canary, *[s for s in steps if s > canary])
        self.old, self.new, self.steps, self.reason = old, new, steps, ""
        self.phase = Phase.RUNNING
        self._enter(0, f"started {old} -> {new}")

    def pause(self) -> None:
        if self.phase == Phase.RUNNING:
            self.phase = Phase.PAUSED
            self._event("paused")

    def resume(self) -> None:
        if self.phase == Phase.PAUSED:
            self.phase = Phase.RUNNING
            self.step_since = time.monotonic()
            self._event("resumed")

    def rollback(self, reason: str) -> None:
        """Every request back on the old version, now."""
        self.phase, self.reason = Phase.ROLLED_BACK, reason
        self._set({self.old: 100.0, self.new: 0.0}, f"rolled back: {reason}")

    def held(self, why: str) -> None:
        """Weights were set by hand: a running rollout pauses (it must not undo them)."""
        if self.phase == Phase.RUNNING:
            self.phase = Phase.PAUSED
            self._event(f"paused: {why}")

    def tick(self, now: float | None = None, force: bool = False) -> None:
        """Judge the new version; roll back, step up or finish."""
        now = time.monotonic() if now is None else now
        if self.phase != Phase.RUNNING or (not force and now - self._last_tick < TICK_S):
            return
        self._last_tick = now
        p = self.policy
        new = self.outcomes.stats(self.new, p.window_s, now)
        if new.attempts < p.min_requests:
            return  # not enough evidence to judge, nor to step up
        if (bad := self._regression(new, now)) is not None:
            self.rollback(bad)
            return
        if now - self.step_since < p.step_interval_s:
            return
        if self.step + 1 < len(self.steps):
            self._enter(self.step + 1, "stepped up", now)
        else:
            self.phase = Phase.DONE
            self._event(f"done: {self.new} serves every request")

    def _regression(self, new: WindowStats, now: float) -> str | None:
        p = self.policy
        if new.error_rate > p.max_error_rate:
            return (
                f"{self.new} failed {new.failed} of {new.attempts} attempts in {p.window_s:g} s "
                f"({new.error_rate:.1%} > {p.max_error_rate:.1%})"
            )
        old = self.outcomes.stats(self.old, p.window_s, now)
        for what, bar, n, o in (
            ("TTFT", p.max_ttft_p90_ratio, new.ttft_p90_s, old.ttft_p90_s),
            ("ITL", p.max_itl_p90_ratio, new.itl_p90_s, old.itl_p90_s),
        ):
            if bar is not None and n is not None and o and n > bar * o:
                return (
                    f"{self.new} {what} P90 {n * 1e3:.0f} ms > {bar:g} x "
                    f"{self.old}'s {o * 1e3:.0f} ms"
                )
        return None

    def _enter(self, step: int, what: str, now: float | None = None) -> None:
        self.step, self.step_since = step, time.monotonic() if now is None else now
        share = self.steps[step]
        self._set({self.old: 100.0 - share, self.new: share}, f"{what}: {self.new} at {share:g} %")

    def _set(self, weights: dict[str, float], what: str) -> None:
        self.apply(weights)
        self._event(what, weights)

    def _event(self, what: str, weights: dict[str, float] | None = None) -> None:
        self.events.append(RolloutEvent(at=time.time(), what=what, weights=weights or {}))
        del self.events[:-100]  # the newest hundred: an operator's view, bounded
