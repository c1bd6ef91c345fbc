"""LoRA adapters served as models, and the models a team may see (gateway.toml).

An adapter is a `[models.*]` table over a base model of `kind = "cluster"`, named either way:

    [models."smollm2:sql"]            # `base:adapter`: the base model's table, then the adapter
    adapter_path = "/srv/loras/sql"   # its PEFT directory on the nodes (optional, see below)
    output_usd_per_mtok = 0.40        # its own prices; a price it leaves out is the base's

    [models.sql-bot]                  # a name of its own
    base = "smollm2"
    adapter = "sql"                   # the adapter's name on the nodes (vLLM's lora_name)
    teams = ["analytics"]             # only these teams may use and see it (default: every team)

The table inherits its base's (tokenizer, context, nodes, features, tool parser, prices, tiers)
but not its `fallback` or `teams`, and may not change what belongs to the base's weights
(`kind`, `tokenizer`, `served_name`, `static`, `block_size`, `max_model_len`). A request for it
routes with the base's served name and the adapter as `lora_name` (and `adapter_path` as
`lora_path`: the coordinator loads the adapter on the node it picks; without a path it loads it
from where a node holding it got it), and both legs name the adapter as their `model`, as vLLM
does; its prefix-cache blocks are rooted at the adapter (protocol/block_hash.py).

Only configured adapters are served: an adapter resident on the nodes that no table names is an
unknown model (404), so one team's fine-tune is never reachable by another because it is loaded.

`teams` (on any model): a team outside the list gets the 404 of an unknown model and does not
see the model in `/v1/models` or in the 404's list of served models, so it learns nothing of a
fine-tune it may not use. Such a model may not be in a fallback chain, in `[auto] models` or in
an `auto_pin`, which would reach it by another way (refused here at load).
"""

from __future__ import annotations

from typing import Any

from gateway.config_tables import ConfigError, GatewayConfig, ModelConfig
from protocol.sampling import MAX_CACHE_SALT

#: keys of a base model's table an adapter's table does not take over
NOT_INHERITED = ("fallback", "teams", "served_name", "versions")
#: keys that belong to the base's weights: an adapter's table may not set them
BASE_ONLY = ("kind", "tokenizer", "served_name", "static", "block_size", "max_model_len")


def _base_of(name: str, table: dict[str, Any], tables: dict[str, Any]) -> tuple[str, Any] | None:
    """(base, the adapter's name as written: checked by the caller) of an adapter's table; None
    for any other model. A name `X:Y` is an adapter when `X` names another table (the longest
    such X): a model named with a colon that names no base stays an ordinary model."""
    if "base" in table:
        base = table["base"]
        if not isinstance(base, str) or base not in tables:
            raise ConfigError(f"[models.{name}] base must name another [models.*] table")
        adapter = table.get("adapter")
        if adapter is None and name.startswith(base + ":"):
            adapter = name[len(base) + 1 :]
        return base, adapter
    if "adapter" in table:
        raise ConfigError(f"[models.{name}] an adapter needs `base` (or a name `base:adapter`)")
    cuts = [i for i, c in enumerate(name) if c == ":" and name[:i] in tables]
    return (name[: cuts[-1]], name[cuts[-1] + 1 :]) if cuts else None


def with_adapters(tables: dict[str, Any]) -> dict[str, Any]:
    """The `[models.*]` tables with each adapter's completed from its base's (raw tables, for
    `config_checks.model` to check as any other)."""
    out = dict(tables)
    for name, table in tables.items():
        if not isinstance(table, dict):
            continue  # model() says it must be a table
        found = _base_of(name, table, tables)
        if found is None:
            continue
        base, adapter = found
        parent = tables[base]
        if not isinstance(parent, dict) or parent.get("kind", "cluster") != "cluster":
            raise ConfigError(f"[models.{name}] base {base!r} must be a cluster model")
        if "base" in parent or _base_of(base, parent, tables) is not None:
            raise ConfigError(f"[models.{name}] base {base!r} is an adapter itself")
        if "versions" in parent:  # an adapter is trained on one version's weights
            raise ConfigError(f"[models.{name}] base {base!r} has versions")
        if not isinstance(adapter, str) or not 0 < len(adapter) <= MAX_CACHE_SALT:
            raise ConfigError(
                f"[models.{name}] adapter must be the adapter's name on the nodes "
                f"(1 to {MAX_CACHE_SALT} characters)"
            )
        own = sorted(k for k in BASE_ONLY if k in table)
        if own:
            raise ConfigError(
                f"[models.{name}] {', '.join(own)} belong to the base model {base!r}: an "
                "adapter inherits them"
            )
        inherited = {k: v for k, v in parent.items() if k not in NOT_INHERITED}
        served = parent.get("served_name") or base
        out[name] = {**inherited, **table, "base": base, "adapter": adapter}
        out[name]["served_name"] = served
    return out


def check_adapters(cfg: GatewayConfig) -> None:
    """No team reaches a model kept from it by a way other than its name, and `teams` and an
    adapter's keys are well formed."""
    for m in cfg.models.values():
        if m.adapter is None and (m.base is not None or m.adapter_path is not None):
            raise ConfigError(f"[models.{m.name}] base and adapter_path are for adapters")
        if m.adapter_path is not None and (
            not isinstance(m.adapter_path, str) or not m.adapter_path
        ):
            raise ConfigError(f"[models.{m.name}] adapter_path must be a directory on the nodes")
        if m.teams is not None and (
            not m.teams or not all(isinstance(t, str) and t for t in m.teams)
        ):
            raise ConfigError(f"[models.{m.name}] teams must list at least one team id")
    _check_paths(cfg)
    kept = {n for n, m in cfg.models.items() if m.teams is not None}
    ways = [(f"models.{m.name}", "fallback", m.fallback) for m in cfg.models.values()]
    if cfg.auto is not None:
        ways.append(("auto", "models", cfg.auto.models))
    ways += [(f"teams.{t}", "auto_pin", tuple(p.auto_pin.values())) for t, p in cfg.teams.items()]
    for section, key, names in ways:
        bad = sorted(kept & set(names))
        if bad:
            raise ConfigError(
                f"[{section}] {key} names {', '.join(bad)}, kept to some teams (`teams`): "
                "another team would reach it this way"
            )


def _check_paths(cfg: GatewayConfig) -> None:
    """An adapter's name names one set of weights on the nodes (they refuse other weights under
    a loaded name, and the base model's name as an adapter's)."""
    paths: dict[tuple[str, str], str] = {}
    for m in cfg.models.values():
        if m.adapter is None:
            continue
        if m.adapter == m.cluster_name:
            raise ConfigError(f"[models.{m.name}] adapter {m.adapter!r} is the base model's name")
        key = (m.cluster_name, m.adapter)
        if m.adapter_path is not None and paths.setdefault(key, m.adapter_path) != m.adapter_path:
            raise ConfigError(
                f"[models.{m.name}] adapter {m.adapter!r} is configured with two adapter_paths "
                f"({paths[key]!r} and {m.adapter_path!r}): one name is one set of weights"
            )


def may_use(model: ModelConfig, team_id: str | None) -> bool:
    """Whether team `team_id` may use and see `model` (None: the admin, who sees all)."""
    return team_id is None or model.teams is None or team_id in model.teams


def adapter_card(model: ModelConfig) -> dict[str, str]:
    """A LoRA adapter's fields of its `/v1/models` card (vLLM's: `parent` the base model,
    `root` where the adapter is read from, else its name); {} for any other model."""
    if model.adapter is None:
        return {}
    return {"parent": model.base or "", "root": model.adapter_path or model.adapter}
