"""One request's money and record: the quota reservation, the rate-limit headers it earns, and
the usage record that settles it.

`Ledger.reserve` books the request's worst case in the store (atomic across gateways) or
raises `RateLimited` (429 + Retry-After + x-ratelimit-*); the ledger then follows the request
through its attempts (`attempt`: which model and prompt count the record names) and settles
it from the reply's `Accounting` with `commit` (awaited: the record is in the store before the
answer's last bytes go out) or `submit` (the caller cannot wait: the client left, the handler
is cancelled).

Invariants: a ledger settles exactly once (later calls are no-ops: `settled`); a request no
node or provider served costs nothing and keeps no tokens in the team's window — unless its
client left after the prompt went out (then the prompt is paid); the metrics and
the log line of a request are written once, after its answer's last bytes.

In flight (reserved, not settled) a ledger is in its `Books.in_flight`, by reservation id:
the heartbeat reads each streaming one's completion tokens sent there (`streamed_report`) and
the store keeps them on the booking, so a booking whose gateway dies bills what its client was
streamed (store/expiry.py). The request path pays one dict insert and one delete for it, never
anything per token: the heartbeat reads the reply's own counters.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.accounts.pricing import cost_usd, worst_case_usd
from gateway.accounts.store.base import (
    ApiKey,
    Booked,
    RateState,
    Refusal,
    ReserveRequest,
    Settlement,
    Store,
    Team,
    UsageKey,
    UsageRecord,
)
from gateway.accounts.usage import Accounting, SentLog
from gateway.accounts.usage_writer import UsageWriter
from gateway.config import ModelConfig, QuotaConfig, Tier
from gateway.metrics import GatewayMetrics
from protocol.openai import APIError
from runtime.tracing import Tracing

log = logging.getLogger("duet.gateway")


class UsageStatus(StrEnum):
    """How a request ended, as its usage record says."""

    OK = "ok"
    ERROR = "error"
    ERROR_MIDSTREAM = "error_midstream"
    SHED = "shed"
    CLIENT_DISCONNECTED = "client_disconnected"
    #: past the gateway's cap on a request's time (`[server] request_timeout_s`): billed as a
    #: client that left, what was read for it so far
    REQUEST_TIMEOUT = "request_timeout"


class RateLimited(APIError):
    def __init__(self, refusal: Refusal) -> None:
        code = "budget_exceeded" if refusal.kind.endswith("budget") else "rate_limit_exceeded"
        super().__init__(
            429,
            refusal.message,
            type_="rate_limit_error" if code == "rate_limit_exceeded" else "insufficient_quota",
            code=code,
            param=refusal.kind,
            retry_after_s=max(1, math.ceil(refusal.retry_after_s)),
            headers=rate_headers(refusal.rate),
        )


def _reset(s: float) -> str:
    return f"{s:.3f}s" if s < 60 else f"{int(s // 60)}m{s % 60:.0f}s"


def rate_headers(r: RateState) -> dict[str, str]:
    h = {}
    if r.limit_requests is not None:
        h.update(
            {
                "x-ratelimit-limit-requests": str(r.limit_requests),
                "x-ratelimit-remaining-requests": str(max(0, r.remaining_requests or 0)),
                "x-ratelimit-reset-requests": _reset(r.reset_requests_s),
            }
        )
    if r.limit_tokens is not None:
        h.update(
            {
                "x-ratelimit-limit-tokens": str(r.limit_tokens),
                "x-ratelimit-remaining-tokens": str(max(0, r.remaining_tokens or 0)),
                "x-ratelimit-reset-tokens": _reset(r.reset_tokens_s),
            }
        )
    return h


@dataclass(frozen=True)
class Caller:
    """Who asks, and on what terms: the key's team, the gateway's request id, when the request
    arrived, and the price factor (1.0; the batch discount below it)."""

    key: ApiKey
    team: Team
    request_id: str
    t0: float
    price_factor: float = 1.0
    #: whether `request_id` is a key the request may be billed under again — a batch line's
    #: reruns, a client's retries under its `Idempotency-Key` — and what a second record does
    usage_key: UsageKey = UsageKey.NONE
    #: the answer is bound by `[server] request_timeout_s`; the batch runner's lines are not: the
    #: runner reads them as they come (no client holds their slot), and a line that needs longer
    #: than the cap would only be retried to the same end
    capped: bool = True

    def leg_id(self) -> str:
        """The id a run of this request sends its nodes: `request_id`, or — when it is a usage
        key, under which an earlier run may still be on a node (a node refuses an id in use) —
        that id and a suffix of the run's own. The answer and the record keep `request_id`."""
        if self.usage_key is UsageKey.NONE:
            return self.request_id
        return f"{self.request_id}.{secrets.token_hex(3)}"


