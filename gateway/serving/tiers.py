"""Tier admission: how many requests this gateway runs at once, and who waits for a slot.

Interactive and batch traffic wait in separate bounded queues, each with a maximum wait. A
freed slot goes to the oldest interactive waiter first, batch only when no interactive
request waits. When the gateway is saturated batch is shed first: a batch arrival that
would wait behind interactive traffic, or finds its queue full, is refused at once (503 +
Retry-After); interactive requests are refused only when their own queue is full or their
wait runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from gateway.accounts.store.base import Team
from gateway.accounts.team_gate import TeamGate, TeamLimited
from gateway.backends.base import Shed
from gateway.config import TeamPolicy, Tier, TierConfig
from gateway.metrics import GatewayMetrics
from protocol.openai import APIError

TIER_ALIASES = {
    "interactive": "interactive",
    "batch": "batch",
    "priority": "interactive",
    "flex": "batch",
}


def resolve_tier(header: str | None, service_tier: str | None, default: Tier) -> Tier:
    """The tier a request runs at: the `x-duet-tier` header, else OpenAI's `service_tier`
    (duet's names or OpenAI's), else the team's default."""
    if header is not None:
        if header not in ("interactive", "batch"):
            raise APIError(
                400,
                f"x-duet-tier must be 'interactive' or 'batch', got {header!r}",
                param="x-duet-tier",
            )
        return header  # type: ignore[return-value]
    if service_tier is None or service_tier in ("auto", "default"):
        return default
    if service_tier not in TIER_ALIASES:
        raise APIError(
            400,
            f"service_tier must be one of auto, default, interactive, batch, priority, flex; "
            f"got {service_tier!r}",
            param="service_tier",
        )
    return TIER_ALIASES[service_tier]  # type: ignore[return-value]


def granted_tier(asked: Tier, policy: TeamPolicy, team_id: str) -> Tier:
    """The tier is the operator's grant (`[teams.X] interactive`), not the client's choice: a
    team kept to batch that asks for interactive (header or `service_tier`) gets a 403."""
    if asked == "interactive" and not policy.interactive:
        raise APIError(
            403,
            f"team {team_id!r} may not use the interactive tier; send batch requests "
            "(x-duet-tier: batch, or the Batch API)",
            type_="permission_error",
            param="x-duet-tier",
            code="tier_not_allowed",
        )
    return asked


def team_tier(header: str | None, service_tier: str | None, team: Team, policy: TeamPolicy) -> Tier:
    """The tier a team's request runs in: what the client asks (header, `service_tier`), else the
    team's default — batch for a team without the interactive grant — checked against the grant.
    Every public endpoint takes its tier here (embeddings once skipped the grant)."""
    default = team.default_tier if policy.interactive else "batch"
    return granted_tier(resolve_tier(header, service_tier, default), policy, team.id)


class Admission:
    def __init__(self, cfg: TierConfig, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.running = 0
        #: per-team limits on this gateway's own counts, checked before tokenizing
        self.teams = TeamGate()
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {
            "interactive": deque(),
            "batch": deque(),
        }
        self._limits = {"interactive": cfg.interactive_queue, "batch": cfg.batch_queue}
        self._waits = {"interactive": cfg.interactive_max_wait_s, "batch": cfg.batch_max_wait_s}

    def check_team(self, team: Team, default_max_concurrent: int) -> None:
        """The team gate's cheap refusal (before any tokenizing), counted as the store's are
        (ledger.Ledger.reserve)."""
        try:
            self.teams.check(team, default_max_concurrent)
        except TeamLimited as e:
            self.metrics.rejections.labels(team=team.id, kind=e.param or "").inc()
            raise

    def depth(self, tier: str) -> int:
        return len(self._waiting[tier])

    def _gauge(self, tier: str) -> None:
        self.metrics.queue_depth.labels(tier=tier).set(len(self._waiting[tier]))

    @contextlib.asynccontextmanager
    async def slot(self, tier: str, max_wait_s: float | None = None) -> AsyncIterator[None]:
        """`max_wait_s`: a shorter wait than the tier's (a request with a fallback model)."""
        await self._acquire(tier, max_wait_s)
        self.metrics.inflight.inc()
        try:
            yield
        finally:
            self.metrics.inflight.dec()
            self._release()

    async def _acquire(self, tier: str, max_wait_s: float | None = None) -> None:
        if self.running < self.cfg.max_inflight and not any(self._waiting.values()):
            self.running += 1
            return
        q = self._waiting[tier]
        if tier == "batch" and self._waiting["interactive"]:
            self.metrics.shed.labels(tier=tier, reason="saturated").inc()
            raise Shed(
                "the cluster is saturated with interactive traffic; batch requests are shed "
                "first — retry later",
                self._waits[tier],
            )
        if len(q) >= self._limits[tier]:
            self.metrics.shed.labels(tier=tier, reason="queue_full").inc()
            raise Shed(
                f"the {tier} admission queue is full ({self._limits[tier]} waiting); retry later",
                self._waits[tier],
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        q.append(fut)
        self._gauge(tier)
        wait = self._waits[tier] if max_wait_s is None else min(max_wait_s, self._waits[tier])
        try:
            await asyncio.wait_for(asyncio.shield(fut), wait)
        except BaseException as e:
            if fut.done() and not fut.cancelled():  # the slot came as we gave up: pass it on
                self._release()
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    q.remove(fut)
            self._gauge(tier)
            if not isinstance(e, TimeoutError):
                raise
            self.metrics.shed.labels(tier=tier, reason="timeout").inc()
            raise Shed(
                f"no capacity freed within {wait:g}s for this {tier} request; retry later",
                self._waits[tier],
            ) from None
        self._gauge(tier)

    def _release(self) -> None:
        for tier in ("interactive", "batch"):
            q = self._waiting[tier]
            while q:
                fut = q.popleft()
                if not fut.done():
                    fut.set_result(None)  # the slot passes on: running stays the same
                    self._gauge(tier)
                    return
            self._gauge(tier)
        self.running -= 1
