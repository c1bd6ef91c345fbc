"""The drain answer's wire: a node from before undrain (no `outcome`) still decodes, so a planner
upgraded before its nodes keeps draining them through a rolling upgrade."""

from __future__ import annotations

import msgspec

from protocol.drain import DrainOutcome, DrainStatus

OLD = b'{"node_id":"prefill-0","role":"prefill","draining":true,"inflight":0,"held":0,"idle":true}'


def test_an_answer_without_outcome_decodes_and_keeps_idle() -> None:
    s = msgspec.json.decode(OLD, type=DrainStatus)
    assert s.idle and s.draining and s.outcome is None


def test_a_new_answer_round_trips_its_outcome() -> None:
    s = msgspec.json.decode(OLD, type=DrainStatus)
    new = msgspec.structs.replace(s, outcome=DrainOutcome.IDLE)
    assert (
        msgspec.json.decode(msgspec.json.encode(new), type=DrainStatus).outcome is DrainOutcome.IDLE
    )
