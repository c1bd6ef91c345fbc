"""Team and tier mixes: each request is sent with one team's API key and one tier, drawn with
the configured weights from a seeded generator, so a run measures how the gateway treats
several teams (quotas, fairness) and interactive vs batch traffic at once.

`--team NAME[:WEIGHT]=KEY` (KEY literal, or `env:VAR` to read it from the environment, which
keeps keys out of shell history); `--tier-mix interactive:3,batch:1`. The tier travels in the
`x-duet-tier` header, the `service_tier` body field, or both (`--tier-via`).
"""

from __future__ import annotations

import os
import random

from bench.serve_config import ServeConfig, Team


def parse_team(spec: str) -> Team:
    left, sep, key = spec.partition("=")
    name, _, weight = left.partition(":")
    if not sep or not name or not key:
        raise ValueError(
            f"cannot read --team {spec!r}: use NAME[:WEIGHT]=KEY or NAME[:WEIGHT]=env:VAR"
        )
    if key.startswith("env:"):
        var = key[4:]
        key = os.environ.get(var, "")
        if not key:
            raise ValueError(f"--team {name}: environment variable {var} is not set")
    try:
        w = float(weight) if weight else 1.0
    except ValueError:
        raise ValueError(f"--team {name}: weight {weight!r} is not a number") from None
    return Team(name=name, key=key, weight=w)


def parse_weights(spec: str, flag: str) -> tuple[tuple[str, float], ...]:
    """`a:3,b:1` (a bare name weighs 1)."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, w = part.partition(":")
        try:
            out.append((name, float(w) if w else 1.0))
        except ValueError:
            raise ValueError(f"cannot read {flag} {spec!r}: use NAME:WEIGHT,NAME:WEIGHT") from None
    return tuple(out)


class Mixer:
    """Draws (team, api key, tier) per request."""

    def __init__(self, cfg: ServeConfig, seed: int) -> None:
        self._rng = random.Random(seed)
        self._teams = cfg.teams
        self._tiers = cfg.tier_mix
        self._default_key = cfg.api_key

    def draw(self) -> tuple[str | None, str | None, str | None]:
        team = key = tier = None
        if self._teams:
            t = self._rng.choices(self._teams, weights=[t.weight for t in self._teams])[0]
            team, key = t.name, t.key
        else:
            key = self._default_key
        if self._tiers:
            tier = self._rng.choices(
                [n for n, _ in self._tiers], weights=[w for _, w in self._tiers]
            )[0]
        return team, key, tier
