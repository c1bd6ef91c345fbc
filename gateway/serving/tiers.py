"""Tier admission: how many requests this gateway runs at once, and who waits for a slot.

Interactive and batch traffic wait in separate bounded queues, each with a maximum wait. A
freed slot goes to an interactive waiter first, batch only when no interactive request waits;
inside a tier it goes to the team with the least attained service (fair_queue.py), first come
first served within a team. A few slots stay free of a team beyond its fair share while another
team that asked recently holds less than its own (headroom.py): that team's next request starts
at once, and a team alone may still take every slot. When the gateway is saturated batch is
shed first: a batch arrival that would wait behind interactive traffic, or finds its queue full,
is refused at once (503 + Retry-After); interactive requests are refused only when their own
queue is full or their wait runs out. A full queue refuses the team that fills it most: its
newest waiter makes room for another team's request. Every wait and refusal is counted per team
and tier (`duet:gateway_queue_wait_seconds`, `duet:gateway_admission_refusals{team,tier,reason}`),
a refusal names its reason (`x-duet-shed-reason`) and an answer its wait (`x-duet-queue-ms`).

Invariant: a free slot and a waiter coexist only while the headroom holds that waiter's team
back (or, for a batch waiter, an interactive one's); a waiter it no longer holds (a slot freed,
another team's activity lapsed: a timer) gets the slot at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.accounts.store.base import Team
from gateway.accounts.team_gate import TeamGate, TeamLimited
from gateway.backends.base import Shed
from gateway.config import TeamPolicy, Tier, TierConfig
from gateway.metrics import GatewayMetrics
from gateway.serving.fair_queue import Claim, FairQueue, Waiter
from gateway.serving.headroom import Grant, Headroom
from protocol.openai import APIError

#: the x-duet-tier header's values (the lookup types the name as a Tier)
_TIERS: dict[str, Tier] = {"interactive": "interactive", "batch": "batch"}
#: OpenAI's service_tier values and duet's names, as duet's tiers
TIER_ALIASES: dict[str, Tier] = {
    "interactive": "interactive",
    "batch": "batch",
    "priority": "interactive",
    "flex": "batch",
}


def resolve_tier(header: str | None, service_tier: str | None, default: Tier) -> Tier:
    """The tier a request runs at: the `x-duet-tier` header, else OpenAI's `service_tier`
    (duet's names or OpenAI's), else the team's default."""
    if header is not None:
        tier = _TIERS.get(header)
        if tier is None:
            raise APIError(
                400,
                f"x-duet-tier must be 'interactive' or 'batch', got {header!r}",
                param="x-duet-tier",
            )
        return tier
    if service_tier is None or service_tier in ("auto", "default"):
        return default
    if service_tier not in TIER_ALIASES:
        raise APIError(
            400,
            f"service_tier must be one of auto, default, interactive, batch, priority, flex; "
            f"got {service_tier!r}",
            param="service_tier",
        )
    return TIER_ALIASES[service_tier]


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


@dataclass
class Turn:
    """An admitted request's slot: how long it waited, and what it served (`output`), which
    its team's service counter is charged with when the slot is released."""

    claim: Claim
    queued_s: float = 0.0
    output_tokens: int = 0
    #: gives the slot back (set by `Admission.slot`; once, whoever calls first)
    _release: Callable[[], None] | None = None

    @property
    def queue_ms(self) -> str:
        """`x-duet-queue-ms`: the wait for the slot, whole milliseconds."""
        return str(round(self.queued_s * 1000))

    def output(self, tokens: int) -> None:
        self.output_tokens = tokens

    def release(self) -> None:
        """Give the slot back now, before the `slot` block ends: the node finished, and what is
        left to write to a slow client needs no node (its output tokens set first)."""
        if self._release is not None:
            self._release()


_Slot = asyncio.Future[None]


def _loop_time() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:  # a slot given back with no loop running (shutdown): the same clock
        return time.monotonic()


