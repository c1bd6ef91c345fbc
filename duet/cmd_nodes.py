"""`duet prefill`, `duet decode`, `duet node`: run one node process."""

from __future__ import annotations

import argparse

from node.config import DEFAULT_ALLOWED_PEERS
from protocol.models import DEFAULT_MODEL

ROLE_HELP = {
    "prefill": ("prefill node: computes prompts' KV and holds it for decode nodes", 8100),
    "decode": ("decode node: pulls KV from prefill nodes and streams tokens", 8200),
    "node": ("a node of any role; --role both runs prefill and decode in one engine "
             "(colocated, the baseline for disaggregation)", 8300),
}  # fmt: skip


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name, (what, port) in ROLE_HELP.items():
        p = sub.add_parser(name, help=what, description=what + ". Serves the internal node API: "
                           "POST /v1/completions, GET /kv/metadata, POST /kv/release, POST /abort, "
                           "GET /kv/snapshot, GET /health, GET /metrics.",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
        if name == "node":
            p.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
        add_node_arguments(p, port)
        p.set_defaults(func=_run, fixed_role=None if name == "node" else name)


def add_node_arguments(p: argparse.ArgumentParser, port: int) -> None:
    g = p.add_argument_group("serving")
    g.add_argument("--model", default=DEFAULT_MODEL, help="registry name, .gguf file or HF directory")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=port)
    g.add_argument("--advertise-host", default=None, help="address peers use to reach this node")
    g.add_argument("--node-id", default=None, help="stable id (default: ROLE-HOSTNAME-PORT)")
    g.add_argument("--log-level", default="INFO")
    e = p.add_argument_group("engine")
    e.add_argument("--kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-memory)")
    e.add_argument("--kv-memory", default="1GiB", help="KV pool size in bytes, e.g. 512MiB")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    e.add_argument("--max-num-seqs", type=int, default=128, help="sequences running at once")
    e.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    e.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    e.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    e.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    e.add_argument("--cpus", default=None, help="pin to these CPUs, e.g. 0-3,8")
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--engine", choices=["native"], default="native",
                   help="engine behind the node API (native: this repo's paged-KV engine)")  # fmt: skip
    e.add_argument("--max-waiting-requests", type=int, default=256,
                   help="backpressure: queued requests beyond which new ones get 503 + Retry-After")  # fmt: skip
    e.add_argument("--max-waiting-tokens", type=int, default=262144,
                   help="backpressure: queued prompt tokens beyond which new requests get 503 + Retry-After")  # fmt: skip
    t = p.add_argument_group("disaggregation")
    t.add_argument("--transport", choices=["nixl", "ucx", "tcp"], default="nixl",
                   help="KV transport (nixl falls back to tcp when NIXL is missing)")  # fmt: skip
    t.add_argument("--lease-seconds", type=float, default=30.0, help="prefill: how long held KV waits for a pull")
    t.add_argument("--transfer-timeout", type=float, default=10.0, help="decode: limit for one KV pull")
    t.add_argument("--failure-policy", choices=["recompute", "fail"], default="recompute",
                   help="decode: on a failed pull, prefill locally or fail the request")  # fmt: skip
    t.add_argument("--reserve-timeout", type=float, default=30.0,
                   help="decode: seconds to wait for KV blocks for a pull before answering 503")  # fmt: skip
    t.add_argument("--allowed-peers", default=DEFAULT_ALLOWED_PEERS,
                   help="decode: CIDR list of the prefill nodes this node may contact; a request naming "
                        "another address is refused (403) without any connection. The default is "
                        "loopback and the private ranges (RFC 1918, IPv6 ULA): never public or "
                        "link-local (cloud metadata) addresses")  # fmt: skip
    t.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    c = p.add_argument_group("cluster")
    c.add_argument("--etcd", default=None, metavar="URL",
                   help="register with this etcd (e.g. http://10.0.0.2:2379); without it the node runs standalone")
    c.add_argument("--cluster", default="default", help="cluster name (etcd key prefix /duet/NAME/)")
    c.add_argument("--pool", default="shared", choices=["shared", "interactive", "batch"],
                   help="routing pool: interactive/batch requests prefer their pool, then shared")
    c.add_argument("--exit-when-drained", action="store_true",
                   help="after `duet drain`, finish in-flight work, deregister and exit 0")  # fmt: skip


def node_config(args: argparse.Namespace, role: str):
    from coordinator.store import parse_etcd_url
    from engine.config import EngineConfig
    from node.config import NodeConfig

    if args.etcd:
        parse_etcd_url(args.etcd)  # a typo is a usage error now, not a registration retry loop

    engine = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_kv_blocks=args.kv_blocks, kv_memory=args.kv_memory, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching, threads=args.threads,
        max_waiting_requests=args.max_waiting_requests, max_waiting_tokens=args.max_waiting_tokens,
        record_kv_events=bool(args.etcd),  # coordinators read them through GET /kv/events
    )  # fmt: skip
    return NodeConfig(
        role=role, host=args.host, port=args.port, advertise_host=args.advertise_host,
        node_id=args.node_id, engine=engine, transport=args.transport,
        lease_seconds=args.lease_seconds, transfer_timeout=args.transfer_timeout,
        failure_policy=args.failure_policy, grace_period=args.grace_period, cpus=args.cpus,
        engine_kind=args.engine, reserve_timeout=args.reserve_timeout, allowed_peers=args.allowed_peers,
        etcd=args.etcd, cluster=args.cluster, pool=args.pool, exit_when_drained=args.exit_when_drained,
    )  # fmt: skip


def role_registrations(role: str) -> list:
    """The composition root's choice of roles: what `register(roles)` each node role runs."""
    import decode
    import prefill

    return {"prefill": [prefill.register], "decode": [decode.register],
            "both": [prefill.register, decode.register]}[role]  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    from duet.cli import UsageError
    from node.request_log import setup_logging
    from node.server import run_node

    role = args.fixed_role or args.role
    setup_logging(args.log_level, name=role)
    try:
        cfg = node_config(args, role)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        return run_node(cfg, role_registrations(role))
    except ValueError as e:  # engine sizing errors: pool too small, bad dtype...
        raise UsageError(str(e)) from None