@dataclass
class Books:
    """What every ledger of this gateway books with: the store, the usage writer, the metrics
    and spans a settlement feeds, the quota settings, this gateway's id in the store, and the
    ledgers reserved and not yet settled (the heartbeat's `streamed_report` reads them)."""

    store: Store
    writer: UsageWriter
    metrics: GatewayMetrics
    tracing: Tracing
    quotas: QuotaConfig
    #: this process's identity in the store: its reservations and its heartbeat row
    gateway_id: str
    #: reservation id → the ledger of each request reserved and not yet settled
    in_flight: dict[str, Ledger] = field(default_factory=dict)

    def streamed_report(self) -> dict[str, int]:
        """Reservation id → completion tokens its client was sent so far (the relay's `SentLog`:
        not those made but not written yet), for each in-flight ledger whose count grew since the
        store was last told (`Store.heartbeat`'s `streamed`); the caller marks them told with
        `streamed_reported` once the heartbeat committed."""
        out = {}
        for rid, ledger in self.in_flight.items():
            sent = ledger.streamed
            if sent is not None and (n := sent.total) > ledger.reported:
                out[rid] = n
        return out

    def streamed_reported(self, report: dict[str, int]) -> None:
        for rid, n in report.items():
            ledger = self.in_flight.get(rid)
            if ledger is not None:
                ledger.reported = max(ledger.reported, n)


@dataclass(frozen=True)
class Order:
    """What a request books: its endpoint, the model it named and the one it tries first, the
    models it may end on (its fallback chain: the worst case is the dearest), its tier, and its
    size — the prompt tokens to reserve for, those counted on the first model, and the
    completion tokens of all its samples."""

    endpoint: str
    model_requested: str
    user: str | None
    tier: Tier
    model: ModelConfig
    chain: tuple[ModelConfig, ...]
    prompt_tokens: int
    counted_prompt_tokens: int
    completion_tokens: int


