"""The gateway's one store (DESIGN §4): teams, API keys, quota reservations, spend, usage, and
the batch tier's tables (batch_tables.py).

`Store` is the interface; `sqlite.SqliteStore` and `postgres.PostgresStore` implement it. Quotas are
decided *inside* the store, in one transaction per reservation, so several gateways sharing a
database share one limit.

Reservation life: `reserve()` admits a request and books its worst case (prompt + max_tokens,
and their cost); `settle()` replaces the booking with the real figures and writes the usage
record in the same transaction; a booking never settled (its gateway died) stops counting
after `expires_at`, or once its gateway's heartbeat is `reclaim`'s `dead_after_s` old, and is
billed `expired`. A request is billed once whatever happened: a booking that expired and still
settles replaces its `expired` record by the real one. Windows: RPM/TPM over the last 60 s of
reservations, budgets per UTC day and month.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import msgspec

from gateway.accounts.store.batch_tables import BatchTables

WINDOW_S = 60.0
#: what `Store.usage` groups by; its rows name the group `model`, `date`, `team_id`, `tier`,
#: `user`, `adapter`, `version`
GROUP_BY = ("model", "day", "team", "tier", "user", "adapter", "version")
LimitKind = Literal["requests", "tokens", "concurrency", "daily_budget", "monthly_budget"]


class UsageKey(StrEnum):
    """Whether a usage record's `request_id` is a key the same request may be billed under
    again, and what a second record under it does (usage_keys.py decides, in both stores)."""

    #: a request id of its own: the record is written as it is
    NONE = "none"
    #: the same work reruns under the id (a batch line after a crash or a recorded retry): the
    #: last settled record replaces the key's earlier one, whatever that was
    RERUN = "rerun"
    #: a client's retry under its `Idempotency-Key` (the id is derived from its team and the
    #: key): the record replaces the key's earlier one only if that was `expired` — its attempt
    #: died with its gateway — within `usage_keys.WINDOW_S`; else it is billed beside it (a key
    #: whose request was answered is no free pass)
    RETRY = "retry"


class Team(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    daily_budget_usd: float | None = None
    monthly_budget_usd: float | None = None
    default_tier: Literal["interactive", "batch"] = "interactive"
    created_at: float = 0.0
    #: its share of a saturated tier (gateway/serving/fair_queue.py); None: gateway.toml's
    #: `[teams.<id>] weight`
    weight: float | None = None


#: the usage table's columns, in the order both stores write and read a record's
#: fields
USAGE_COLS = (
    "request_id",
    "team_id",
    "key_id",
    "model_requested",
    "model_used",
    "tier",
    "status",
    "endpoint",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cost_usd",
    "ttft_s",
    "latency_s",
    "nodes",
    "created_at",
    "user",
    "migrations",
    "leg_tokens",
    "queue_s",
    "adapter",
    "version",
    "cache_write_tokens",
)


#: the teams table's columns, in `team_values`' order: both stores read and write teams by it
TEAM_COLS = (
    "id, rpm, tpm, max_concurrent, daily_budget_usd, monthly_budget_usd, default_tier, "
    "created_at, weight"
)
#: how many columns a team's row has
N_TEAM_COLS = len(TEAM_COLS.split(","))


def team_values(t: Team) -> tuple[object, ...]:
    """`t`'s columns in `TEAM_COLS`' order (the teams table)."""
    return (
        t.id,
        t.rpm,
        t.tpm,
        t.max_concurrent,
        t.daily_budget_usd,
        t.monthly_budget_usd,
        t.default_tier,
        t.created_at,
        t.weight,
    )


class ApiKey(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    team_id: str
    name: str = ""
    #: the first characters of the secret, for operators to tell keys apart
    prefix: str = ""
    created_at: float = 0.0
    revoked_at: float | None = None


@dataclass(frozen=True)
class Booked:
    """What a reservation bills if its gateway dies before settling it: the prompt, which a node
    or a provider may already be computing, and the completion tokens its stream had sent as of
    the gateway's last heartbeat, at `completion_usd_per_mtok` (the usage record it then gets
    says `expired`; expiry.py)."""

    model: str
    tier: str
    endpoint: str
    prompt_tokens: int
    prompt_cost_usd: float
    #: USD per million completion tokens, the caller's price factor applied: the store prices
    #: the streamed tokens without the config (0 in a booking an older version wrote)
    completion_usd_per_mtok: float = 0.0
    #: the request id is a usage key (`Settlement.key` is not NONE)
    idempotent: bool = False
    #: the request's OpenAI `user` field, kept on the `expired` record like on any other (spend
    #: per end user; a client matches its records by it)
    user: str | None = None
    #: the LoRA adapter the request ran with (None: a base model)
    adapter: str | None = None


@dataclass(frozen=True)
class ReserveRequest:
    team_id: str
    key_id: str
    request_id: str
    tokens: int
    cost_usd: float
    ttl_s: float
    now: float = field(default_factory=time.time)
    #: the gateway instance that holds the booking (its heartbeat keeps it alive)
    gateway_id: str = ""
    #: billed if the booking expires unsettled (None: nothing)
    booked: Booked | None = None
    #: the team's concurrency bound when its own `max_concurrent` is unset (`[quotas]
    #: default_max_concurrent`; None or 0: none)
    default_max_concurrent: int | None = None


@dataclass(frozen=True)
class RateState:
    """What the x-ratelimit-* headers report, as of the reservation."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float = 0.0
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float = 0.0


