"""What a booking bills when its gateway dies before settling it, in both stores.

A reservation carries its `Booked` prompt (model, tier, endpoint, prompt tokens and their cost)
as JSON. When it expires — its gateway stopped renewing it, or a restarted gateway reclaims a
dead instance's bookings — the prompt is billed with a usage record of status `expired`: a
node or a provider may already have computed it, and a team must not get a free request by
killing its gateway mid-flight. (What was streamed before the death is not known to the store:
the prompt is the floor the issue asks for.)
"""

from __future__ import annotations

import msgspec

from gateway.store.base import Booked, UsageRecord

_ENC = msgspec.json.Encoder()
#: the usage status of a booking billed at its expiry
EXPIRED = "expired"


def booked_json(b: Booked | None) -> str | None:
    return None if b is None else _ENC.encode(msgspec.to_builtins(b)).decode()


def booked_from(raw: str | None) -> Booked | None:
    if not raw:
        return None
    try:
        return msgspec.json.decode(raw, type=Booked)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # a row this version cannot read bills nothing rather than failing the sweep


def expired_record(team_id: str, key_id: str, request_id: str, b: Booked | None, now: float) -> UsageRecord | None:
    """The usage record of an expired booking (None: it booked nothing to bill)."""
    if b is None:
        return None
    return UsageRecord(request_id=request_id, team_id=team_id, key_id=key_id, model_requested=b.model,
                       model_used=b.model, tier=b.tier, status=EXPIRED, prompt_tokens=b.prompt_tokens,
                       cost_usd=b.prompt_cost_usd, endpoint=b.endpoint, created_at=now, user=b.user)  # fmt: skip
