"""`duet up`: a whole duet cluster on this machine, under one supervisor.

Starts, in order: etcd (data in $DUET_HOME/etcd), the coordinator, the prefill and decode
nodes (default: 1 prefill + 1 decode; `--prefill N --decode M`, `--colocated [N]`, or a
`--config cluster.toml` layout), each pinned to its share of the CPUs when there is at least
one CPU per node, then the OpenAI-compatible gateway on --port (default 8000), routing
through the coordinator. A development team `dev` and its API key are created on first start
and kept (with teams, keys and usage) across restarts. Once the coordinator sees every node
ready, `duet up` prints the URL, the key, and a curl and an openai snippet.

Self-healing: a process that dies (etcd, a coordinator replica, a node, the gateway) is
restarted alone, with the same ports and arguments, after an exponential backoff (1 s, 2 s,
4 s ... up to 30 s); nodes register again, coordinators rejoin the election, etcd keeps its
data directory. A process that stops answering its health URL for 60 s (hung) is killed and
restarted the same way. After --restart-max-restarts failures in a row (a life healthy for 60 s
clears the count) the process crash-loops: it stays down, is reported, and the rest keep serving.
Each death is logged with its cause; `duet status` shows restarts, last exit and backoff per
process. Tune it with the --restart-* flags or a [restart] table in cluster.toml.
A first start that fails is a crash like any other (the rest start and serve meanwhile); only a
stage none of whose processes can ever start (etcd, say) stops `duet up`, naming it with its
log's last lines.

Logs: one file per process in $DUET_HOME/logs, and a merged tail on the terminal (--quiet
turns it off). Ctrl-C or SIGTERM drains and stops everything in reverse order. `duet status`
shows the running cluster. Internal ports (etcd, coordinator, nodes) are free loopback ports
picked at start; only the gateway's port is public. `--gateways N` runs N gateway processes on
that one port (SO_REUSEPORT) and one store, so a gateway's death costs only its in-flight
requests while it is restarted (docs/operations.md, "Two gateways").
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from typing import Any

from duet.errors import UsageError
from runtime.models import REGISTRY, ModelNotFoundError, resolve_model
from runtime.ports import free_port

#: old spellings of `duet up`'s flags: they still work, with one warning per process
DEPRECATED = {
    "--startup-timeout": "--startup-timeout-s",
    "--max-restarts": "--restart-max-restarts",
    "--restart-backoff": "--restart-backoff-s",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The layout, autoscaling and process flags by hand; the cluster's settings generated from
    duet/up_config.py's UpConfig and its sections (duet/config_flags.py), each over cluster.toml's
    value where given."""
    from duet.config_flags import add_config_flags, add_deprecated_aliases
    from duet.supervisor import RestartPolicy
    from duet.up_config import CoordinatorSection, EtcdSection, GatewaySection, UpConfig

    p = sub.add_parser(
        "up",
        help="start a whole duet cluster on this machine (API on :8000; see --help)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="cluster.toml",
        help="layout file (see duet/up_config.py); the flags below win over its values",
    )
    p.add_argument(
        "--netns",
        default=None,
        metavar="PREFIX",
        help="run every process in a network namespace of its own named PREFIX-<process> (the "
        "gateways share one), joined by veth links: the layout `duet bench chaos --faults` "
        "injects network faults in; needs root and Linux; removed when duet up stops",
    )
    p.add_argument("--quiet", action="store_true", help="no merged log tail on the terminal")
    p.add_argument(
        "--startup-timeout-s",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds every stage may take to be healthy (default: 600)",
    )
    lay = p.add_argument_group("layout (without --config)")
    lay.add_argument(
        "--prefill", type=int, default=None, metavar="N", help="prefill nodes (default: 1)"
    )
    lay.add_argument(
        "--decode", type=int, default=None, metavar="M", help="decode nodes (default: 1)"
    )
    lay.add_argument(
        "--colocated",
        type=int,
        nargs="?",
        const=1,
        default=None,
        metavar="N",
        help="N nodes that prefill and decode themselves (no disaggregation)",
    )
    lay.add_argument("--pd", action="store_true", help=argparse.SUPPRESS)  # before the gateway: P+D
    lay.add_argument(
        "--embed",
        default=None,
        metavar="MODEL",
        help="also start an embedding node (`duet node --task embed`, pooling last) for MODEL, "
        "served on POST /v1/embeddings as MODEL's name (NAME-embed when the generation nodes serve "
        "the same model); see docs/embeddings.md",
    )
    skip = {
        "gateway": "the gateway group (GatewaySection)",
        "coordinator": "the coordinator group (CoordinatorSection)",
        "etcd": "the etcd group (EtcdSection)",
        "nodes": "the layout: --prefill/--decode/--colocated/--embed, or cluster.toml's [[nodes]]",
        "restart": "the restarts group (RestartPolicy)",
    }
    cluster = p.add_argument_group("cluster (a [[nodes]] group's own value wins)")
    add_config_flags(cluster, UpConfig, skip=skip)
    add_config_flags(p.add_argument_group("gateway"), GatewaySection)
    coordinator = p.add_argument_group("coordinator")
    add_config_flags(coordinator, CoordinatorSection, prefix="coordinator-")
    add_config_flags(p.add_argument_group("etcd"), EtcdSection, prefix="etcd-")
    restarts = p.add_argument_group("restarts (what a process that dies gets)")
    add_config_flags(restarts, RestartPolicy, prefix="restart-")
    a = p.add_argument_group("autoscaling (the planner in the coordinator starts and drains nodes)")
    a.add_argument(
        "--autoscale",
        action="store_true",
        help="size the P and D pools to the load: min 1 / max per role within --max-nodes; a node "
        "is drained (prefills, streams, held KV) before it is stopped",
    )
    a.add_argument(
        "--max-nodes",
        type=int,
        default=None,
        metavar="N",
        help="with --autoscale: most nodes at once (default: this machine's CPUs)",
    )
    a.add_argument(
        "--planner-config",
        default=None,
        metavar="planner.toml",
        help="with --autoscale: SLOs, pacing and bounds (planner/config.py) instead of the "
        "defaults",
    )
    add_deprecated_aliases(p, DEPRECATED)
    p.set_defaults(func=_run)


