"""A client's `Idempotency-Key` header: the attempts of one request are billed once.

A client that sends a request again after its first attempt got no answer (the connection was
refused or reset: the gateway it reached died) cannot know whether that attempt was billed. The
gateway it reached did book it, and the gateway that reclaims the dead one's bookings bills it
`expired` (its prompt, and what it had streamed: store/expiry.py). With the header, every
attempt of the request runs under one request id derived from the caller's team and the key,
and that id is the request's usage key (store/usage_keys.py, `UsageKey.RETRY`): the attempt
that settles replaces the dead attempt's `expired` record, and an `expired` record never
replaces a settled one — one record, whatever the order.

Invariants:
- The id is a hash of (team, key): another team's same key is another id, so no team can reach
  another's records; the key itself is never stored or logged.
- A key is no free pass: a record under a key replaces only an `expired` one, billed within
  `usage_keys.WINDOW_S`; an attempt that ran while another was answered is billed beside it.
- Every attempt is a request of its own on the nodes (`Caller.leg_id`): a retry that reaches a
  node still running the dead attempt is not refused for its id.
"""

from __future__ import annotations

import hashlib

from gateway.accounts.ledger import Caller
from gateway.accounts.store.base import ApiKey, Team, UsageKey
from protocol.openai import APIError

#: the request header (Stripe's and OpenAI's name; HTTP headers are case-insensitive)
HEADER = "Idempotency-Key"
#: the longest key accepted (characters), as Stripe's
MAX_LENGTH = 255


def keyed_request_id(team_id: str, key: str) -> str:
    """The request id of every attempt under `key` from `team_id`."""
    digest = hashlib.sha256(f"{team_id}\0{key}".encode()).hexdigest()
    return f"req-{digest[:32]}"


def _check(key: str) -> None:
    if not 0 < len(key) <= MAX_LENGTH or not all(" " <= c <= "~" for c in key):
        raise APIError(
            400,
            f"the {HEADER} header must be 1 to {MAX_LENGTH} printable ASCII characters",
            param=HEADER,
            code="invalid_idempotency_key",
        )


def caller_of(key: ApiKey, team: Team, request_id: str, t0: float, header: str | None) -> Caller:
    """The caller of a request: under the gateway's own `request_id`, or — with an
    `Idempotency-Key` header (`header`: its value) — under the key's id, as a usage key."""
    if header is None:
        return Caller(key, team, request_id, t0)
    _check(header)
    return Caller(key, team, keyed_request_id(team.id, header), t0, usage_key=UsageKey.RETRY)
