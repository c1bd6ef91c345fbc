"""The one request pipeline: every public endpoint — chat, completions, embeddings, and the
translated Anthropic Messages and Responses APIs — runs through `run`.

parse (the API layer: a typed `Call`) → tier (the team's grant) → the team gate's cheap
refusal → admit (the call's own checks: a constraint's grammar, a stream with nowhere to go)
→ choose (the model: named, or `auto`) → measure (tokenize, fit the context) → reserve (the ledger:
quota and the worst case's cost) → attempt (the call's `Attempts`: the tier queue, the backend,
the relay, a fallback model) → settle (the ledger, exactly once). An endpoint says what differs
through its `Call` (generate.py for chat and completions, embed.py for embeddings); the rest is
written here once.

`run` returns a typed `Answer`: the HTTP handlers render it, the batch executor reads it as it
is. A streamed answer went to the `EventSink` already (its `Answer.body` is None).

Invariants:
- the ledger settles exactly once, whatever happens (an exception, the client leaving, a shed
  request): no reservation leaks;
- no CPU-heavy step (a grammar compile, `auto`'s classifier, tokenizing) runs for a team the
  team gate refuses, and every request the gate passes counts in its window;
- the request id is the gateway's own (`req-…`), never the client's: it names engine requests
  on shared nodes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from gateway.accounts.ledger import Caller, Ledger, Order, UsageStatus
from gateway.accounts.usage import Accounting
from gateway.backends.base import ServedModel
from gateway.config import ModelConfig, TeamPolicy, Tier
from gateway.serving.context import Serving
from gateway.serving.measure import Measured
from gateway.serving.relay import EventSink
from gateway.serving.requests import Endpoint
from gateway.serving.spans import Stage, settled_attributes
from gateway.serving.tiers import team_tier
from protocol.openai import APIError
from runtime.tracing import GEN_AI_INPUT_TOKENS, GEN_AI_MAX_TOKENS, GEN_AI_REQUEST_MODEL, Attrs


@dataclass(frozen=True)
class Answer:
    """What a request got: a status, the JSON body's struct (None: streamed to the sink), and
    the headers (x-ratelimit-*, X-Request-Id, the tier, the model used, the cost)."""

    status: int
    body: object | None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Admitted:
    """A request past its cheap checks: who asks, at which tier, under which team policy, on
    which model, and the headers its answer carries so far."""

    caller: Caller
    tier: Tier
    policy: TeamPolicy
    served: ServedModel
    headers: dict[str, str]


class Attempts(Protocol):
    """A reserved request's tries on its models (one endpoint's way of answering)."""

    @property
    def accounting(self) -> Accounting | None:
        """The current try's record of what was served (what the ledger settles from when the
        request ends abnormally); None before any try."""

    async def run(self, served: ServedModel, size: Measured, sink: EventSink | None) -> Answer:
        """Answer on `served` (a fallback model after it, where the endpoint has them)."""

    def settled(self) -> Attrs:
        """The request span's attributes once settled, beyond the usage record's."""


class Call(Protocol):
    """One endpoint's request, parsed and checked, as the pipeline serves it."""

    endpoint: Endpoint
    #: the model the client named (or `auto`)
    model: str
    user: str | None
    n: int
    #: OpenAI's `service_tier`, when the API has one
    service_tier: str | None

    def attributes(self) -> Attrs:
        """The request span's attributes of this call (its GenAI operation, its stream)."""

    async def admit(self, serving: Serving, team_id: str, streamable: bool) -> None:
        """The call's own checks before any other work (`streamable`: a sink waits); what they
        cache is the team's own (its cache domain)."""

    def choose(
        self, serving: Serving, team_id: str, policy: TeamPolicy, tier: Tier
    ) -> tuple[ServedModel, dict[str, str]]:
        """The model that serves the call, and the headers the choice adds."""

    async def measure(self, serving: Serving, served: ServedModel, team_id: str) -> Measured:
        """The call's size on `served`: its token ids, the tokens to reserve for."""

    def chain(self, serving: Serving, served: ServedModel) -> tuple[ModelConfig, ...]:
        """The models the call may end on (its worst case is the dearest)."""

    def attempts(self, serving: Serving, ledger: Ledger, a: Admitted) -> Attempts:
        """How the reserved call is tried."""


