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
  was `expired` within `WINDOW_S` (the attempt died with its gateway; the retry is what the
  client got), and is billed beside any other: a key whose request was answered, or one used
  again after the window, is no free pass.

A record never replaces another team's (a client's key is derived from its team: another
team's same key is another key; this is the guard behind that).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from gateway.accounts.store.base import UsageKey
from gateway.accounts.store.expiry import EXPIRED

#: how long a client's retry may replace its dead attempt's `expired` record (seconds): a day,
#: as Stripe keeps idempotency keys
WINDOW_S = 86400.0


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
    if earlier.status == EXPIRED and now - earlier.billed_at <= WINDOW_S:
        return Verdict.REPLACE
    return Verdict.BESIDE
