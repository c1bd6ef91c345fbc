"""LoRA adapters as models in gateway.toml (gateway/config_adapters.py): the two ways to name
one, what an adapter's table inherits from its base and what it may not change, and the ways a
model kept to some teams (`teams`) could be reached by another team, each refused at load."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import ConfigError, parse_config
from gateway.config_adapters import adapter_card, may_use

BASE = {
    "kind": "cluster",
    "tokenizer": "/models/tiny",
    "served_name": "tiny-llama",
    "input_usd_per_mtok": 1.0,
    "output_usd_per_mtok": 2.0,
    "fallback": ["big"],
    "static": {"both": ["http://n1:8100"]},
}
BIG = {"kind": "cluster", "tokenizer": "/models/big"}


def _cfg(models: dict[str, Any], **sections: Any) -> Any:
    return parse_config({"models": {"tiny": BASE, "big": BIG, **models}, **sections})


def test_a_base_adapter_name_inherits_the_base_and_keeps_its_own_prices() -> None:
    cfg = _cfg({"tiny:sql": {"adapter_path": "/loras/sql", "output_usd_per_mtok": 5.0}})
    m = cfg.models["tiny:sql"]
    assert (m.base, m.adapter, m.adapter_path) == ("tiny", "sql", "/loras/sql")
    # routed as the base (its served name, its nodes), counted with its tokenizer
    assert (m.cluster_name, m.tokenizer, m.static) == (
        "tiny-llama",
        "/models/tiny",
        cfg.models["tiny"].static,
    )
    assert (m.input_usd_per_mtok, m.output_usd_per_mtok) == (1.0, 5.0)
    assert m.fallback == () and m.teams is None  # not inherited
    assert adapter_card(m) == {"parent": "tiny", "root": "/loras/sql"}
    assert adapter_card(cfg.models["tiny"]) == {}


def test_a_configured_name_with_base_and_adapter_kept_to_teams() -> None:
    cfg = _cfg({"sql-bot": {"base": "tiny", "adapter": "sql", "teams": ["alice"]}})
    m = cfg.models["sql-bot"]
    assert (m.base, m.adapter, m.cluster_name, m.teams) == ("tiny", "sql", "tiny-llama", ("alice",))
    assert adapter_card(m) == {"parent": "tiny", "root": "sql"}
    assert may_use(m, "alice") and not may_use(m, "bob") and may_use(m, None)
    assert may_use(cfg.models["tiny"], "bob")


def test_two_names_of_one_adapter_one_of_them_with_its_path() -> None:
    cfg = _cfg({"tiny:a": {"adapter_path": "/p1"}, "a-bot": {"base": "tiny", "adapter": "a"}})
    assert (cfg.models["tiny:a"].adapter, cfg.models["a-bot"].adapter) == ("a", "a")


def test_a_colon_name_that_names_no_base_stays_a_model() -> None:
    cfg = _cfg({"llama3:8b": {"kind": "cluster", "tokenizer": "/models/l3"}})
    assert cfg.models["llama3:8b"].adapter is None


@pytest.mark.parametrize(
    ("models", "sections", "says"),
    [
        ({"x": {"base": "nope", "adapter": "a"}}, {}, "base must name another"),
        ({"x": {"adapter": "a"}}, {}, "an adapter needs `base`"),
        ({"tiny:a": {"tokenizer": "/other"}}, {}, "tokenizer belong to the base model"),
        ({"tiny:a": {"static": {"both": ["http://n2:1"]}}}, {}, "static belong to the base"),
        ({"tiny:a": {}, "tiny:a:b": {}}, {}, "is an adapter itself"),
        (
            {"g": {"kind": "external", "provider": "openai", "max_model_len": 10}, "g:a": {}},
            {},
            "must be a cluster model",
        ),
        ({"tiny:" + "a" * 300: {}}, {}, "1 to 256 characters"),
        ({"solo": {**BIG, "adapter_path": "/x"}}, {}, "are for adapters"),
        ({"tiny:a": {"teams": []}}, {}, "at least one team"),
        ({"tiny:tiny-llama": {}}, {}, "is the base model's name"),
        (
            {
                "tiny:a": {"adapter_path": "/p1"},
                "a-bot": {"base": "tiny", "adapter": "a", "adapter_path": "/p2"},
            },
            {},
            "two adapter_paths",
        ),
        ({"tiny:a": {"teams": ["alice"]}, "big": {**BIG, "fallback": ["tiny:a"]}}, {}, "fallback"),
        ({"tiny:a": {"teams": ["alice"]}}, {"auto": {"models": ["tiny:a"]}}, "[auto] models"),
        (
            {"tiny:a": {"teams": ["alice"]}},
            {"teams": {"bob": {"auto_pin": {"hard": "tiny:a"}}}},
            "auto_pin",
        ),
    ],
)
def test_refused_at_load(models: dict[str, Any], sections: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(models, **sections)
    assert says in str(e.value)
