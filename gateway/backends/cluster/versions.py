"""Which version of a model answers a request (gateway/config_versions.py): the model's
requests split by the versions' weights, and the attempt pinned to the chosen one.

The split is a smooth weighted round robin (nginx's): deterministic, and exact over each cycle
of sum(weights) requests (weights 95/5: the canary takes 1 request of every 20, spread evenly,
never a burst), per gateway. The pinned attempt's model is the version's: its served name is
what the route asks the coordinator for, so the prefill and the decode node both serve that
version, and every leg of the request — a migrated stream's included, which keeps its attempt —
stays on it. A retry or a fallback is a new attempt, split anew.

The weights start as configured and change at run time (`VersionSet.set_weights`: the admin
API, a rollout's steps, rollout.py): the next request is split by the new weights, a request
in flight keeps its version. Runtime weights are this gateway process's own: a restart serves
the configured ones again (docs/models.md says how to make a change last).
"""

from __future__ import annotations

import math
from dataclasses import replace

from gateway.backends.base import Attempt
from gateway.backends.cluster.rollout import Rollout
from gateway.backends.cluster.version_outcomes import VersionOutcomes
from gateway.config import ModelConfig
from gateway.config_versions import ModelVersion, RolloutPolicy


class VersionSplit:
    """The smooth weighted round robin over one model's versions, by `weights` (in the
    versions' order)."""

    def __init__(self, weights: list[float]) -> None:
        self.weights = weights
        self._total = float(sum(weights))
        self._current = [0.0] * len(weights)

    def pick(self) -> int:
        """The next request's version (an index into the model's versions)."""
        cur = self._current
        for i, w in enumerate(self.weights):
            cur[i] += w
        best = max(range(len(cur)), key=cur.__getitem__)
        cur[best] -= self._total
        return best


class VersionSet:
    """One versioned model's runtime state: its weights, its split, its attempts' outcomes per
    version, its rollout."""

    def __init__(self, model: ModelConfig) -> None:
        self.config = model
        self.versions: tuple[ModelVersion, ...] = model.versions
        #: each version's model: the base's table with the version's served name
        self.models = [
            replace(model, served_name=v.served_name, versions=()) for v in model.versions
        ]
        self.weights = {v.name: float(v.weight) for v in model.versions}
        self.outcomes = VersionOutcomes()
        self.rollout = Rollout(model.rollout or RolloutPolicy(), self.outcomes, self._apply)
        self._split = VersionSplit(list(self.weights.values()))

    def index(self, name: str) -> int:
        for i, v in enumerate(self.versions):
            if v.name == name:
                return i
        known = ", ".join(v.name for v in self.versions)
        raise KeyError(f"model {self.config.name!r} has no version {name!r} (it has {known})")

    def set_weights(self, weights: dict[str, float]) -> None:
        """Set some versions' weights by hand (the others keep theirs); a running rollout
        pauses. ValueError: an unknown version, a weight not a finite number >= 0, or no
        version left with a weight > 0."""
        self._apply(weights)
        self.rollout.held("weights set by hand")

    def start_rollout(self, new: str, canary: float | None = None) -> None:
        """Move the requests to `new` from the version that serves the most of them now."""
        self.index(new)
        if new == max(self.weights, key=self.weights.__getitem__):
            raise ValueError(f"{new!r} already serves most of {self.config.name!r}'s requests")
        old = max((n for n in self.weights if n != new), key=self.weights.__getitem__)
        self._apply({n: 0.0 for n in self.weights if n not in (old, new)})
        self.rollout.start(old, new, canary)

    def pick(self) -> int:
        self.rollout.tick()
        return self._split.pick()

    def fallback(self, tried: set[int]) -> int | None:
        """The version to try a failed attempt on: the untried version serving the most (None:
        no other version serves)."""
        others = [i for i, v in enumerate(self.versions) if i not in tried and self.weights[v.name]]
        return max(others, key=lambda i: self.weights[self.versions[i].name], default=None)

    def _apply(self, weights: dict[str, float]) -> None:
        new = dict(self.weights)
        for name, w in weights.items():
            self.index(name)  # KeyError names the versions
            if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
                raise ValueError(f"version {name!r}: weight must be a number >= 0, got {w!r}")
            if w < 0:
                raise ValueError(f"version {name!r}: weight must be a number >= 0, got {w!r}")
            new[name] = float(w)
        if not any(w > 0 for w in new.values()):
            raise ValueError("at least one version needs a weight > 0")
        self.weights = new
        self._split = VersionSplit(list(new.values()))


class Versions:
    """The version sets of every versioned model, made on first use."""

    def __init__(self) -> None:
        self._sets: dict[str, VersionSet] = {}

    def of(self, model: ModelConfig) -> VersionSet:
        vs = self._sets.get(model.name)
        if vs is None or vs.versions is not model.versions:
            vs = self._sets[model.name] = VersionSet(model)
        return vs

    def pin(self, attempt: Attempt) -> tuple[Attempt, str | None]:
        """`attempt` on one version of its model, and the version's name (None: the model has
        no versions, the attempt is as it was)."""
        if not attempt.model.versions:
            return attempt, None
        vs = self.of(attempt.model)
        i = vs.pick()
        return replace(attempt, model=vs.models[i]), vs.versions[i].name