class Admission:
    def __init__(
        self,
        cfg: TierConfig,
        metrics: GatewayMetrics,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """`clock`: the seconds the headroom judges a team's activity by; the event loop's clock
        by default, which its timers run on too (the simulator's loop runs on virtual time)."""
        self.cfg = cfg
        self.metrics = metrics
        self.running = 0
        #: per-team limits on this gateway's own counts, checked before tokenizing
        self.teams = TeamGate()
        self.queues: dict[str, FairQueue[_Slot]] = {
            t: FairQueue(cfg.fair_output_weight, by_team=cfg.fair_share)
            for t in ("interactive", "batch")
        }
        self.headroom = {
            t: Headroom(cfg.max_inflight, cfg.headroom, cfg.fair_active_s) for t in self.queues
        }
        self._clock = clock or _loop_time
        #: a dispatch at the time the first held room lapses (`_hold_until_lapse`)
        self._lapse: asyncio.TimerHandle | None = None
        self._lapse_at = 0.0
        self._limits = {"interactive": cfg.interactive_queue, "batch": cfg.batch_queue}
        self._waits = {"interactive": cfg.interactive_max_wait_s, "batch": cfg.batch_max_wait_s}
        for tier in self.queues:  # each tier's depth shows from the start, 0
            self._gauge(tier)

    def check_team(self, team: Team, default_max_concurrent: int) -> None:
        """The team gate's cheap refusal (before any tokenizing), counted as the store's are
        (ledger.Ledger.reserve). A request that passes counts in the gate's requests-per-minute
        window at once, whatever becomes of it: one that fails later (a prompt past the
        context, a bad logit_bias, a template error) cost the gateway its CPU all the same."""
        try:
            self.teams.check(team, default_max_concurrent)
        except TeamLimited as e:
            self.metrics.rejections.labels(team=team.id, kind=e.param or "").inc()
            raise
        self.teams.started(team)

    def depth(self, tier: str) -> int:
        return len(self.queues[tier])

    def _gauge(self, tier: str) -> None:
        self.metrics.child(self.metrics.queue_depth, tier).set(len(self.queues[tier]))

    @contextlib.asynccontextmanager
    async def slot(
        self, tier: str, claim: Claim | None = None, max_wait_s: float | None = None
    ) -> AsyncIterator[Turn]:
        """A slot in `tier` for `claim`'s team (None: an unnamed one, for tests and tools);
        `max_wait_s`: a shorter wait than the tier's (a request with a fallback model). The
        caller reports its output tokens on the yielded `Turn`, and may give the slot back
        before the block ends (`Turn.release`)."""
        turn = Turn(claim or Claim(team=""))
        start = time.monotonic()
        await self._acquire(tier, turn.claim, max_wait_s)
        turn.queued_s = time.monotonic() - start
        m = self.metrics
        m.child(m.queue_wait, turn.claim.team, tier).observe(turn.queued_s)
        self.metrics.inflight.inc()
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.metrics.inflight.dec()
                self.queues[tier].done(turn.claim, turn.output_tokens)
                self._release()

        turn._release = release
        try:
            yield turn
        finally:
            release()
            # the closure holds the turn: a cycle that only the collector would free, with
            # all the request the turn's holder still reaches
            turn._release = None

    def _shed(self, tier: str, claim: Claim, reason: str, message: str) -> Shed:
        self.metrics.shed.labels(tier=tier, reason=reason).inc()
        self.metrics.admission_refusals.labels(team=claim.team, tier=tier, reason=reason).inc()
        return Shed(message, self._waits[tier], headers={"x-duet-shed-reason": reason})

    def _grant(self, tier: str, team: str, now: float) -> Grant:
        """Whether `team` (a fair queue's key) may take a free slot of `tier` now."""
        q = self.queues[tier]
        free = self.cfg.max_inflight - self.running
        return self.headroom[tier].grant(team, free, q.running(), q.teams_waiting(), now)

    def _starts_at_once(self, tier: str, claim: Claim, now: float) -> bool:
        """An arrival takes a free slot without waiting: none of its tier's waiters may (the
        invariant), interactive goes before batch, and the headroom does not hold it."""
        if self.running >= self.cfg.max_inflight:
            return False
        if not any(self.queues.values()):
            return self._grant(tier, self.queues[tier].key(claim.team), now).starts
        if tier == "batch" and self.queues["interactive"]:
            return False
        q = self.queues[tier]
        key = q.key(claim.team)
        # the waiters left are held, so a team of theirs is held too (headroom.py): only a
        # team within its share passes them, and it has none of its own waiting
        return not q.waiting(claim.team) and self._grant(tier, key, now).starts

    async def _acquire(self, tier: str, claim: Claim, max_wait_s: float | None = None) -> None:
        q = self.queues[tier]
        now = self._clock()
        self.headroom[tier].asked(q.key(claim.team), claim.weight, now)
        if self.running < self.cfg.max_inflight and any(self.queues.values()):
            self._dispatch()  # the arrival changed the shares: a held waiter may start now
        if self._starts_at_once(tier, claim, now):
            self.running += 1
            q.admitted(claim)
            return
        if tier == "batch" and self.queues["interactive"]:
            raise self._shed(
                tier,
                claim,
                "saturated",
                "the cluster is saturated with interactive traffic; batch requests are shed "
                "first — retry later",
            )
        if len(q) >= self._limits[tier]:
            full = f"the {tier} admission queue is full ({self._limits[tier]} waiting); retry later"
            # A full queue refuses the team that fills it most: its newest waiter makes room
            # for another team's request, so a flood cannot lock the others out.
            evicted = q.make_room(claim)
            if evicted is None:
                raise self._shed(tier, claim, "queue_full", full)
            evicted.item.set_exception(self._shed(tier, evicted.claim, "queue_full", full))
        fut: _Slot = asyncio.get_running_loop().create_future()
        waiter = q.push(claim, fut)
        self._gauge(tier)
        if self.running < self.cfg.max_inflight:  # held back by the headroom
            self._hold_until_lapse(now)
        wait = self._waits[tier] if max_wait_s is None else min(max_wait_s, self._waits[tier])
        try:
            async with asyncio.timeout(wait):
                await asyncio.shield(fut)
        except BaseException as e:
            refused = fut.exception() if fut.done() and not fut.cancelled() else None
            if refused is not None:  # made room for another team (make_room): already out
                self._gauge(tier)
                raise refused from None
            self._give_up(tier, waiter)
            if not isinstance(e, TimeoutError):
                raise
            raise self._shed(
                tier,
                claim,
                "timeout",
                f"no capacity freed within {wait:g}s for this {tier} request; retry later",
            ) from None
        self._gauge(tier)

    def _give_up(self, tier: str, waiter: Waiter[_Slot]) -> None:
        q, fut = self.queues[tier], waiter.item
        if fut.done() and not fut.cancelled():  # the slot came as we gave up: pass it on
            q.refund(waiter.claim)
            self._release()
        else:
            fut.cancel()
            q.remove(waiter)
        self._gauge(tier)

    def _release(self) -> None:
        self.running -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        """Free slots to the waiters that may take them: interactive first, batch only while no
        interactive request waits (held ones included: the headroom is theirs)."""
        now = self._clock()
        for tier in ("interactive", "batch"):
            q = self.queues[tier]
            if not q:  # nobody waits: the gauge already says 0 (no set per request)
                continue

            def may_start(team: str, tier: str = tier) -> bool:
                return self._grant(tier, team, now).starts

            while self.running < self.cfg.max_inflight and (w := q.pop(may_start)) is not None:
                if w.item.done():  # gave up as the slot came: charged back, the slot stays
                    q.refund(w.claim)
                    continue
                w.item.set_result(None)
                self.running += 1
            self._gauge(tier)
            if q:
                break
        if self.running < self.cfg.max_inflight and any(self.queues.values()):
            self._hold_until_lapse(now)

    def _hold_until_lapse(self, now: float) -> None:
        """Slots are free and every waiter is held: dispatch again when the first active team
        that holds them stops being active, so that no slot is held for a team gone quiet
        until some other slot frees."""
        at = min(
            (
                t
                for tier, h in self.headroom.items()
                if (t := h.lapses(self.queues[tier].teams_waiting(), now)) is not None
            ),
            default=None,
        )
        if at is None or (self._lapse is not None and self._lapse_at <= at):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # shutting down: no waiter will be served anyway
            return
        if self._lapse is not None:
            self._lapse.cancel()

        def lapse() -> None:
            self._lapse = None
            self._dispatch()

        # a millisecond past it: the team has lapsed by the clock the next dispatch reads
        self._lapse = loop.call_later(max(0.0, at - now) + 1e-3, lapse)
        self._lapse_at = at
