"""Which version of a model answers a request (gateway/config_versions.py): the model's
requests split by the versions' weights, and the attempt pinned to the chosen one.

The split is a smooth weighted round robin (nginx's): deterministic, and exact over each cycle
of sum(weights) requests (weights 95/5: the canary takes 1 request of every 20, spread evenly,
never a burst), per gateway. The pinned attempt's model is the version's: its served name is
what the route asks the coordinator for, so the prefill and the decode node both serve that
version, and every leg of the request — a migrated stream's included, which keeps its attempt —
stays on it. A retry or a fallback is a new attempt, split anew.
"""

from __future__ import annotations

from dataclasses import replace

from gateway.backends.base import Attempt
from gateway.config import ModelConfig
from gateway.config_versions import ModelVersion


class VersionSplit:
    """The smooth weighted round robin over one model's versions."""

    def __init__(self, model: ModelConfig) -> None:
        self.versions: tuple[ModelVersion, ...] = model.versions
        #: each version's model: the base's table with the version's served name
        self.models = [
            replace(model, served_name=v.served_name, versions=()) for v in model.versions
        ]
        self._total = float(sum(v.weight for v in model.versions))
        self._current = [0.0] * len(model.versions)

    def pick(self) -> int:
        """The next request's version (an index into `versions`)."""
        cur = self._current
        for i, v in enumerate(self.versions):
            cur[i] += v.weight
        best = max(range(len(cur)), key=cur.__getitem__)
        cur[best] -= self._total
        return best


class Versions:
    """The version splits of every versioned model, made on first use."""

    def __init__(self) -> None:
        self._splits: dict[str, VersionSplit] = {}

    def pin(self, attempt: Attempt) -> tuple[Attempt, str | None]:
        """`attempt` on one version of its model, and the version's name (None: the model has
        no versions, the attempt is as it was)."""
        model = attempt.model
        if not model.versions:
            return attempt, None
        split = self._splits.get(model.name)
        if split is None or split.versions is not model.versions:
            split = self._splits[model.name] = VersionSplit(model)
        i = split.pick()
        return replace(attempt, model=split.models[i]), split.versions[i].name