def _check_port_free(host: str, port: int) -> None:

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UsageError(
                f"cannot listen on {host}:{port} ({e.strerror}): is another duet up or server "
                "running there? Pick another with --port"
            ) from None


def build_config(args: argparse.Namespace):  # -> UpConfig
    """cluster.toml's layout (or the layout flags'), with every setting flag given over it."""
    from duet.config_flags import config_kwargs
    from duet.supervisor import RestartPolicy
    from duet.up_config import (
        CoordinatorSection,
        EtcdSection,
        GatewaySection,
        NodeGroup,
        UpConfig,
        UpConfigError,
        layout_from_flags,
        load_cluster_toml,
        validate,
    )

    try:
        if args.pd:
            print(
                "duet up: --pd is no longer needed: the default layout is 1 prefill + 1 decode "
                "node behind the gateway (see --prefill/--decode/--colocated)",
                file=sys.stderr,
            )
        if args.config:
            if args.prefill is not None or args.decode is not None or args.colocated is not None:
                raise UpConfigError(
                    "give the layout in cluster.toml or with --prefill/--decode/--colocated, not "
                    "both"
                )
            cfg = load_cluster_toml(args.config, UpConfig())
        else:
            nodes = layout_from_flags(args.prefill, args.decode, args.colocated)
            cfg = replace(UpConfig(), nodes=nodes)
        if args.embed:
            cfg = replace(cfg, nodes=(*cfg.nodes, NodeGroup(role="embed", model=args.embed)))
        section = config_kwargs(CoordinatorSection, args, "coordinator-")
        cfg = replace(
            cfg,
            **config_kwargs(UpConfig, args),
            gateway=replace(cfg.gateway, **config_kwargs(GatewaySection, args)),
            coordinator=replace(cfg.coordinator, **section),
            etcd=replace(cfg.etcd, **config_kwargs(EtcdSection, args, "etcd-")),
            restart=replace(cfg.restart, **config_kwargs(RestartPolicy, args, "restart-")),
        )
        return validate(cfg)
    except UpConfigError as e:
        raise UsageError(str(e)) from None