class Ledger:
    def __init__(
        self,
        books: Books,
        caller: Caller,
        reservation_id: str,
        record: UsageRecord,
        rate: RateState,
        model: ModelConfig,
    ) -> None:
        self.books = books
        self.caller = caller
        self.reservation_id = reservation_id
        self.record = record
        #: the x-ratelimit-* headers of the reservation, for the answer
        self.headers = rate_headers(rate)
        #: the model the request tries now (its prices settle it)
        self.model = model
        self.settled = False
        #: what the relay streaming the answer has sent (`streaming`); None: nothing streams (a
        #: whole answer reaches its client only at the end: a death bills its prompt)
        self.streamed: SentLog | None = None
        #: the completion tokens the store was last told of (`Books.streamed_report`)
        self.reported = 0

    @classmethod
    async def reserve(cls, books: Books, caller: Caller, order: Order) -> Ledger:
        """Book the request's worst case (its prompt plus its full completions, at the dearest
        model of its chain) or raise RateLimited."""
        team, model, n_prompt = caller.team, order.model, order.prompt_tokens
        # what the booking bills if this gateway dies before settling it: the prompt, and what was
        # streamed by the last heartbeat at this model's completion price
        booked = Booked(
            model=model.name,
            tier=order.tier,
            endpoint=order.endpoint,
            prompt_tokens=n_prompt,
            prompt_cost_usd=cost_usd(model, n_prompt, 0) * caller.price_factor,
            completion_usd_per_mtok=model.output_usd_per_mtok * caller.price_factor,
            idempotent=caller.usage_key is not UsageKey.NONE,
            user=order.user,
            adapter=model.adapter,
        )
        worst = max(worst_case_usd(m, n_prompt, order.completion_tokens) for m in order.chain)
        reserve = ReserveRequest(
            team_id=team.id,
            key_id=caller.key.id,
            request_id=caller.request_id,
            tokens=n_prompt + order.completion_tokens,
            cost_usd=worst * caller.price_factor,
            ttl_s=books.quotas.reservation_ttl_s,
            gateway_id=books.gateway_id,
            booked=booked,
            default_max_concurrent=books.quotas.default_max_concurrent,
        )
        res = await books.store.reserve(reserve)
        if isinstance(res, Refusal):
            books.metrics.rejections.labels(team=team.id, kind=res.kind).inc()
            log.info(
                "%s: team %s refused (%s): %s", caller.request_id, team.id, res.kind, res.message
            )
            raise RateLimited(res)
        record = UsageRecord(
            request_id=caller.request_id,
            team_id=team.id,
            key_id=caller.key.id,
            model_requested=order.model_requested,
            model_used=model.name,
            tier=order.tier,
            status=UsageStatus.ERROR.value,
            prompt_tokens=order.counted_prompt_tokens,
            endpoint=order.endpoint,
            user=order.user,
            adapter=model.adapter,
        )
        ledger = cls(books, caller, res.id, record, res.rate, model)
        books.in_flight[res.id] = ledger  # until it settles (`_settlement`)
        return ledger

    def attempt(self, model: ModelConfig, prompt_tokens: int) -> None:
        """The request now tries `model` (its first model, or a fallback)."""
        self.model = model
        self.record.model_used, self.record.prompt_tokens = model.name, prompt_tokens
        self.record.adapter = model.adapter

    def streaming(self, sent: SentLog) -> None:
        """A relay now streams the answer: the heartbeat reports the tokens it has sent."""
        self.streamed = sent

    def _settlement(
        self, status: UsageStatus, acc: Accounting | None, sent: SentLog | None
    ) -> Settlement:
        self.books.in_flight.pop(self.reservation_id, None)
        r = self.record
        r.status = status.value
        served = acc is not None and acc.served
        # A client that leaves once its prompt went out still pays for the prompt: a node or a
        # provider is computing it (else leaving before the first token would be free compute);
        # so does a request cut by the wall-time cap (a trickling client is no free pass either).
        prompt_only = (
            not served
            and acc is not None
            and acc.prompt_sent
            and status in (UsageStatus.CLIENT_DISCONNECTED, UsageStatus.REQUEST_TIMEOUT)
        )
        if acc is not None:
            r.prompt_tokens = acc.prompt_tokens or r.prompt_tokens
            # Every completion token read from the node or provider: a client that left chose to
            # stop and pays what was made for it, sent or not. An answer that broke off by the
            # backend's fault bills what its client was sent, not what was made but never
            # delivered (a piece still held back, or a whole answer that became a 502).
            if status is UsageStatus.ERROR_MIDSTREAM and sent is not None:  # it broke off
                r.completion_tokens = sent.total
            else:
                r.completion_tokens = acc.total_completion_tokens
            r.cached_tokens = acc.cached_tokens
            r.nodes = list(acc.nodes)
            r.migrations, r.leg_tokens = acc.migrations, list(acc.leg_tokens)
            r.model_used = acc.model_used or r.model_used
            r.version = acc.version
        # what the nodes wrote to keep (none when nobody served: no node computed the prefix)
        written = acc.cache_write_tokens if acc is not None and (served or prompt_only) else 0
        r.cache_write_tokens = written
        # A request no node served (refused by a node, shed, every try failed) costs nothing.
        r.cost_usd = (
            cost_usd(self.model, r.prompt_tokens, r.completion_tokens, r.cached_tokens, written)
            * self.caller.price_factor
            if served or prompt_only
            else 0.0
        )
        r.ttft_s = (
            (acc.first_token_at - self.caller.t0)
            if acc is not None and acc.first_token_at is not None
            else None
        )
        r.latency_s = time.monotonic() - self.caller.t0
        r.created_at = time.time()
        self.settled = True
        return Settlement(
            self.reservation_id,
            r,
            window_tokens=None if served or prompt_only else 0,
            key=self.caller.usage_key,
        )

    async def commit(
        self, status: UsageStatus, acc: Accounting | None, sent: SentLog | None = None
    ) -> None:
        """Settle and wait until the record is in the store (before the answer's last bytes);
        `sent`: what the relay wrote, billed when the answer broke off."""
        if self.settled:
            return
        s = self._settlement(status, acc, sent)
        # metrics and the log line once the answer's last bytes are out, not before them
        asyncio.get_running_loop().call_soon(self._observe)
        with self.books.tracing.span("gateway.usage.commit", {"duet.status": status.value}):
            await self.books.writer.commit(s)

    def submit(self, status: UsageStatus, acc: Accounting | None) -> None:
        """Settle without waiting (the caller cannot: its client left, its task is cancelled)."""
        if self.settled:
            return
        s = self._settlement(status, acc, None)
        self._observe()
        self.books.writer.submit(s)

    def _observe(self) -> None:
        r, m = self.record, self.books.metrics
        log.info(
            "%s team=%s model=%s used=%s tier=%s status=%s prompt=%d cached=%d completion=%d "
            "cost=$%.6f ttft=%s latency=%.3fs nodes=%s",
            r.request_id,
            r.team_id,
            r.model_requested,
            r.model_used,
            r.tier,
            r.status,
            r.prompt_tokens,
            r.cached_tokens,
            r.completion_tokens,
            r.cost_usd,
            f"{r.ttft_s:.3f}s" if r.ttft_s is not None else "-",
            r.latency_s,
            ",".join(r.nodes) or "-",
        )
        # label values in each metric's label order (metrics.py)
        m.child(m.requests, r.team_id, r.model_requested, r.tier, r.status).inc()
        # spend and tokens go to the model that served (a fallback is paid at its prices)
        m.child(m.spend, r.team_id, r.model_used).inc(r.cost_usd)
        m.child(m.tokens, r.team_id, r.model_used, "prompt").inc(r.prompt_tokens)
        m.child(m.tokens, r.team_id, r.model_used, "completion").inc(r.completion_tokens)
        m.child(m.e2e, r.model_requested).observe(r.latency_s)
        if r.ttft_s is not None:
            m.child(m.ttft, r.model_requested).observe(r.ttft_s)
