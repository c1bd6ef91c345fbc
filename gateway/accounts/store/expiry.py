"""What a booking bills when its gateway dies before settling it, in both stores.

A reservation carries its `Booked` prompt (model, tier, endpoint, prompt tokens and their cost,
the completion price) as JSON, and the completion tokens its stream had sent as of its
gateway's last heartbeat (`streamed_tokens`: each heartbeat reports them, base.Store.heartbeat).
When it expires — its gateway stopped renewing it, or a restarted gateway reclaims a dead
instance's bookings — it is billed with a usage record of status `expired`: the prompt (a node
or a provider may already have computed it) plus the streamed tokens at the booked completion
price (the client has them), so a team gets neither a free request nor a free stream by
killing its gateway mid-flight. Tokens streamed after the last heartbeat (at most `heartbeat_s`
of streaming) are not known to the store and go unbilled: the record is a floor.
"""

from __future__ import annotations

from enum import Enum

import msgspec

from gateway.accounts.store.base import Booked, UsageRecord

_ENC = msgspec.json.Encoder()
#: the usage status of a booking billed at its expiry
EXPIRED = "expired"


class Booking(Enum):
    """What a settlement found of its booking."""

    #: booked and settled now, or nothing was booked: its record is written as it is
    SETTLED = "settled"
    #: booked, and gone: expired (billed `expired` under its request id), so its real record
    #: replaces that one through the key
    GONE = "gone"
    #: gone because this very settlement committed already (a retry after a commit whose answer
    #: was lost): its record is there, exactly; nothing more is written
    RECORDED = "recorded"


def booked_json(b: Booked | None) -> str | None:
    return None if b is None else _ENC.encode(msgspec.to_builtins(b)).decode()


def booked_from(raw: str | None) -> Booked | None:
    if not raw:
        return None
    try:
        return msgspec.json.decode(raw, type=Booked)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # a row this version cannot read bills nothing rather than failing the sweep


def expired_record(
    team_id: str, key_id: str, request_id: str, b: Booked | None, now: float, streamed: int = 0
) -> UsageRecord | None:
    """The usage record of an expired booking that had streamed `streamed` completion tokens
    (as of its gateway's last heartbeat); None: it booked nothing to bill."""
    if b is None:
        return None
    streamed = max(streamed or 0, 0)
    return UsageRecord(
        request_id=request_id,
        team_id=team_id,
        key_id=key_id,
        model_requested=b.model,
        model_used=b.model,
        tier=b.tier,
        status=EXPIRED,
        prompt_tokens=b.prompt_tokens,
        completion_tokens=streamed,
        cost_usd=b.prompt_cost_usd + streamed * b.completion_usd_per_mtok / 1e6,
        endpoint=b.endpoint,
        created_at=now,
        user=b.user,
        adapter=b.adapter,
    )
