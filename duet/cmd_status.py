"""`duet status`: the cluster at a glance — nodes, roles, pools, load, KV use, the leader, and
(for a `duet up` cluster) the supervised processes.

Without flags it reads `$DUET_HOME/up/state.json`, written by the running `duet up`; with
`--coordinator URL[,URL]` it asks any coordinator replica of any cluster (`GET /cluster`).
With etcd (`--etcd URL`, or the running `duet up`'s) it also lists what is registered there
(coordinator/cluster_view.py): the replicas alive, asked first, and every node, shown even when
no coordinator answers.
Exit code 0 when every node is ready, 1 when some is not, no coordinator answers, or `duet up`
left a crash-looping process down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

import msgspec

from coordinator.etcd_auth import add_etcd_arguments, apply_etcd_args
from duet.errors import UsageError
from duet.security_args import add_client_arguments, plane_security

if TYPE_CHECKING:
    from coordinator.cluster_view import ClusterSnapshot
    from runtime.plane import PlaneSecurity


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="show the cluster: nodes, roles, load, KV use, leader",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--coordinator",
        default=None,
        metavar="URL[,URL]",
        help="coordinator replica(s) to ask (default: the running `duet up`'s)",
    )
    p.add_argument(
        "--etcd",
        default=None,
        metavar="URL",
        help="etcd to list registered nodes and replicas from (default: the running `duet up`'s)",
    )
    p.add_argument(
        "--cluster", default="default", help="cluster name in etcd (with --etcd; default 'default')"
    )
    add_etcd_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_client_arguments(p)
    p.set_defaults(func=_run)


def _get(url: str, auth: PlaneSecurity | None = None) -> Any:
    """GET a JSON answer; `auth` adds the cluster secret and the cluster's CA (coordinators)."""
    headers, ctx = (auth.headers, auth.client_ssl()) if auth is not None else ({}, True)
    context = ctx if not isinstance(ctx, bool) else None
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=headers), timeout=3, context=context
    ) as r:
        return json.loads(r.read())


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def registered(etcd: str, cluster: str) -> ClusterSnapshot | str:
    """Nodes and coordinator replicas registered in etcd, or why they could not be read."""
    from coordinator.cluster_view import ClusterView
    from coordinator.etcd_store import EtcdStore
    from coordinator.store import StoreError

    async def read() -> ClusterSnapshot:
        store = EtcdStore(etcd, timeout=2.0)
        try:
            return await ClusterView(store, cluster).read()
        finally:
            await store.close()

    try:
        return asyncio.run(read())
    except (StoreError, ValueError) as e:
        return f"etcd {etcd}: {e}"


def collect(
    coordinators: list[str],
    state: dict[str, Any] | None,
    members: ClusterSnapshot | str | None = None,
    auth: PlaneSecurity | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"cluster": None, "coordinator": None, "errors": []}
    if isinstance(members, str):
        out["etcd_error"] = members
    elif members is not None:  # the replicas alive in etcd first, then any other one given
        coordinators = members.coordinators + [
            u for u in coordinators if u not in members.coordinators
        ]
        out["registered"] = {
            "coordinators": members.coordinators,
            "nodes": msgspec.to_builtins(members.nodes),
        }
    for url in coordinators:
        try:
            out["cluster"], out["coordinator"] = _get(url + "/cluster", auth), url
            break
        except urllib.error.HTTPError as e:
            hint = (
                ": it needs the cluster secret (--cluster-secret-file, or "
                "$DUET_CLUSTER_SECRET_FILE)"
                if e.code == 401
                else ""
            )
            out["errors"].append(f"{url}: HTTP {e.code} {e.reason}{hint}")
        except (urllib.error.URLError, OSError, ValueError) as e:
            out["errors"].append(f"{url}: {getattr(e, 'reason', e)}")
    if state is not None:
        out["up"] = {
            **state,
            "children": [{**c, "alive": _alive(c.get("pid"))} for c in state.get("children", [])],
        }
        try:
            # with the secret: the gateway's details (queues, batch worker), not just its status
            out["gateway"] = _get(state["gateway"] + "/health", auth)
        except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
            out["gateway"] = {"status": f"unreachable: {getattr(e, 'reason', e)}"}
        # `duet up --gateways N`: the shared port answers from any of them; each its own port
        out["gateways"] = {}
        urls = state.get("gateways") or []
        for url in urls if len(urls) > 1 else []:
            try:
                out["gateways"][url] = _get(url + "/health").get("status")
            except (urllib.error.URLError, OSError, ValueError) as e:
                out["gateways"][url] = f"unreachable: {getattr(e, 'reason', e)}"
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def render(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 200)  # no terminal: do not squeeze columns
    up = info.get("up")
    if up:
        con.print(
            f"[bold]duet up[/] pid {up['pid']} ({'ready' if up.get('ready') else 'starting'}) home "
            f"{up['home']} (logs in logs/)  gateway {up['gateway']}: "
            f"{info.get('gateway', {}).get('status')}"
        )
        from duet.up_status import process_table

        if info.get("gateways"):
            con.print(
                "gateways on the shared port: "
                + ", ".join(f"{u} {st}" for u, st in info["gateways"].items())
            )
        con.print(process_table(up["children"]))
    cl = info["cluster"]
    if cl is None:
        con.print(f"[red]no coordinator answered[/]: {'; '.join(info['errors']) or 'none given'}")
        _render_registered(con, info.get("registered"), info.get("etcd_error"))
        return
    con.print(
        f"[bold]cluster[/] {cl['cluster']}  leader {cl['leader']}  (asked {cl['replica_id']} at "
        f"{info['coordinator']}; etcd "
        f"{'connected' if cl['etcd_connected'] else '[red]disconnected[/]'})  prefix index "
        f"{cl['index_blocks']} blocks"
    )
    t = Table(
        "node",
        "role",
        "pool",
        "status",
        "ready",
        "waiting",
        "running",
        "KV use",
        "KV free",
        "queued prefill",
        "cached blocks (pool/host/disk)",
        "url",
    )
    for n in cl["nodes"]:
        ld = n.get("load") or {}
        role = "embed" if n.get("task") == "embed" else n["role"]  # an embed node's role is "both"
        t.add_row(
            n["node_id"],
            role,
            n["pool"],
            n["status"],
            "yes" if n["ready"] else "[red]no[/]",
            str(ld.get("waiting", "-")),
            str(ld.get("running", "-")),
            _pct(ld.get("kv_cache_usage_perc")),
            f"{ld.get('kv_blocks_free', '-')}/{ld.get('kv_blocks_total', '-')}",
            str(ld.get("queued_prefill_tokens", "-")),
            _cached(n),
            n["url"],
        )
    con.print(t)
    if cl.get("reuse"):
        con.print(reuse_table(cl["reuse"]))


