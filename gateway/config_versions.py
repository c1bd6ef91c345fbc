"""A model's versions in gateway.toml: one model name over a weighted set of versions.

    [models.llama]
    kind = "cluster"
    tokenizer = "/models/llama-v1"      # every version shares the model's tokenizer
    [models.llama.versions.v1]
    served_name = "llama-v1"            # the model name the version's nodes register
    weight = 95
    [models.llama.versions.v2]
    served_name = "llama-v2"
    weight = 5                          # a canary: 1 request in 20

Each request is routed to one version (gateway/backends/cluster/versions.py splits the requests
by weight), with that version's served name: the coordinator picks its prefill and decode
nodes among that version's nodes only, so both legs of a request belong to one version, and
a stream that migrates stays on it. The usage record names the version.

A model with versions may carry a rollout policy (gateway/backends/cluster/rollout.py runs it):

    [models.llama.rollout]
    steps = [5, 25, 50, 100]            # the new version's share, percent, step by step
    step_interval_s = 60                # each step's least duration before the next
    window_s = 30                       # the sliding window the outcomes are judged over
    max_error_rate = 0.05               # the new version's failed attempts / attempts past it
    max_ttft_p90_ratio = 1.5            # optional: its TTFT P90 past 1.5x the old version's
    max_itl_p90_ratio = 1.5             # optional: its inter-token latency P90, likewise
    min_requests = 10                   # attempts in the window before it is judged at all

Invariants: a version set has at least one version of weight > 0, weights are finite numbers
>= 0 (0: declared, taking no requests), served names are distinct; only a cluster model without
static node lists has versions (its versions' nodes are found through the coordinator or
etcd), and no adapter's base has versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from runtime.tables import from_table


class VersionError(ValueError):
    """A `[models.X.versions.*]` table is malformed (config_checks reports it as ConfigError)."""


@dataclass(frozen=True)
class ModelVersion:
    """One version of a model: its name, the model name its nodes register, its share."""

    name: str
    served_name: str
    weight: float = 1.0


@dataclass(frozen=True)
class RolloutPolicy:
    """How a rollout moves a model's requests from one version to another (module docstring)."""

    steps: tuple[float, ...] = (5.0, 25.0, 50.0, 100.0)
    step_interval_s: float = 60.0
    window_s: float = 30.0
    max_error_rate: float = 0.05
    max_ttft_p90_ratio: float | None = None
    max_itl_p90_ratio: float | None = None
    min_requests: int = 10


def parse_rollout(model: str, data: Any) -> RolloutPolicy:
    """`[models.<model>.rollout]`: steps rising to 100, positive durations, bars in range."""
    where = f"[models.{model}.rollout]"
    p = from_table(RolloutPolicy, data, where, VersionError)
    steps = p.steps
    if (
        not isinstance(steps, tuple)
        or not steps
        or any(isinstance(s, bool) or not isinstance(s, int | float) for s in steps)
        or any(not 0 < s <= 100 for s in steps)
        or list(steps) != sorted(set(steps))
        or steps[-1] != 100
    ):
        raise VersionError(f"{where} steps must rise within (0, 100] and end at 100, got {steps!r}")
    for key in ("step_interval_s", "window_s"):
        v = getattr(p, key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
            raise VersionError(f"{where} {key} must be a positive number of seconds, got {v!r}")
    if not isinstance(p.max_error_rate, int | float) or not 0 <= p.max_error_rate < 1:
        raise VersionError(f"{where} max_error_rate must be in [0, 1), got {p.max_error_rate!r}")
    ratios = {k: getattr(p, k) for k in ("max_ttft_p90_ratio", "max_itl_p90_ratio")}
    for key, r in ratios.items():
        if r is not None and (
            isinstance(r, bool) or not isinstance(r, int | float) or not 1 <= r < math.inf
        ):
            raise VersionError(f"{where} {key} must be a number >= 1, got {r!r}")
    if (
        isinstance(p.min_requests, bool)
        or not isinstance(p.min_requests, int)
        or p.min_requests < 1
    ):
        raise VersionError(f"{where} min_requests must be an integer >= 1")
    return RolloutPolicy(
        steps=tuple(float(s) for s in steps),
        step_interval_s=float(p.step_interval_s),
        window_s=float(p.window_s),
        max_error_rate=float(p.max_error_rate),
        max_ttft_p90_ratio=_ratio(ratios["max_ttft_p90_ratio"]),
        max_itl_p90_ratio=_ratio(ratios["max_itl_p90_ratio"]),
        min_requests=p.min_requests,
    )


def _ratio(r: float | None) -> float | None:
    return None if r is None else float(r)


def parse_versions(model: str, data: Any) -> tuple[ModelVersion, ...]:
    """`[models.<model>.versions]`: a table of version name → {served_name, weight}."""
    where = f"[models.{model}.versions]"
    if not isinstance(data, dict) or not data:
        raise VersionError(f"{where} must be a table of [models.{model}.versions.<name>] tables")
    out = []
    for name, table in data.items():
        v = from_table(
            ModelVersion,
            {**table, "name": name} if isinstance(table, dict) else table,
            f"[models.{model}.versions.{name}]",
            VersionError,
        )
        if not isinstance(v.served_name, str) or not v.served_name:
            raise VersionError(f"[models.{model}.versions.{name}] needs served_name")
        w = v.weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
            raise VersionError(
                f"[models.{model}.versions.{name}] weight must be a number >= 0, got {w!r}"
            )
        out.append(v)
    if len({v.served_name for v in out}) != len(out):
        raise VersionError(f"{where} two versions name one served_name")
    if not any(v.weight > 0 for v in out):
        raise VersionError(f"{where} no version has a weight > 0")
    return tuple(out)
