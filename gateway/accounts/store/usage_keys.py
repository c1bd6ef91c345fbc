"""Usage keys: how a request whose work may run more than once is billed once, in both stores.

A usage record written under a key (`Settlement.key` is not NONE, or an expired booking's: its
request id is always a key) takes the key's row in `usage_keys`: the record it points to (team,
creation time, cost) and when it was billed. A second record under the key is judged here
(`verdict`), and the store carries it out in the same transaction, under the key's lock (the
SQLite write lock; the row's lock in PostgreSQL):

- an `expired` record (a booking whose gateway died) never replaces one: the key is billed;
- a batch line's rerun (`RERUN`) replaces the earlier record, whose spend is taken back: the
  line pays for the run that gave its result;
- a client's retry (`RETRY`, its `Idempotency-Key`) replaces the earlier record only if that
  attempt gave the client nothing, within `WINDOW_S`: it was `expired` (it died with its
  gateway) or refused before its first token (`error`, `shed`: no capacity, a node that failed
  before answering) — the retry is what the client got. It is billed beside any other: a key
  whose request was answered (even in part, or cut by the client), or one used again after the
  window, is no free pass.

A record never replaces another team's (a client's key is derived from its team: another
team's same key is another key; this is the guard behind that).

A key is kept `RETAIN_S` after it was last billed, then pruned: each keyed write deletes at
most `PRUNE_PER_WRITE` keys past that age (`PRUNE_SQL`, on the `billed_at` index), so the table
holds about the keys of the last `RETAIN_S` whatever the traffic, with no sweep of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from gateway.accounts.store.base import UsageKey
from gateway.accounts.store.expiry import EXPIRED

#: how long a client's retry may replace its dead attempt's `expired` record (seconds): a day,
#: as Stripe keeps idempotency keys
WINDOW_S = 86400.0
#: the statuses of an attempt that delivered nothing a retry may replace (the ledger's
#: `UsageStatus` values, and `EXPIRED`)
GAVE_NOTHING = frozenset({EXPIRED, "error", "shed"})
#: how long a key is kept after its last billing (seconds): longer than a batch lives (30 days
#: at most: a line may be rerun until then and must find its key) and than `WINDOW_S`
RETAIN_S = 31 * 86400.0
#: keys past `RETAIN_S` a keyed write deletes: more than the one it adds, so a backlog drains
PRUNE_PER_WRITE = 4
#: the prune (both dialects; `?` placeholders, PostgreSQL's written in by the caller): keys
#: another transaction holds are skipped there, so two gateways pruning never wait on each other
PRUNE_SQL = (
    "DELETE FROM usage_keys WHERE request_id IN (SELECT request_id FROM usage_keys "
    "WHERE billed_at < ? ORDER BY billed_at LIMIT ?{lock})"
)


class Verdict(Enum):
    #: the key is new: write the record, the key is its
    WRITE = "write"
    #: take the earlier record and its spend back, write this one in its place
    REPLACE = "replace"
    #: write this one beside the earlier one; the key is this one's from now on
    BESIDE = "beside"
    #: write nothing: the key is billed already
    SKIP = "skip"


@dataclass(frozen=True)
class Earlier:
    """The record the key points to."""

    team_id: str
    billed_at: float
    #: its status (None: not known, or not looked up — only a client's retry needs it)
    status: str | None = None


def mode_of(key: UsageKey, gone: bool) -> UsageKey:
    """The key a settlement writes under: its own, or — its booking expired before it settled,
    billed `expired` under its request id — RERUN, so its real record replaces that one."""
    if key is UsageKey.NONE and gone:
        return UsageKey.RERUN
    return key


def needs_status(mode: UsageKey, status: str) -> bool:
    """Whether `verdict` reads the earlier record's status (a store looks it up only then)."""
    return mode is UsageKey.RETRY and status != EXPIRED


def verdict(
    mode: UsageKey, team_id: str, status: str, earlier: Earlier | None, now: float
) -> Verdict:
    """What a record of `team_id` with `status`, under a key whose record is `earlier`, does."""
    if earlier is None:
        return Verdict.WRITE
    if status == EXPIRED:
        return Verdict.SKIP
    if earlier.team_id != team_id:
        return Verdict.BESIDE
    if mode is UsageKey.RERUN:
        return Verdict.REPLACE
    if earlier.status in GAVE_NOTHING and now - earlier.billed_at <= WINDOW_S:
        return Verdict.REPLACE
    return Verdict.BESIDE