async def run(
    serving: Serving,
    caller: Caller,
    call: Call,
    *,
    tier_header: str | None = None,
    sink: EventSink | None = None,
) -> Answer:
    """One call of an authenticated caller: what the HTTP handlers and the batch executor
    (gateway/batch/wiring.py; no sink, so no streaming) both call."""
    policy = serving.config.team_policy(caller.team.id)
    tier = team_tier(tier_header, call.service_tier, caller.team, policy)
    # The team gate's cheap refusal before any CPU is spent on the request — a guide's compile,
    # `auto`'s classifier, the tokenizer — so a team at its limit costs the gateway nothing
    # more; what passes counts in the team's window from here on (the store decides the rest).
    serving.admission.check_team(caller.team, serving.config.quotas.default_max_concurrent)
    with serving.admission.teams.running(caller.team.id):
        await call.admit(serving, caller.team.id, sink is not None)
        served, headers = call.choose(serving, caller.team.id, policy, tier)
        return await _measured(serving, call, Admitted(caller, tier, policy, served, headers), sink)


async def _measured(serving: Serving, call: Call, a: Admitted, sink: EventSink | None) -> Answer:
    """The rest of `run`, from tokenizing on, counted in the team gate's in-flight requests."""
    tr, caller = serving.tracing, a.caller
    tr.annotate(
        {
            **call.attributes(),
            GEN_AI_REQUEST_MODEL: call.model,
            "duet.request_id": caller.request_id,
            "duet.team": caller.team.id,
            "duet.tier": a.tier,
        }
    )
    with Stage(tr, "gateway.tokenize", {GEN_AI_REQUEST_MODEL: a.served.config.name}) as span:
        size = await call.measure(serving, a.served, caller.team.id)
        span.set(GEN_AI_INPUT_TOKENS, size.n_prompt)
    if size.max_tokens:  # (an embedding has none)
        tr.annotate({GEN_AI_MAX_TOKENS: size.max_tokens})
    ledger = await _reserve(serving, call, a, size)
    a.headers.update({**ledger.headers, "X-Request-Id": caller.request_id, "x-duet-tier": a.tier})
    attempts = call.attempts(serving, ledger, a)
    try:
        return await attempts.run(a.served, size, sink)
    except APIError as e:
        shed = e.status == 503 and e.code == "overloaded"
        ledger.submit(UsageStatus.SHED if shed else UsageStatus.ERROR, attempts.accounting)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        # The client left: its handler is cancelled, or — when a write to it fails first —
        # the write raises (aiohttp's ClientConnectionResetError is a ConnectionResetError).
        ledger.submit(UsageStatus.CLIENT_DISCONNECTED, attempts.accounting)
        raise
    finally:
        ledger.submit(UsageStatus.ERROR, attempts.accounting)  # a no-op once settled
        if tr.enabled:
            tr.annotate({**settled_attributes(ledger.record), **attempts.settled()})


async def _reserve(serving: Serving, call: Call, a: Admitted, size: Measured) -> Ledger:
    """Book the call's worst case: its prompt and all its completions, at the dearest model of
    its chain."""
    order = Order(
        endpoint=call.endpoint.value,
        model_requested=call.model,
        user=call.user,
        tier=a.tier,
        model=a.served.config,
        chain=call.chain(serving, a.served),
        prompt_tokens=size.n_prompt,
        counted_prompt_tokens=len(size.ids),
        completion_tokens=call.n * size.max_tokens,
    )
    with Stage(serving.tracing, "gateway.quota.reserve", {"duet.team": a.caller.team.id}):
        return await Ledger.reserve(serving.books, a.caller, order)
