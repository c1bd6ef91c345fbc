"""The node's drain endpoint (`GET|POST|DELETE /drain` on every node): the wire answers.

`POST /drain` asks the node to drain (the same as `duet drain`: no new routes, finish in-flight
work, keep KV held for decode nodes until it is pulled or its lease runs out); `?wait=S` answers
once the node is idle, once the drain was undone, or after S seconds. `GET /drain` only reads.
The planner's actuators and a Kubernetes pod's preStop hook call it before the pod or process is
stopped. `DELETE /drain` undoes a drain (`duet drain --undo`, an actuator whose scale-in failed
after the drain): the node is routed again — refused (409) once the node is stopping.
"""

from __future__ import annotations

import enum

import msgspec


class DrainOutcome(enum.StrEnum):
    """Where a node's drain stands, as one `GET|POST /drain` answer saw it."""

    #: no drain asked, or it was undone: the node is routed
    ACTIVE = "active"
    #: asked, but work remains (or it is not yet known to every router); a `?wait=` ran out
    DRAINING = "draining"
    #: draining and nothing in flight nor held: safe to stop
    IDLE = "idle"
    #: this `POST /drain?wait=` call's drain was undone (`DELETE /drain`) while it waited: the
    #: node is routed again and must not be stopped
    CANCELLED = "cancelled"


class DrainStatus(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    role: str
    #: a drain was asked (POST /drain, etcd, or SIGTERM's grace period)
    draining: bool
    #: requests in flight on this node (prefill and decode legs, streams)
    inflight: int
    #: finished prefills whose KV blocks wait for a decode node's pull (or their lease)
    held: int
    #: draining and nothing in flight nor held: safe to stop
    idle: bool
    #: None from a node older than undrain (the field is new; readers go by `draining`/`idle`,
    #: so a planner upgraded before its nodes still reads their answers during a rolling upgrade)
    outcome: DrainOutcome | None = None


class UndrainOutcome(enum.StrEnum):
    """What `DELETE /drain` did (a node that is stopping answers 409 instead)."""

    #: a drain (in progress or finished) was called off: the node is routed again
    UNDRAINED = "undrained"
    #: there was no drain to undo (undo is idempotent)
    NOT_DRAINING = "not_draining"


class UndrainStatus(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    role: str
    outcome: UndrainOutcome
