"""The planner's configuration: mode, pacing, SLOs per tier, bounds per pool and the node budget.

Read from a TOML file (`duet coordinator --planner-config planner.toml`, the `[planner]` table or
the whole file), with `--planner-set KEY=VALUE` over it; every field has a default an operator
can start from.

    mode = "load"            # or "throughput"
    interval_s = 5
    cooldown_s = 60          # after any step on a pool, before the next one
    reverse_cooldown_s = 180 # before a step the other way (no flapping)
    cold_start_s = 60        # a new node's figures are ignored this long
    node_budget = 8          # all pools, all models together (GPUs: nodes × gpus per node)
    actuator = "kubernetes"  # or "virtual" (writes decision_file), "local" (duet up's nodes)
    drain_deadline_s = 120   # scale-in: a node's time to finish its work before it is stopped
    [slo.interactive]
    ttft_s = 1.0
    itl_s = 0.1
    [bounds]
    "prefill" = [1, 3]               # role
    "decode/batch" = [0, 2]          # role/tier
    "decode/smollm2-135m/interactive" = [1, 4]   # role/model/tier
"""

from __future__ import annotations

import enum
import tomllib
import typing
from collections.abc import Iterable
from pathlib import Path
from types import UnionType
from typing import Literal, Union

import msgspec

from planner.pools import PoolKey
from protocol.profile import load as load_profile


class PlannerMode(enum.StrEnum):
    #: reactive: from the load frames, against the tier's SLO
    LOAD = "load"
    #: predictive: from the request rate, ISL/OSL and prefix hits, sized on the simulator
    THROUGHPUT = "throughput"


Actuator = Literal["virtual", "kubernetes", "local"]


