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
