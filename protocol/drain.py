"""The node's drain endpoint (`GET|POST /drain` on every node): the wire answer.

`POST /drain` asks the node to drain (the same as `duet drain`: no new routes, finish in-flight
work, keep KV held for decode nodes until it is pulled or its lease runs out); `?wait=S` answers
once the node is idle or after S seconds. `GET /drain` only reads. The planner's actuators and a
Kubernetes pod's preStop hook call it before the pod or process is stopped.
"""

from __future__ import annotations

import msgspec


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