@dataclass(frozen=True)
class Refusal:
    kind: LimitKind
    message: str
    retry_after_s: float
    rate: RateState


@dataclass(frozen=True)
class Reservation:
    id: str
    rate: RateState


@dataclass
class UsageRecord:
    request_id: str
    team_id: str
    key_id: str
    model_requested: str
    model_used: str
    tier: str
    status: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost_usd: float = 0.0
    ttft_s: float | None = None
    latency_s: float = 0.0
    nodes: list[str] = field(default_factory=list)
    endpoint: str = ""
    created_at: float = field(default_factory=time.time)
    #: the request's OpenAI `user` field: the caller's own end user, for attributing spend
    user: str | None = None
    #: times the stream moved to another node mid-stream (its decode node died)
    migrations: int = 0
    #: completion tokens of each decode leg, in order (`nodes` lists every leg's nodes)
    leg_tokens: list[int] = field(default_factory=list)
    #: its wait for a tier admission slot (None: it took none — refused, or an external model)
    queue_s: float | None = None
    #: the LoRA adapter the model it ended on runs with (None: a base model; config_adapters.py)
    adapter: str | None = None
    #: the version of the model that served it (None: the model has no versions, or no node
    #: was reached; gateway/config_versions.py)
    version: str | None = None
    #: prompt tokens this request computed and wrote to the prefix cache to keep: the prefix
    #: its `cache_control` marks, in whole KV blocks, less what it read from the cache
    #: (Anthropic's `cache_creation_input_tokens`, billed at the cache write price; 0 in a
    #: record an older version wrote)
    cache_write_tokens: int = 0


@dataclass(frozen=True)
class Settlement:
    """Replace reservation `reservation_id` (None: nothing was booked) by `record`'s figures."""

    reservation_id: str | None
    record: UsageRecord
    #: tokens the request keeps in the team's TPM window (None: prompt + completion); a
    #: request no node ever served keeps none
    window_tokens: int | None = None
    #: whether the record's `request_id` is a key the request may be billed under again (a
    #: batch line's rerun, a client's retry): the store keeps the key's billed record in
    #: `usage_keys`, a later settled record replaces it as `UsageKey` says (its spend taken
    #: back), and an expired booking's record never replaces one
    key: UsageKey = UsageKey.NONE

    @property
    def tokens(self) -> int:
        r = self.record
        return (
            r.prompt_tokens + r.completion_tokens
            if self.window_tokens is None
            else self.window_tokens
        )


