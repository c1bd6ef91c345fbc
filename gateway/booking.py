"""A request's quota reservation ("booking"): booked before the request starts, or — for a
team with headroom (headroom.py) — while it starts, with `admitted()` as the gate that nothing
passes to the client before.

Invariants:
- nothing of the answer (status line, headers, a token, a JSON body) goes out before
  `admitted()` returned: an optimistic request that the store refuses ends as the same 429
  (`RateLimited`, with Retry-After and x-ratelimit-*) a booked-first one gets, and its node
  legs are aborted by the caller's usual clean-up;
- a booking is settled exactly once (`settle`), also when the request ends before the store
  answered: the settlement then waits for the answer in a callback; a refused booking has
  nothing to settle (as a refused booked-first request has no usage record);
- the store is asked once per request.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from gateway.state import GatewayState
from gateway.store.base import RateState, Refusal, Reservation, ReserveRequest, Settlement
from protocol.openai import APIError

log = logging.getLogger("duet.gateway")


class RateLimited(APIError):
    def __init__(self, refusal: Refusal) -> None:
        code = "budget_exceeded" if refusal.kind.endswith("budget") else "rate_limit_exceeded"
        super().__init__(429, refusal.message, type_="rate_limit_error" if code == "rate_limit_exceeded"
                         else "insufficient_quota", code=code, param=refusal.kind)  # fmt: skip
        self.headers = {**rate_headers(refusal.rate), "Retry-After": str(max(1, math.ceil(refusal.retry_after_s)))}


def _reset(s: float) -> str:
    return f"{s:.3f}s" if s < 60 else f"{int(s // 60)}m{s % 60:.0f}s"


def rate_headers(r: RateState) -> dict[str, str]:
    h = {}
    if r.limit_requests is not None:
        h.update({"x-ratelimit-limit-requests": str(r.limit_requests),
                  "x-ratelimit-remaining-requests": str(max(0, r.remaining_requests or 0)),
                  "x-ratelimit-reset-requests": _reset(r.reset_requests_s)})  # fmt: skip
    if r.limit_tokens is not None:
        h.update({"x-ratelimit-limit-tokens": str(r.limit_tokens),
                  "x-ratelimit-remaining-tokens": str(max(0, r.remaining_tokens or 0)),
                  "x-ratelimit-reset-tokens": _reset(r.reset_tokens_s)})  # fmt: skip
    return h


class Booking:
    def __init__(self, state: GatewayState, req: ReserveRequest) -> None:
        self.state = state
        self.req = req
        self.optimistic = False
        self._task: asyncio.Future[Reservation | Refusal] | None = None
        self._result: Reservation | None = None
        #: the store said no (known once `admitted()` raised)
        self.refused: Refusal | None = None

    async def begin(self) -> None:
        """Book now (RateLimited when refused), or start booking beside the request."""
        team = self.req.team_id
        if self.state.headroom.start(team):
            self.optimistic = True
            self._task = asyncio.ensure_future(self._book_beside())
            return
        res = await self.state.store.reserve(self.req)
        self.state.headroom.learn(team, res)
        self._accept(res)

    async def _book_beside(self) -> Reservation | Refusal:
        answer: Reservation | Refusal | None = None
        try:
            answer = await self.state.store.reserve(self.req)
            return answer
        finally:
            self.state.headroom.done(self.req.team_id, answer)
            self.state.metrics.optimistic.labels(
                outcome="admitted" if isinstance(answer, Reservation) else "refused" if answer else "failed").inc()

    def _accept(self, res: Reservation | Refusal) -> None:
        if isinstance(res, Refusal):
            self.refused = res
            self.state.metrics.rejections.labels(team=self.req.team_id, kind=res.kind).inc()
            log.info("%s: team %s refused (%s)%s: %s", self.req.request_id, self.req.team_id, res.kind,
                     " after starting on the nodes" if self.optimistic else "", res.message)  # fmt: skip
            raise RateLimited(res)
        self._result = res

    async def admitted(self, headers: dict[str, str] | None = None) -> None:
        """Wait for the booking (RateLimited when refused); add its x-ratelimit-* headers."""
        if self._result is None:
            assert self._task is not None
            # shielded: a client leaving while we wait must not cancel the booking itself
            self._accept(await asyncio.shield(self._task))
        assert self._result is not None
        if headers is not None:
            headers.update(rate_headers(self._result.rate))

    @property
    def reservation_id(self) -> str:
        assert self._result is not None, "not admitted yet"
        return self._result.id

    def settle(self, make: Callable[[str | None], Settlement], submit: Callable[[Settlement], None]) -> None:
        """Submit the settlement `make(reservation id)` — now, or once the store answered."""
        if self._result is not None:
            submit(make(self._result.id))
            return
        assert self._task is not None

        def then(t: asyncio.Future[Reservation | Refusal]) -> None:
            if not t.cancelled() and t.exception() is None and isinstance(t.result(), Reservation):
                submit(make(t.result().id))  # type: ignore[union-attr]

        self._task.add_done_callback(then)