def _cached(n: dict[str, Any]) -> str:
    """The node's indexed blocks; with spill tiers, split pool/host/disk."""
    host, disk = n.get("indexed_host_blocks", 0), n.get("indexed_disk_blocks", 0)
    if not host and not disk:
        return str(n["indexed_blocks"])
    return f"{n['indexed_blocks'] - host - disk}/{host}/{disk}"


def _share(part: int, whole: int) -> str:
    return f"{part} ({100 * part / whole:.0f}%)" if whole else str(part)


def reuse_table(reuse: list[dict[str, Any]]) -> Any:
    """KV reuse per model: what existed in the cluster, what the routes captured (by where), and
    what the engines delivered (by where), each against its own prompt tokens."""
    from rich.table import Table

    t = Table(
        "model",
        "prompt tokens routed",
        "reuse existed",
        "route captured: pool / host / disk / peer",
        "engine prompt tokens",
        "engine delivered: pool / host / disk / peer",
        title="KV reuse (tokens not computed, and where their KV was)",
    )
    for r in reuse:
        routed, done = r["routed"], r["delivered"]
        n, m = r["prompt_tokens"], r["engine_prompt_tokens"]
        t.add_row(
            r["model"],
            str(n),
            _share(r["existed"], n),
            " / ".join(_share(routed[k], n) for k in ("pool", "host", "disk", "peer")),
            str(m),
            " / ".join(_share(done[k], m) for k in ("pool", "host", "disk", "peer")),
        )
    return t


def _render_registered(con: Any, reg: dict[str, Any] | None, error: str | None) -> None:
    """What etcd says, for when no coordinator can say more (load, readiness)."""
    from rich.table import Table

    if error:
        con.print(f"[red]cannot list the cluster from etcd[/]: {error}")
    if not reg:
        return
    con.print(
        f"[bold]registered in etcd[/]: coordinators {', '.join(reg['coordinators']) or 'none'}"
    )
    t = Table("node", "role", "model", "pool", "status", "url")
    for n in reg["nodes"]:
        t.add_row(
            n["node_id"],
            "embed" if n.get("task") == "embed" else n["role"],
            n["model"],
            n["pool"],
            n["status"],
            n["url"],
        )
    con.print(t)


def _run(args: argparse.Namespace) -> int:
    from duet.up_home import UpHome

    state = None
    if args.etcd:
        from coordinator.store import parse_etcd_url

        try:
            parse_etcd_url(args.etcd)
            apply_etcd_args(args)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.coordinator or args.etcd:
        coords = [u.strip().rstrip("/") for u in (args.coordinator or "").split(",") if u.strip()]
    else:
        home = UpHome.current()
        state = home.read_state()
        if state is None or not _alive(state.get("pid")):
            raise UsageError(
                f"no `duet up` is running with DUET_HOME={home.root}; "
                "give --coordinator URL or --etcd URL for another cluster"
            )
        coords = state["coordinators"]
    etcd = args.etcd or (state or {}).get("etcd")
    cluster = args.cluster if args.etcd or state is None else state.get("cluster", args.cluster)
    if (
        args.cluster_secret_file is None
        and state is not None
        and not os.environ.get("DUET_CLUSTER_SECRET_FILE")
    ):
        default = UpHome.current().cluster_secret_file  # the running `duet up`'s
        args.cluster_secret_file = str(default) if default.exists() else None
    info = collect(coords, state, registered(etcd, cluster) if etcd else None, plane_security(args))
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
    else:
        render(info)
    cl = info["cluster"]
    from duet.up_status import failed

    if failed(info.get("up", {}).get("children", [])):  # a process left down after a crash loop
        return 1
    return 0 if cl is not None and cl["nodes"] and all(n["ready"] for n in cl["nodes"]) else 1
