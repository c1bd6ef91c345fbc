"""The gateway's version and rollout admin API (gateway/api/rollout.py), typed for both sides:
the gateway writes it, `duet rollout` and the rollout bench read it.

- `GET /admin/models/{model}/versions` → `VersionsView`;
- `PUT /admin/models/{model}/versions` `SetWeights` → `VersionsView` (a running rollout pauses);
- `POST /admin/models/{model}/rollout` `RolloutAction` → `VersionsView`.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec


class Action(StrEnum):
    START = "start"
    PAUSE = "pause"
    RESUME = "resume"
    ROLLBACK = "rollback"


class SetWeights(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    #: version name → weight (the versions not named keep theirs)
    weights: dict[str, float]


class RolloutAction(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    action: Action
    #: start: the version to move the requests to
    to: str | None = None
    #: start: its first share, percent (default: the policy's first step)
    canary: float | None = None


class VersionStatus(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    served_name: str
    weight: float
    #: this gateway's attempts on it in the rollout's window, and how many failed
    attempts: int
    failed: int
    ttft_p90_s: float | None
    #: the inter-token latency P90 of its whole answers in the window (None: none ended)
    itl_p90_s: float | None = None
    #: every attempt on it since this gateway started, and how many failed
    total_attempts: int
    total_failed: int


class EventView(msgspec.Struct, frozen=True, kw_only=True):
    #: unix seconds
    at: float
    what: str
    weights: dict[str, float]


class PolicyView(msgspec.Struct, frozen=True, kw_only=True):
    steps: list[float]
    step_interval_s: float
    window_s: float
    max_error_rate: float
    max_ttft_p90_ratio: float | None
    max_itl_p90_ratio: float | None = None
    min_requests: int


class RolloutView(msgspec.Struct, frozen=True, kw_only=True):
    #: idle, running, paused, done, rolled_back
    phase: str
    old: str
    new: str
    steps: list[float]
    #: the new version's share now, percent
    share: float
    reason: str
    policy: PolicyView
    events: list[EventView]


class VersionsView(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    versions: list[VersionStatus]
    rollout: RolloutView