class Store(BatchTables):
    """The gateway's one store: teams, keys, quotas, spend and usage (below), and the batch
    tier's files, batches and request rows (`BatchTables`), behind one interface, on one
    database — SQLite or PostgreSQL, one pool or one worker thread per file, one locking
    strategy for all of it."""

    @abstractmethod
    async def open(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    # teams and keys
    @abstractmethod
    async def create_team(self, team: Team) -> Team: ...

    @abstractmethod
    async def get_team(self, team_id: str) -> Team | None: ...

    @abstractmethod
    async def list_teams(self) -> list[Team]: ...

    @abstractmethod
    async def update_team(self, team: Team) -> Team | None:
        """Set the team's limits and default tier (its id and creation time stay); None when
        there is no such team."""

    @abstractmethod
    async def delete_team(self, team_id: str) -> bool:
        """Delete the team and revoke its keys; its usage records stay."""

    @abstractmethod
    async def create_key(self, key: ApiKey, secret_hash: str) -> ApiKey: ...

    @abstractmethod
    async def key_by_hash(self, secret_hash: str) -> tuple[ApiKey, Team] | None:
        """The live (not revoked) key with this hash and its team."""

    @abstractmethod
    async def list_keys(self, team_id: str | None = None) -> list[ApiKey]: ...

    @abstractmethod
    async def revoke_key(self, key_id: str) -> bool: ...

    # quotas
    @abstractmethod
    async def reserve(self, req: ReserveRequest) -> Reservation | Refusal: ...

    @abstractmethod
    async def settle(self, batch: list[Settlement]) -> None:
        """Settle reservations and write their usage records, all in one transaction."""

    def settle_now(self, batch: list[Settlement]) -> bool:
        """`settle(batch)` done before returning, if this store can without waiting (True);
        False when it cannot (then nothing was written: call `settle`). The default cannot."""
        return False

    @abstractmethod
    async def expire_reservations(self, now: float | None = None) -> int:
        """Drop bookings past their expiry (their gateway stopped renewing them), billing each
        one's booked prompt and streamed tokens with an `expired` usage record."""

    @abstractmethod
    async def heartbeat(
        self,
        gateway_id: str,
        ttl_s: float,
        now: float | None = None,
        streamed: Mapping[str, int] | None = None,
    ) -> float | None:
        """Gateway `gateway_id` is alive: its heartbeat row is now — the time the row is
        written, not the time of the call (a call that waited for the store must not land
        stale) — and every booking it holds expires `ttl_s` from then at the earliest (a
        request outliving the TTL still counts). `streamed`: reservation id → completion tokens
        its stream has sent so far, kept on the booking (never lowered) and billed if the
        booking expires; bookings not named keep their count. Returns the seconds since this
        gateway's previous heartbeat (None: its first): how long the store could not hear it."""

    @abstractmethod
    async def reclaim(
        self, dead_after_s: float, now: float | None = None, gateway_id: str | None = None
    ) -> int:
        """Expire (and bill) every booking of gateways whose heartbeat is older than
        `dead_after_s` — a killed gateway's, its own previous life's included — and forget them;
        never those of `gateway_id`, the caller's own (a gateway that reclaims is alive, however
        late its own heartbeat was). Each `expired` record is keyed by its request id: if the
        request settles after all, its real record replaces the expired one."""

    @abstractmethod
    async def reclaim_previous(
        self, instance: str, gateway_id: str, now: float | None = None
    ) -> int:
        """Expire (and bill) every booking of an earlier life of gateway `instance` — ids
        `instance/…` other than `gateway_id`, the starting life's own — and forget those lives:
        a restarted gateway frees its team slots as it starts, not 2.5 heartbeats later."""

    @abstractmethod
    async def leave(self, gateway_id: str) -> None:
        """A gateway stops cleanly: its heartbeat row goes (its bookings were settled)."""

    # usage
    @abstractmethod
    async def usage(
        self, team_id: str | None, start: float, end: float, group_by: str | None
    ) -> list[dict[str, Any]]:
        """Totals: one row (group_by None) or one row per group, ordered by it, nulls first; each
        with its requests, tokens, cost and TTFT percentiles, all computed by the database
        (usage_totals.py), so the answer's size is the number of groups, not of records."""

    @abstractmethod
    async def usage_records(
        self,
        team_id: str | None,
        start: float,
        end: float,
        after: tuple[float, str] | None = None,
        limit: int | None = None,
    ) -> list[UsageRecord]:
        """The range's records in (created_at, request_id) order; `after` (a record's
        (created_at, request_id)) and `limit`: one page of them, the next one starting after
        the last record of this one."""

    @abstractmethod
    async def usage_outliers(
        self, team_id: str | None, start: float, end: float, limit: int
    ) -> list[UsageRecord]:
        """The range's failed requests and its slowest tenth (usage_totals.outliers_sql), newest
        first, at most `limit`: found by the database, so only they leave it."""


class StoreError(Exception):
    """A conflict or a missing row the caller can explain (409/404)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
