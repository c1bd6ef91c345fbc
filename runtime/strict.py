"""Strict mode: where a degraded fallback must be a failure instead (DESIGN §6).

A node that cannot compile its CPU kernels, import NIXL or UCX, or whose `nixl` transport
would quietly become `tcp`, still serves in production (slower, with one warning line). In
CI that fallback would let every test pass on the wrong code path, so with `CI=true` (the
variable CI services set) or `DUET_STRICT=1` each of those places raises `FallbackRefused`
instead. This is the one place that reads those variables; engine/ and kvtransfer/ both call
it (protocol/ is the only package both may import), so the rule cannot drift between them.

A deliberate choice is not a fallback: `DUET_DISABLE_KERNELS=1` or `--transport tcp` stay
allowed in strict mode (the caller logs that it was asked for).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

_TRUE = ("1", "true", "yes", "on")


class FallbackRefused(RuntimeError):
    """A feature is broken and strict mode forbids running on its fallback."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in _TRUE


def strict_mode(env: Mapping[str, str] | None = None) -> bool:
    """True under `CI=true` or `DUET_STRICT=1` (any of 1/true/yes/on, any case)."""
    env = os.environ if env is None else env
    return _truthy(env.get("CI")) or _truthy(env.get("DUET_STRICT"))


def _why(env: Mapping[str, str]) -> str:
    return (
        "CI=" + env["CI"] if _truthy(env.get("CI")) else "DUET_STRICT=" + env.get("DUET_STRICT", "")
    )


def fallback(log: logging.Logger, broken: str, instead: str) -> None:
    """Call where `broken` is about to be replaced by `instead`: in strict mode raise
    FallbackRefused naming both; otherwise log exactly one warning and return."""
    if strict_mode():
        raise FallbackRefused(
            f"{broken}; strict mode ({_why(os.environ)}) refuses to fall back to {instead}. "
            "Fix the cause, or unset CI/DUET_STRICT to accept the fallback."
        )
    log.warning("%s; falling back to %s", broken, instead)
