"""`duet coordinator` (a coordinator replica) and `duet drain [--undo] NODE_ID`."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from coordinator.etcd_auth import add_etcd_arguments, apply_etcd_args
from duet.config_flags import add_config_flags, add_deprecated_aliases, config_kwargs
from duet.errors import UsageError
from duet.security_args import (
    add_client_arguments,
    add_server_arguments,
    plane_security,
    read_deadlines,
)
from protocol.cluster import DEFAULT_CLUSTER

COORDINATOR_HELP = """\
Run one coordinator replica: watches the nodes registered in etcd, follows every node's KV
event stream into a global prefix index, and answers POST /route with the prefill/decode pair
for a request. Run two or more replicas for availability: all of them route, one (elected in
etcd) is leader for cluster-wide actions. Also serves GET /cluster, GET /metrics, GET /health
and POST|DELETE /nodes/{id}/drain.
"""

DRAIN_HELP = """\
Mark a node draining: coordinators send it no new requests, it finishes the ones it has and,
if it runs with --exit-when-drained, deregisters and exits 0.

--undo calls a drain off — one in progress, or a finished one whose process was not stopped:
the node is routed again and its readiness probe passes. It asks the node itself (its URL from
etcd, DELETE /drain), so it needs the cluster secret (--cluster-secret-file or
$DUET_CLUSTER_SECRET_FILE). A node already stopping (SIGTERM, or drained and exiting) refuses:
exit 1. Exit codes: 0 undone (or the node was not draining), 1 refused or not found, 2 usage.
"""


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


#: old spellings of the coordinator's flags: they still work, with one warning per process. The
#: autoscaler's settings became planner.toml keys; their flags set the key (`--planner-set`).
DEPRECATED = {
    "--ttl": "--ttl-s",
    "--actuator": "--planner-set actuator=",
    "--decision-file": "--planner-set decision_file=",
    "--k8s-namespace": "--planner-set k8s_namespace=",
    "--k8s-deployment": "--planner-set k8s_deployments.",
    "--local-control": "--planner-set local_control=",
    "--node-budget": "--planner-set node_budget=",
    "--planner-profile": "--planner-set profile=",
    "--drain-deadline-s": "--planner-set drain_deadline_s=",
}

#: CoordinatorConfig fields that are no flag, and why
COORDINATOR_SKIP = {
    "policy": "the routing group (PolicyConfig, RouteWeights)",
    "security": "the cluster security group, shared with every process (duet/security_args.py)",
    "deadlines": "the slow clients group (ReadDeadlines)",
}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from coordinator.kv_reuse import KVCosts
    from coordinator.route_config import PolicyConfig, RouteWeights
    from coordinator.service import CoordinatorConfig
    from planner.cli import add_args as add_planner_args

    p = sub.add_parser(
        "coordinator",
        help="run a coordinator replica (node registry, prefix index, /route)",
        description=COORDINATOR_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_config_flags(p.add_argument_group("coordinator"), CoordinatorConfig, skip=COORDINATOR_SKIP)
    add_etcd_arguments(p.add_argument_group("etcd client"))
    groups = {
        "weights": "the route weights group (RouteWeights)",
        "kv": "the KV reuse group (KVCosts)",
    }
    add_config_flags(p.add_argument_group("routing"), PolicyConfig, skip=groups)
    route_weights = p.add_argument_group(
        "route weights",
        "A decode candidate's cost is the sum of these terms; the cheapest pair is routed to.",
    )
    add_config_flags(route_weights, RouteWeights, prefix="weight-")
    kv = p.add_argument_group(
        "KV reuse",
        "What reusing a prompt's KV costs by where it is, in prefilled prompt tokens (the "
        "route weights' unit), and whether the node computing a prompt may pull it from another "
        "node (coordinator/kv_reuse.py; measure the costs with python -m bench.kv_tiers).",
    )
    add_config_flags(kv, KVCosts, prefix="kv-")
    add_server_arguments(p)
    add_planner_args(p)
    add_deprecated_aliases(p, DEPRECATED)
    p.set_defaults(func=_run_coordinator)

    d = sub.add_parser(
        "drain",
        help="drain a node: no new routes, finish its work (see --help)",
        description=DRAIN_HELP,
        formatter_class=_Formatter,
    )
    d.add_argument("node_id", metavar="NODE_ID")
    d.add_argument("--etcd", default="http://127.0.0.1:2379", metavar="URL", help="etcd client URL")
    d.add_argument("--cluster", default=DEFAULT_CLUSTER)
    add_etcd_arguments(d)
    d.add_argument(
        "--undo",
        action="store_true",
        help="undo the node's drain: it is routed again (refused once it is stopping)",
    )
    d.add_argument("--wait", action="store_true", help="wait until the node has left the cluster")
    d.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        metavar="S",
        help="with --wait: give up after this many seconds",
    )
    add_client_arguments(d)
    add_deprecated_aliases(d, {"--timeout": "--timeout-s"})
    d.set_defaults(func=_run_drain)


def _run_coordinator(args: argparse.Namespace) -> int:
    from coordinator.kv_reuse import KVCosts
    from coordinator.route_config import PolicyConfig, RouteWeights
    from coordinator.server import run_coordinator
    from coordinator.service import CoordinatorConfig
    from coordinator.store import parse_etcd_url
    from node.request_log import setup_logging

    setup_logging(args.log_level, name="coordinator")
    try:
        given = config_kwargs(CoordinatorConfig, args)
        if "etcd" in given:
            parse_etcd_url(given["etcd"])
        apply_etcd_args(args)
        weights = RouteWeights(**config_kwargs(RouteWeights, args, prefix="weight-"))
        kv = KVCosts(**config_kwargs(KVCosts, args, prefix="kv-"))
        cfg = CoordinatorConfig(
            **given,
            policy=PolicyConfig(**config_kwargs(PolicyConfig, args), weights=weights, kv=kv),
            security=plane_security(args),
            deadlines=read_deadlines(args),
        )
        from planner.cli import from_args as planner_from_args

        planner = planner_from_args(args, cfg.security)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return run_coordinator(cfg, [planner] if planner else [])


def _run_drain(args: argparse.Namespace) -> int:

    if args.undo and args.wait:
        raise UsageError("--wait is for a drain; --undo answers once the node is routed again")
    try:
        apply_etcd_args(args)
        if args.undo:
            return asyncio.run(_undo(args, plane_security(args)))
        return asyncio.run(_drain(args))
    except ValueError as e:
        raise UsageError(str(e)) from None


async def _undo(args: argparse.Namespace, security) -> int:  # security: runtime.plane.PlaneSecurity
    import aiohttp
    import msgspec

    from coordinator.drain import NodeNotFound, undrain_node
    from coordinator.etcd_store import EtcdStore
    from coordinator.store import StoreError
    from protocol.drain import UndrainOutcome, UndrainStatus

    store = EtcdStore(args.etcd)
    try:
        async with security.client_session() as session:
            status, body, info = await undrain_node(store, args.cluster, args.node_id, session)
    except NodeNotFound:
        print(
            f"duet drain --undo: no node {args.node_id!r} is registered in cluster "
            f"{args.cluster!r}",
            file=sys.stderr,
        )
        return 1
    except (StoreError, aiohttp.ClientError, TimeoutError) as e:
        print(f"duet drain --undo: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        await store.close()
    if status == 200:
        answer = msgspec.json.decode(body, type=UndrainStatus)
        done = (
            "undrained: routed again"
            if answer.outcome == UndrainOutcome.UNDRAINED
            else "was not draining"
        )
        print(f"{answer.node_id}: {done} ({answer.role} at {info.url})", flush=True)
        return 0
    try:
        message = msgspec.json.decode(body)["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        message = body[:300].decode(errors="replace")
    hint = " (give the cluster secret: --cluster-secret-file)" if status == 401 else ""
    print(
        f"duet drain --undo: {args.node_id} at {info.url} answered {status}: {message}{hint}",
        file=sys.stderr,
    )
    return 1


async def _drain(args: argparse.Namespace) -> int:
    from coordinator.drain import NodeNotFound, drain_node, find_node
    from coordinator.etcd_store import EtcdStore
    from coordinator.store import StoreError

    store = EtcdStore(args.etcd)
    try:
        try:
            info = await drain_node(store, args.cluster, args.node_id)
        except NodeNotFound:
            print(
                f"duet drain: no node {args.node_id!r} is registered in cluster {args.cluster!r}",
                file=sys.stderr,
            )
            return 1
        print(f"{info.node_id}: draining ({info.role} at {info.url})", flush=True)
        if not args.wait:
            return 0
        deadline = time.monotonic() + args.timeout_s
        while await find_node(store, args.cluster, args.node_id) is not None:
            if time.monotonic() > deadline:
                print(
                    f"duet drain: {args.node_id} still registered after {args.timeout_s:.0f}s",
                    file=sys.stderr,
                )
                return 1
            await asyncio.sleep(0.5)  # polling interval while the node finishes its work
        print(f"{args.node_id}: left the cluster", flush=True)
        return 0
    except StoreError as e:
        print(f"duet drain: {e}", file=sys.stderr)
        return 1
    finally:
        await store.close()
