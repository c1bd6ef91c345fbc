"""A model's weighted set of versions (gateway/config_versions.py) and the split of its
requests (gateway/backends/cluster/versions.py): the config's checks, an exact split by
weight (a 5 % canary takes 1 request in 20, spread evenly), and each attempt pinned to its
version's served name (what the route asks the coordinator for)."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from typing import Any

import pytest

from gateway.backends.base import Attempt
from gateway.backends.cluster.versions import Versions, VersionSplit
from gateway.config import ConfigError, parse_config

CLUSTER = {"kind": "cluster", "tokenizer": "/models/tiny"}


def _model(versions: Any, **extra: Any) -> Any:
    cfg = parse_config({"models": {"tiny": {**CLUSTER, "versions": versions, **extra}}})
    return cfg.models["tiny"]


def test_versions_parse_and_split_exactly_by_weight() -> None:
    m = _model(
        {
            "v1": {"served_name": "tiny-v1", "weight": 95},
            "v2": {"served_name": "tiny-v2", "weight": 5},
        }
    )
    assert [(v.name, v.served_name, v.weight) for v in m.versions] == [
        ("v1", "tiny-v1", 95),
        ("v2", "tiny-v2", 5),
    ]
    split = VersionSplit([v.weight for v in m.versions])
    picks = [split.pick() for _ in range(200)]
    assert Counter(picks) == {0: 190, 1: 10}
    canary = [i for i, p in enumerate(picks) if p == 1]
    assert all(b - a == 20 for a, b in pairwise(canary)), "evenly spread"


def test_a_version_of_weight_zero_takes_nothing() -> None:
    m = _model({"v1": {"served_name": "a"}, "v2": {"served_name": "b", "weight": 0}})
    split = VersionSplit([v.weight for v in m.versions])
    assert {split.pick() for _ in range(50)} == {0}


def test_an_attempt_is_pinned_to_its_versions_served_name() -> None:
    m = _model({"v1": {"served_name": "tiny-v1"}, "v2": {"served_name": "tiny-v2"}})
    attempt = Attempt(request_id="r", model=m, prompt_ids=[1, 2], max_tokens=4, tier="interactive")
    versions = Versions()
    pinned = [versions.pin(attempt) for _ in range(4)]
    assert [(a.model.cluster_name, v) for a, v in pinned] == [
        ("tiny-v1", "v1"),
        ("tiny-v2", "v2"),
        ("tiny-v1", "v1"),
        ("tiny-v2", "v2"),
    ]
    assert all(a.model.name == "tiny" and not a.model.versions for a, _ in pinned)
    plain = parse_config({"models": {"tiny": CLUSTER}}).models["tiny"]
    same = Attempt(request_id="r", model=plain, prompt_ids=[1], max_tokens=4, tier="batch")
    assert versions.pin(same) == (same, None)


@pytest.mark.parametrize(
    ("versions", "extra", "says"),
    [
        ({}, {}, "must be a table of"),
        ({"v1": {"weight": 1}}, {}, "served_name"),
        ({"v1": {"served_name": "a", "weight": -1}}, {}, "weight must be a number >= 0"),
        ({"v1": {"served_name": "a", "weight": float("nan")}}, {}, "weight must be"),
        ({"v1": {"served_name": "a", "weight": 0}}, {}, "no version has a weight > 0"),
        ({"v1": {"served_name": "a"}, "v2": {"served_name": "a"}}, {}, "one served_name"),
        ({"v1": {"served_name": "a", "colour": 1}}, {}, "unknown keys: colour"),
        ({"v1": {"served_name": "a"}}, {"static": {"both": ["http://n:1"]}}, "without static"),
        ({"v1": {"served_name": "a"}}, {"served_name": "b"}, "or served_name"),
    ],
)
def test_refused_at_load(versions: Any, extra: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as e:
        _model(versions, **extra)
    assert says in str(e.value)


def test_an_adapter_over_a_versioned_base_is_refused() -> None:
    models = {
        "tiny": {**CLUSTER, "versions": {"v1": {"served_name": "a"}}},
        "tiny:sql": {},
    }
    with pytest.raises(ConfigError, match="has versions"):
        parse_config({"models": models})