def _ensure_model(model: str) -> str | None:
    """The name nodes serve the model under; pulls a registry model that is missing (None when
    that fails: the error is printed)."""
    try:
        return resolve_model(model).name
    except ModelNotFoundError:
        if model not in REGISTRY:
            raise
    from engine.pull import PullError, pull  # imports torch: only when there is something to pull

    print(f"duet up: pulling {model} (first start)", file=sys.stderr, flush=True)
    try:
        pull(model, progress=lambda m: print(m, file=sys.stderr, flush=True))
    except PullError as e:
        print(f"duet up: error: {e}", file=sys.stderr)
        return None
    return resolve_model(model).name


def _toml(v: Any) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


def gateway_toml(
    cfg,
    store_url: str,
    admin_sha256: str,
    coordinators: list[str],
    served: dict[str, str],
    nodes: list[tuple[str, str, str]],
    etcd: str | None = None,
    instance_port: int | None = None,
    instance: str = "gateway",
) -> str:
    """`nodes`: (model, role, url) of every node, for static routing. `etcd`: where the gateway
    also reads the cluster, so it routes on its own (etcd's node view) while no coordinator
    replica answers — every one restarting at once — instead of failing every request.
    `instance_port`: one of several gateways on the shared port (`--gateways N`): it listens
    there with SO_REUSEPORT, and on this loopback port of its own for its health check.
    `instance`: the supervised process's name, stable across its restarts, so a restarted
    gateway reclaims its dead life's reservations as it starts."""
    gw = cfg.gateway
    static = gw.routing == "static"
    lines = [
        "# written by `duet up` on every start: edit cluster.toml or the flags instead",
        "[server]",
        f"host = {_toml(gw.host)}",
        f"port = {gw.port}",
        f"admin_key_sha256 = {_toml(admin_sha256)}",
        f"instance = {_toml(instance)}",
        *(
            ["reuse_port = true", f"instance_port = {instance_port}"]
            if instance_port is not None
            else []
        ),
        "[store]",
        f"url = {_toml(store_url)}",
        "[routing]",
        f"coordinator = {_toml([] if static else coordinators)}",
        f"cluster = {_toml(cfg.cluster)}",
    ]
    if etcd and not static:
        lines.append(f"etcd = {_toml(etcd)}")
    generation = set(cfg.generation_models())
    for model, name in served.items():
        if model not in generation:
            continue
        lines += [
            f"[models.{json.dumps(name)}]",
            'kind = "cluster"',
            f"tokenizer = {_toml(model)}",
            f"input_usd_per_mtok = {gw.input_usd_per_mtok!r}",
            f"output_usd_per_mtok = {gw.output_usd_per_mtok!r}",
        ]
        if static:
            urls = {
                r: [u for m, role, u in nodes if m == model and role == r]
                for r in ("prefill", "decode", "both")
            }
            lines.append(
                "static = { " + ", ".join(f"{r} = {_toml(u)}" for r, u in urls.items() if u) + " }"
            )
    for model in cfg.embedding_models():
        lines += [
            f"[models.{json.dumps(embedding_name(cfg, served, model))}]",
            'kind = "embedding"',
            f"tokenizer = {_toml(model)}",
            f"served_name = {_toml(served[model])}",
            f"input_usd_per_mtok = {gw.input_usd_per_mtok!r}",
        ]
        if static:
            lines.append(
                f"static = {{ both = "
                f"{_toml([u for m, role, u in nodes if m == model and role == 'embed'])} }}"
            )
    return "\n".join(lines) + "\n"


