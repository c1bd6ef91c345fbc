"""`duet coordinator` (a coordinator replica) and `duet drain [--undo] NODE_ID`."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from coordinator.etcd_auth import add_etcd_arguments, apply_etcd_args
from duet.security_args import (
    add_client_arguments,
    add_server_arguments,
    plane_security,
    read_deadlines,
)
from protocol.cluster import DEFAULT_CLUSTER, NODE_TTL_S

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


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "coordinator",
        help="run a coordinator replica (node registry, prefix index, /route)",
        description=COORDINATOR_HELP,
        formatter_class=_Formatter,
    )
    p.add_argument("--etcd", default="http://127.0.0.1:2379", metavar="URL", help="etcd client URL")
    p.add_argument(
        "--cluster", default=DEFAULT_CLUSTER, help="cluster name (etcd key prefix /duet/NAME/)"
    )
    add_etcd_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--advertise-url", default=None, help="URL gateways use to reach this replica")
    p.add_argument(
        "--replica-id", default=None, help="replica name (default: coordinator-HOSTNAME-PORT)"
    )
    r = p.add_argument_group("routing")
    r.add_argument(
        "--index-max-blocks",
        type=int,
        default=1_000_000,
        help="memory bound of the prefix index (block hashes; least recently matched go first)",
    )
    r.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=256,
        help="prefill on the decode node when fewer prompt tokens than this are uncached there",
    )
    r.add_argument(
        "--prefill-saturation-tokens",
        type=int,
        default=8192,
        help="a prefill node with this many prompt tokens queued is saturated",
    )
    r.add_argument(
        "--stale-load-s",
        type=float,
        default=2.0,
        help="a node whose last load report is older than this gets no new routes",
    )
    p.add_argument("--ttl", type=int, default=NODE_TTL_S, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="INFO")
    add_server_arguments(p)
    from planner.cli import add_args as add_planner_args

    add_planner_args(p)
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
        "--timeout", type=float, default=600.0, help="with --wait: give up after this many seconds"
    )
    add_client_arguments(d)
    d.set_defaults(func=_run_drain)


def _run_coordinator(args: argparse.Namespace) -> int:
    from coordinator.policy import PolicyConfig
    from coordinator.server import run_coordinator
    from coordinator.service import CoordinatorConfig
    from coordinator.store import parse_etcd_url
    from duet.cli import UsageError
    from node.request_log import setup_logging

    setup_logging(args.log_level, name="coordinator")
    try:
        parse_etcd_url(args.etcd)
        apply_etcd_args(args)
        policy = PolicyConfig(
            local_prefill_tokens=args.local_prefill_tokens,
            prefill_saturation_tokens=args.prefill_saturation_tokens,
            stale_load_s=args.stale_load_s,
        )
        cfg = CoordinatorConfig(
            etcd=args.etcd,
            cluster=args.cluster,
            host=args.host,
            port=args.port,
            replica_id=args.replica_id,
            advertise_url=args.advertise_url,
            index_max_blocks=args.index_max_blocks,
            ttl=args.ttl,
            policy=policy,
            security=plane_security(args),
            deadlines=read_deadlines(args),
        )
        from planner.cli import from_args as planner_from_args

        planner = planner_from_args(args, cfg.security)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return run_coordinator(cfg, [planner] if planner else [])


def _run_drain(args: argparse.Namespace) -> int:
    from duet.cli import UsageError

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
            f"duet drain --undo: no node {args.node_id!r} is registered in cluster {args.cluster!r}",
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
        deadline = time.monotonic() + args.timeout
        while await find_node(store, args.cluster, args.node_id) is not None:
            if time.monotonic() > deadline:
                print(
                    f"duet drain: {args.node_id} still registered after {args.timeout:.0f}s",
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