class TierSLO(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    ttft_s: float
    itl_s: float


def _default_slos() -> dict[str, TierSLO]:
    return {
        "interactive": TierSLO(ttft_s=1.0, itl_s=0.15),
        "shared": TierSLO(ttft_s=1.0, itl_s=0.15),
        "batch": TierSLO(ttft_s=30.0, itl_s=1.0),
    }


class StepCost(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Seconds of one engine step (protocol/profile.py's StepModel terms); the load mode's
    predictor. The defaults are SmolLM2-135M bf16 on one CPU thread in CPU terms
    (docs/capacity.md)."""

    intercept_s: float = 0.05
    prefill_s: float = 0.00035  # per prompt token
    decode_s: float = 0.0  # per sequence
    context_s: float = 5e-6  # per context token of every sequence


class PlannerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Unknown keys are refused: a typo in planner.toml never passes silently."""

    mode: PlannerMode = PlannerMode.LOAD
    interval_s: float = 5.0
    #: load figures are averaged over this window before a decision
    window_s: float = 30.0
    cooldown_s: float = 60.0
    reverse_cooldown_s: float = 180.0
    cold_start_s: float = 60.0
    #: how long a node an actuator started may take to register before it is no longer expected
    pending_timeout_s: float = 300.0
    #: most nodes across every pool and model (None: no cap)
    node_budget: int | None = None
    default_min: int = 1
    default_max: int = 4
    bounds: dict[str, tuple[int, int]] = {}
    slo: dict[str, TierSLO] = msgspec.field(default_factory=_default_slos)
    #: KV use per node that means "scale out" (the requirements' 70 %)
    kv_high: float = 0.7
    #: scale in only when every figure at N−1 stays under (1 − margin) × its bound
    margin: float = 0.3
    #: requests waiting for admission per decode node that mean the pool is full
    waiting_high: float = 1.0
    #: the busy fraction of a prefill node (load frames' `busy`) past which its prompts queue:
    #: a prefill pool scales in only if n − 1 nodes would each stay under (1 − margin) × this
    busy_high: float = 0.8
    #: load mode takes a pool's measured TTFT / ITL P90 (nodes' load frames) over its prediction
    #: only from at least this many samples (first tokens / inter-token gaps) in the window
    min_latency_samples: int = 20
    #: prefill chunk per step, and the context a decode sequence is assumed to have
    chunk_tokens: int = 512
    context_tokens: int = 512
    step: StepCost = StepCost()
    #: a profile JSON (duet bench profile): its step model replaces `step`, and throughput mode
    #: simulates on it
    profile: str | None = None
    #: throughput mode: the rate forecast's smoothing window, and the headroom it sizes for
    forecast_window_s: float = 60.0
    headroom: float = 1.2
    #: what carries a decision out: virtual writes it to `decision_file` for an external scaler;
    #: kubernetes resizes the P/D Deployments; local asks `duet up` (`local_control`) to start
    #: or stop nodes
    actuator: Actuator = "virtual"
    #: virtual actuator: where the decision is written
    decision_file: str = "planner-decision.json"
    #: kubernetes actuator: the namespace of the P/D Deployments (None: $POD_NAMESPACE, else
    #: "default")
    k8s_namespace: str | None = None
    #: kubernetes actuator: the Deployment of a pool (role, role/tier or role/model/tier); a pool
    #: not named here is duet-ROLE[-TIER]
    k8s_deployments: dict[str, str] = {}
    #: local actuator: `duet up`'s control URL (`duet up --autoscale` sets it)
    local_control: str | None = None
    #: scale-in: how long a node may take to finish its work before it is stopped anyway (its
    #: streams then migrate)
    drain_deadline_s: float = 120.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window_s <= 0:
            raise ValueError("planner interval_s and window_s must be > 0")
        if min(self.cooldown_s, self.reverse_cooldown_s, self.cold_start_s) < 0:
            raise ValueError("planner cooldowns and cold_start_s must be ≥ 0")
        if not 0 < self.kv_high <= 1 or not 0 <= self.margin < 1:
            raise ValueError("planner kv_high must be in (0, 1] and margin in [0, 1)")
        if not 0 < self.busy_high <= 1:
            raise ValueError(
                "planner busy_high must be in (0, 1] (a node's share of its time in steps)"
            )
        if self.min_latency_samples < 1:
            raise ValueError("planner min_latency_samples must be ≥ 1")
        if self.node_budget is not None and self.node_budget < 1:
            raise ValueError("planner node_budget must be ≥ 1")
        for name, (lo, hi) in self.bounds.items():
            if not 0 <= lo <= hi:
                raise ValueError(f"planner bounds {name!r}: need 0 ≤ min ≤ max, got [{lo}, {hi}]")

    def bounds_of(self, key: PoolKey) -> tuple[int, int]:
        """The most specific bounds: role/model/tier, then role/tier, then role, then defaults."""
        for name in (f"{key.role}/{key.model}/{key.tier}", f"{key.role}/{key.tier}", key.role):
            if name in self.bounds:
                return self.bounds[name]
        return self.default_min, self.default_max

    def slo_of(self, key: PoolKey) -> TierSLO:
        return self.slo.get(key.tier) or self.slo.get("shared") or _default_slos()["shared"]


def load_config(
    path: str | Path | None, sets: Iterable[str] = (), **overrides: object
) -> PlannerConfig:
    """The file's `[planner]` table (or the whole file), then `sets` (`--planner-set KEY=VALUE`,
    see `apply_sets`), then `overrides` that are not None."""
    raw: dict[str, object] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"no planner config file {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from None
        raw = data.get("planner", data)
    apply_sets(raw, sets)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        cfg = msgspec.convert(raw, PlannerConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"planner config{f' {path}' if path else ''}: {e}") from None
    if cfg.profile:
        st = load_profile(Path(cfg.profile)).step
        cfg.step = StepCost(
            intercept_s=st.intercept_s,
            prefill_s=st.prefill_s,
            decode_s=st.decode_s,
            context_s=st.context_s,
        )
    return cfg


def apply_sets(raw: dict[str, object], items: Iterable[str]) -> None:
    """Each `KEY=VALUE` over `raw`'s keys. VALUE is read as a TOML value (`8`, `0.5`, `[1, 3]`,
    `{ttft_s = 1.0, itl_s = 0.1}`) except for a text setting, which takes it as it is; one dot
    reaches into a table, the rest of the key verbatim (`bounds.decode/batch=[0, 2]`,
    `k8s_deployments.decode=duet-decode-gpu`). Raises ValueError naming the item."""
    hints = typing.get_type_hints(PlannerConfig)
    for item in items:
        key, sep, value = item.partition("=")
        top, dot, sub = key.strip().partition(".")
        if not sep or not top or (dot and not sub):
            raise ValueError(f"--planner-set {item!r}: expected KEY=VALUE, e.g. node_budget=8")
        if top not in hints:
            raise ValueError(
                f"--planner-set {item!r}: planner.toml has no key {top!r} "
                f"(known: {', '.join(sorted(hints))})"
            )
        hint = hints[top]
        if dot:
            table = raw.setdefault(top, {})
            if not isinstance(table, dict) or typing.get_origin(hint) is not dict:
                raise ValueError(f"--planner-set {item!r}: {top} is not a table")
            table[sub] = _value(value, typing.get_args(hint)[1])
        else:
            raw[top] = _value(value, hint)


def _value(text: str, hint: object) -> object:
    members = typing.get_args(hint) if typing.get_origin(hint) in (Union, UnionType) else (hint,)
    if str in members:
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word (an enum's value): the conversion judges it