def embedding_name(cfg, served: dict[str, str], model: str) -> str:
    """The gateway's name of an embedding model: the model's own, or NAME-embed when generation
    nodes serve the same model under that name."""
    return served[model] + ("-embed" if model in cfg.generation_models() else "")


def _node_children(
    cfg, home, etcd_url: str, log, autoscale: int = 0, host=lambda name: "127.0.0.1"
):  # -> list[(Child, (model, role))]
    from duet.up_config import cpu_list, plan_cpus

    flat = [(g, i) for g in cfg.nodes for i in range(g.count)]
    avail = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    # autoscaled nodes come and go: none is pinned, each gets an even share of the machine at its
    # maximum
    plan = [None] * len(flat) if autoscale else plan_cpus(len(flat), avail)
    if autoscale:
        flat_threads = max(1, len(avail) // autoscale)
        cfg = replace(cfg, threads=cfg.threads or flat_threads)
    if plan and plan[0] is None and not autoscale:
        log(f"{len(flat)} nodes on {len(avail)} CPUs: not pinning (fewer CPUs than nodes)")
    children = []
    counters: dict[str, int] = {}
    for (g, _), cpus in zip(flat, plan, strict=True):
        k = counters[g.role] = counters.get(g.role, -1) + 1
        pinned = g.cpus or (cpu_list(cpus) if cpus else None)
        threads = g.threads or cfg_threads(cfg, cpus, len(flat), len(avail))
        children.append(
            (
                node_child(
                    cfg, home, etcd_url, g, f"{g.role}-{k}", threads, pinned, host(f"{g.role}-{k}")
                ),
                (g.model or cfg.model, g.role),
            )
        )
    return children


def node_child(
    cfg,
    home,
    etcd_url: str,
    g,
    name: str,
    threads: int,
    pinned: str | None = None,
    host: str = "127.0.0.1",
):  # -> Child
    """The supervised `duet node` process of group `g` named `name` on a free port (also how
    `duet up --autoscale` adds one, duet/up_autoscale.py)."""
    from duet.supervisor import Child

    port = free_port()
    # an embedding node has no P/D role: `--task embed` (node/embed.py)
    role = ["both", "--task", "embed", "--pooling", g.pooling] if g.role == "embed" else [g.role]
    args = [
        sys.executable,
        "-m",
        "duet",
        "node",
        "--role",
        *role,
        "--model",
        g.model or cfg.model,
        "--host",
        host,
        "--port",
        str(port),
        "--node-id",
        name,
        "--etcd",
        etcd_url,
        "--cluster",
        cfg.cluster,
        "--pool",
        g.pool,
        "--dtype",
        cfg.dtype,
        "--kv-cache-dtype",
        cfg.kv_cache_dtype,
        "--transport",
        cfg.transport,
        "--threads",
        str(threads),
    ]
    kv_blocks = g.kv_blocks if g.kv_blocks is not None else (None if g.kv_memory else cfg.kv_blocks)
    args += (
        ["--kv-blocks", str(kv_blocks)]
        if kv_blocks
        else ["--kv-memory", g.kv_memory or cfg.kv_memory]
    )
    if pinned:
        args += ["--cpus", pinned]
    # the cluster secret (duet/up_home.py::cluster_secret) exists before any child starts
    args += ["--cluster-secret-file", str(home.cluster_secret_file), *cfg.node_args, *g.args]
    return Child(name, args, home.logs / f"{name}.log", f"http://{host}:{port}/health")


def cfg_threads(cfg, cpus: list[int] | None, n_nodes: int, n_cpus: int) -> int:
    """Explicit --threads, else the node's pinned CPUs, else an even share of the machine."""
    if cfg.threads:
        return cfg.threads
    if cpus:
        return len(cpus)
    return max(1, n_cpus // max(1, n_nodes))


def _autoscale_bounds(args: argparse.Namespace, cfg, log) -> tuple[bool, int]:
    """(--autoscale on, the most nodes at once); refuses what cannot work."""

    if not args.autoscale:
        if args.max_nodes is not None or args.planner_config:
            raise UsageError("--max-nodes and --planner-config need --autoscale")
        return False, 0
    if cfg.gateway.routing == "static":
        raise UsageError(
            "--autoscale needs coordinator routing: static routing lists the nodes once, at start"
        )
    n_cpus = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    start = sum(g.count for g in cfg.nodes)
    max_nodes = args.max_nodes if args.max_nodes is not None else max(n_cpus, start)
    if max_nodes < start:
        raise UsageError(
            f"--max-nodes {max_nodes} is less than the {start} nodes the layout starts with"
        )
    if max_nodes > n_cpus:
        log(
            f"--max-nodes {max_nodes} is more than this machine's {n_cpus} CPUs: nodes will share "
            "CPUs"
        )
    return True, max_nodes


def _gateway_children(
    n: int,
    cfg,
    home,
    admin_sha256: str,
    coord_urls: list[str],
    served: dict[str, str],
    node_urls: list[tuple[str, str, str]],
    etcd_url: str,
    gw_url: str,
    secret_args: list[str],
    env: dict[str, str],
) -> list:  # -> list[Child]
    """The supervised gateway process(es). One: `gateway` on --port, as always. N > 1:
    `gateway-0` .. `gateway-{N-1}`, every one on --port with SO_REUSEPORT (the kernel spreads
    the connections; a dead one's listener leaves with it, so new connections go to the others
    while the supervisor restarts it) and on a loopback port of its own, which its health check
    uses (the shared port answers from any of them). They share one store: SQLite in WAL mode,
    whose reservations take the write lock first (`BEGIN IMMEDIATE`), so quotas stay exact
    across processes (gateway/accounts/store/sqlite.py)."""
    from duet.supervisor import Child

    if n == 1:
        home.gateway_toml.write_text(
            gateway_toml(
                cfg, home.store_url, admin_sha256, coord_urls, served, node_urls, etcd=etcd_url
            )
        )
        return [
            Child(
                "gateway",
                [
                    sys.executable,
                    "-m",
                    "duet",
                    "gateway",
                    "--config",
                    str(home.gateway_toml),
                    *secret_args,
                ],
                home.logs / "gateway.log",
                gw_url + "/health",
                env=env,
                liveness_timeout_s=cfg.restart.gateway_liveness_timeout_s,
            )
        ]
    out = []
    for i in range(n):
        port, toml = free_port(), home.gateway_toml.with_name(f"gateway-{i}.toml")
        toml.write_text(
            gateway_toml(
                cfg,
                home.store_url,
                admin_sha256,
                coord_urls,
                served,
                node_urls,
                etcd=etcd_url,
                instance_port=port,
                instance=f"gateway-{i}",
            )
        )
        out.append(
            Child(
                f"gateway-{i}",
                [sys.executable, "-m", "duet", "gateway", "--config", str(toml), *secret_args],
                home.logs / f"gateway-{i}.log",
                f"http://127.0.0.1:{port}/health",
                env=env,
                liveness_timeout_s=cfg.restart.gateway_liveness_timeout_s,
            )
        )
    return out


def gateway_count(cfg) -> int:
    """--gateways or [gateway] count, else two where the machine has the cores for them."""
    from duet.up_config import default_gateways

    if cfg.gateway.count is not None:
        return cfg.gateway.count
    return default_gateways(
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


def process_names(cfg, n_gateways: int) -> list[str]:
    """Every supervised process's name, before any is made (the namespaces need them)."""
    etcd = ["etcd"] if cfg.etcd.members == 1 else [f"etcd-{i}" for i in range(cfg.etcd.members)]
    r = cfg.coordinator.replicas
    coords = ["coordinator"] if r == 1 else [f"coordinator-{i}" for i in range(r)]
    counters: dict[str, int] = {}
    nodes = []
    for g in cfg.nodes:
        for _ in range(g.count):
            k = counters[g.role] = counters.get(g.role, -1) + 1
            nodes.append(f"{g.role}-{k}")
    gws = ["gateway"] if n_gateways == 1 else [f"gateway-{i}" for i in range(n_gateways)]
    return [*etcd, *coords, *nodes, *gws]


def etcd_children(cfg, home, host) -> tuple[list, str]:  # -> (list[Child], the clients' URL)
    """The etcd member(s) as supervised children and the URL every client is given (several
    members: all of them, comma-separated — coordinator/etcd_store.py balances over them)."""
    from coordinator.etcd_server import EtcdServer
    from duet.supervisor import Child

    n = cfg.etcd.members
    if n == 1:  # the same single-member etcd as the tests'
        s = EtcdServer(home.etcd_data, host=host("etcd"), port=free_port(), peer_port=free_port())
        return [Child("etcd", s.command(), home.logs / "etcd.log", s.health_url)], s.url
    servers = [
        EtcdServer(
            home.etcd_data / f"cluster{n}-{i}",
            host=host(f"etcd-{i}"),
            port=free_port(),
            peer_port=free_port(),
        )
        for i in range(n)
    ]
    children = [
        Child(
            f"etcd-{i}", s.command(f"etcd-{i}", servers), home.logs / f"etcd-{i}.log", s.health_url
        )
        for i, s in enumerate(servers)
    ]
    return children, ",".join(s.url for s in servers)


def _check_gateways(n: int) -> None:

    if n < 1:
        raise UsageError(f"--gateways must be at least 1, got {n}")
    if n > 1 and (not sys.platform.startswith("linux") or not hasattr(socket, "SO_REUSEPORT")):
        # elsewhere SO_REUSEPORT does not spread connections (BSD/macOS: the last listener gets
        # them)
        raise UsageError(
            "--gateways N > 1 needs Linux (SO_REUSEPORT spreads connections over the gateways); "
            "run one gateway per host behind a load balancer instead (docs/operations.md)"
        )


def _get_json(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> Any:
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=headers or {}), timeout=timeout
    ) as r:
        return json.loads(r.read())


def _banner(url: str, model: str, key: str, created: bool, home, layout: str) -> str:
    curl = (
        f"curl {url}/chat/completions \\\n  -H 'Authorization: Bearer {key}' -H 'Content-Type: "
        "application/json' \\\n"
        f'  -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Say hello"}}], '
        f'"max_tokens": 32}}\''
    )
    py = (
        "python - <<'EOF'\nfrom openai import OpenAI\n"
        f"client = OpenAI(base_url={url!r}, api_key={key!r})\n"
        f"r = client.chat.completions.create(model={model!r}, "
        "messages=[{'role': 'user', 'content': 'Say hello'}], max_tokens=32)\n"
        "print(r.choices[0].message.content)\nEOF"
    )
    return "\n".join(
        [
            "",
            f"duet is up: {layout}",
            f"  API      {url}",
            f"  model    {model}",
            f"  API key  {key}   (team 'dev'; {'created now, ' if created else ''}kept in "
            f"{home.dev_key_file})",
            f"  admin    key in {home.admin_key_file} (for /admin/teams, /admin/keys)",
            f"  logs     {home.logs}/",
            "  status   duet status     stop: Ctrl-C",
            "",
            "# try it (curl):",
            curl,
            "",
            "# or with the openai client:",
            py,
            "",
        ]
    )


def _run(args: argparse.Namespace) -> int:
    from duet.supervisor import Child, ChildState, Supervisor
    from duet.up_home import UpHome, admin_key, cluster_secret, dev_key
    from gateway.accounts.keys import hash_secret
    from runtime.cluster_secret import read_secret_file

    cfg = build_config(args)
    n_gateways = gateway_count(cfg)
    _check_gateways(n_gateways)
    if args.netns and args.autoscale:
        raise UsageError("--netns does not go with --autoscale (nodes it adds have no namespace)")
    home = UpHome.current()
    home.prepare()
    lock = home.lock()
    if lock is None:
        st = home.read_state() or {}
        raise UsageError(
            f"another duet up (pid {st.get('pid', '?')}) is running with DUET_HOME={home.root}: "
            "stop it first, or set DUET_HOME to another directory"
        )
    if not args.netns:  # a namespace's address is its own: nothing else listens there
        _check_port_free(cfg.gateway.host, cfg.gateway.port)
    pulled = {m: _ensure_model(m) for m in cfg.models()}
    served = {m: name for m, name in pulled.items() if name is not None}
    if len(served) < len(pulled):  # a pull failed (said on stderr)
        return 1

    def log(msg: str) -> None:
        print(f"duet up: {msg}", file=sys.stderr, flush=True)

    autoscale, max_nodes = _autoscale_bounds(args, cfg, log)
    key, created = dev_key(home)
    admin = admin_key(home)
    # The cluster secret (runtime/cluster_secret.py): every child gets the file's path, and
    # this process sends it on its own /cluster polls.
    secret_file = cluster_secret(home)
    secret_args = ["--cluster-secret-file", str(secret_file)]
    auth = read_secret_file(secret_file).headers
    from duet.up_netns import Netns

    try:
        net = Netns(args.netns, process_names(cfg, n_gateways))
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    atexit.register(net.close)  # however duet up ends (its finally closes it first)
    if net.lan is not None:
        cfg = replace(cfg, gateway=replace(cfg.gateway, host=net.host("gateway")))
    etcds, etcd_url = etcd_children(cfg, home, net.host)
    coords, coord_urls = [], []
    auto, control, planner_args = None, None, []
    if autoscale:
        from duet.up_autoscale import Autoscale, planner_toml, serve_control

        n_cpus = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)
        )
        auto = Autoscale(
            cfg, home, etcd_url, max_nodes, cfg.threads or max(1, n_cpus // max_nodes), 2, served
        )
        control = serve_control(auto, read_secret_file(secret_file))
        planner_file = home.root / "planner.toml"
        planner_file.write_text(planner_toml([g.role for g in cfg.nodes], max_nodes))
        planner_args = [
            "--planner",
            "load",
            "--planner-config",
            args.planner_config or str(planner_file),
            "--planner-set",
            "actuator=local",
            "--planner-set",
            f"node_budget={max_nodes}",
            "--planner-set",
            f"local_control=http://127.0.0.1:{control.server_address[1]}",
        ]
        log(
            f"autoscaling: 1 to {max_nodes - len({g.role for g in cfg.nodes}) + 1} nodes per role, "
            f"{max_nodes} at most (planner config {args.planner_config or planner_file})"
        )
    for i in range(cfg.coordinator.replicas):
        port, name = (
            free_port(),
            f"coordinator-{i}" if cfg.coordinator.replicas > 1 else "coordinator",
        )
        coord_urls.append(f"http://{net.host(name)}:{port}")
        coords.append(
            Child(
                name,
                [
                    sys.executable,
                    "-m",
                    "duet",
                    "coordinator",
                    "--etcd",
                    etcd_url,
                    "--cluster",
                    cfg.cluster,
                    "--host",
                    net.host(name),
                    "--port",
                    str(port),
                    "--replica-id",
                    f"coordinator-{i}",
                    *secret_args,
                    *planner_args,
                    *cfg.coordinator.args,
                ],
                home.logs
                / (f"coordinator-{i}.log" if cfg.coordinator.replicas > 1 else "coordinator.log"),
                coord_urls[-1] + "/health",
                # Orphaned, it would resign in an etcd that is going down with it, and
                # resigning has no time limit: it holds no state worth a clean exit.
                death_signal=signal.SIGKILL,
            )
        )
    nodes = _node_children(cfg, home, etcd_url, log, max_nodes if autoscale else 0, net.host)
    node_urls = [(m, role, c.health_url.removesuffix("/health")) for c, (m, role) in nodes]
    nodes = [c for c, _ in nodes]
    gw_host = "127.0.0.1" if cfg.gateway.host in ("0.0.0.0", "::", "") else cfg.gateway.host
    gw_url = f"http://{gw_host}:{cfg.gateway.port}"
    env = {
        k: v for k, v in os.environ.items() if k != "DUET_ADMIN_KEY"
    }  # the admin key is the file's
    gateways = _gateway_children(
        n_gateways,
        cfg,
        home,
        hash_secret(admin),
        coord_urls,
        served,
        node_urls,
        etcd_url,
        gw_url,
        secret_args,
        env,
    )
    stages = [etcds, coords, nodes, gateways]
    for c in [*etcds, *coords, *gateways]:
        net.place(c)
    for c in nodes:
        net.place(c, ucx=cfg.transport in ("nixl", "ucx"))

    state: dict[str, Any] = {
        "pid": os.getpid(),
        "started_at": time.time(),
        "ready": False,
        "home": str(home.root),
        "gateway": gw_url,
        "coordinators": coord_urls,
        "etcd": etcd_url,
        "cluster": cfg.cluster,
        "models": sorted(served.values()),
        "children": [],
        "gateways": [c.health_url.removesuffix("/health") for c in gateways],
        "netns": net.state(),
    }

    def changed(sup: Supervisor) -> None:
        """Every child started so far, with its supervision state, for `duet status`."""
        state["children"] = [c.status() for c in sup.children if c.proc is not None]
        home.write_state(state)

    def ready(sup: Supervisor) -> bool:
        """The cluster can route once a coordinator reports every node that is up ready (one
        whose first start failed is being restarted meanwhile; it registers when it is up)."""
        waited, seen, node_ids = 0.0, set(), set()
        while waited < args.startup_timeout_s:
            node_ids = {c.name for c in nodes if c.state == ChildState.RUNNING}
            try:
                info = _get_json(coord_urls[0] + "/cluster", headers=auth)
                seen = {n["node_id"] for n in info["nodes"] if n["ready"]}
                if node_ids <= seen:
                    break
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                pass
            if sup.wait(0.2):  # readiness polling interval
                return False
            waited += 0.2
        else:
            sup.say(
                f"the coordinator does not see {sorted(node_ids - seen)} ready after "
                f"{args.startup_timeout_s:.0f}s"
            )
            return False
        state["ready"] = True
        home.write_state(state)
        model = sorted(served.values())[0]
        print(_banner(gw_url + "/v1", model, key, created, home, cfg.describe()), flush=True)
        down = [c for c in sup.children if c.state != ChildState.RUNNING]
        for c in down:  # its first start failed: restarted like any crash (`duet status` shows it)
            sup.say(
                f"{c.name} is not up ({c.state}; last: {c.last_cause}); the others serve meanwhile"
            )
        sup.say(
            f"all up{' but ' + ', '.join(c.name for c in down) if down else ''}; Ctrl-C stops "
            f"everything; a process that dies is restarted (at most {cfg.restart.max_restarts} "
            "failures in a row)"
        )
        return True

    log(f"DUET_HOME={home.root}: {cfg.describe()} node(s), serving {', '.join(served.values())}")
    sup = Supervisor(
        stages,
        startup_timeout=args.startup_timeout_s,
        tail=not args.quiet,
        on_ready=ready,
        on_change=changed,
        restart=cfg.restart,
    )
    if auto is not None:
        auto.sup = sup
    try:
        return sup.run()
    finally:
        if control is not None:
            control.shutdown()
        home.clear_state()
        net.close()
        lock.close()
