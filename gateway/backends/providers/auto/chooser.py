"""`model: "auto"`: the cheapest model whose capability rank meets the request's needs.

The classifier labels the request simple / medium / hard; `RANK_FOR` (or the caller's own
mapping) turns that into a required capability rank. Among the catalog's models that serve the
request's tier, fit its context, are not forbidden by the team's `AutoPolicy` and are
`available` (no open breaker, a healthy pool), the one with the lowest expected cost for this
request wins (ties: the lower rank, then the name). Batch requests reach paid models only if
the team allows it, as with fallback.

A team can pin a label to a model (`pin={"hard": "claude-sonnet"}`): the pin wins whenever that
model can take the request. If no model meets the required rank, the most capable usable one
answers (`reason="best_available"`) rather than none: a weaker answer beats an error, and
the choice is visible in `x-duet-model-used` and the usage record. `model=None` only when
nothing at all can take the request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import msgspec

from gateway.backends.providers.auto.classifier import Classifier, Prediction
from gateway.backends.providers.catalog import ModelEntry
from gateway.backends.providers.config import Tier

RANK_FOR: dict[str, int] = {"simple": 1, "medium": 2, "hard": 3}
#: the completion length assumed when the request gives no max_tokens, for comparing costs
DEFAULT_COMPLETION_TOKENS = 256


class AutoPolicy(msgspec.Struct, frozen=True, kw_only=True):
    #: label → model the team wants for it
    pin: dict[str, str] = {}
    #: models `auto` must never choose for this team
    forbid: frozenset[str] = frozenset()
    #: if set, the only models `auto` may choose
    allow: frozenset[str] | None = None
    allow_paid_for_batch: bool = False


class AutoChoice(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None
    label: str
    required_rank: int
    reason: Literal["pinned", "cheapest_capable", "best_available", "none"]
    probs: dict[str, float]
    skipped: tuple[tuple[str, str], ...] = ()


def _why_not(
    m: ModelEntry,
    tier: Tier,
    policy: AutoPolicy,
    prompt_tokens: int,
    max_tokens: int | None,
    available: Callable[[str], bool],
) -> str | None:
    if m.name in policy.forbid or (policy.allow is not None and m.name not in policy.allow):
        return "forbidden_by_team"
    if tier not in m.tiers:
        return f"tier_{tier}_not_served"
    if tier == "batch" and m.paid and not policy.allow_paid_for_batch:
        return "paid_not_allowed_for_batch"
    if not m.fits(prompt_tokens, max_tokens):
        return "context_too_short"
    if not available(m.name):
        return "unavailable"
    return None


def choose(
    prediction: Prediction,
    catalog: Mapping[str, ModelEntry],
    *,
    tier: Tier,
    policy: AutoPolicy,
    prompt_tokens: int,
    max_tokens: int | None,
    available: Callable[[str], bool] = lambda _: True,
    rank_for: Mapping[str, int] = RANK_FOR,
) -> AutoChoice:
    need = rank_for[prediction.label]
    usable: list[ModelEntry] = []
    skipped: list[tuple[str, str]] = []
    for m in sorted(catalog.values(), key=lambda m: m.name):
        why = _why_not(m, tier, policy, prompt_tokens, max_tokens, available)
        if why is None:
            usable.append(m)
        else:
            skipped.append((m.name, why))

    def done(model: str | None, reason: Any) -> AutoChoice:
        return AutoChoice(
            model=model,
            label=prediction.label,
            required_rank=need,
            reason=reason,
            probs=prediction.probs,
            skipped=tuple(skipped),
        )

    pinned = policy.pin.get(prediction.label)
    if pinned is not None and any(m.name == pinned for m in usable):
        return done(pinned, "pinned")
    completion = max_tokens or DEFAULT_COMPLETION_TOKENS
    capable = [m for m in usable if m.capability_rank >= need]
    if capable:
        best = min(
            capable,
            key=lambda m: (m.expected_cost(prompt_tokens, completion), m.capability_rank, m.name),
        )
        return done(best.name, "cheapest_capable")
    if usable:
        best = max(
            usable, key=lambda m: (m.capability_rank, -m.expected_cost(prompt_tokens, completion))
        )
        return done(best.name, "best_available")
    return done(None, "none")


class AutoRouter:
    """What the gateway holds: the classifier (loaded once) and the chooser."""

    def __init__(
        self, classifier: Classifier | None = None, rank_for: Mapping[str, int] = RANK_FOR
    ) -> None:
        self.classifier = classifier or Classifier.load()
        self.rank_for = dict(rank_for)

    def route(
        self,
        messages: Sequence[Mapping[str, Any]],
        catalog: Mapping[str, ModelEntry],
        *,
        tier: Tier,
        policy: AutoPolicy,
        prompt_tokens: int,
        max_tokens: int | None,
        available: Callable[[str], bool] = lambda _: True,
    ) -> AutoChoice:
        return choose(
            self.classifier.predict(messages),
            catalog,
            tier=tier,
            policy=policy,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            available=available,
            rank_for=self.rank_for,
        )
