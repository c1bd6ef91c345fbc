"""The console's cluster page: the coordinator replicas' `GET /cluster` and the gateway's
etcd view, like `duet status`, the leader's `GET /planner` (autoscaler.py) and the processes
`duet up` supervises."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web

from gateway.console import autoscaler
from gateway.console.render import ago, esc, fragment, page, table
from gateway.console.session import Session
from gateway.state import GatewayState
from runtime.models import duet_home

_TIMEOUT = aiohttp.ClientTimeout(total=3)


async def _replica(state: GatewayState, url: str) -> dict[str, Any] | str:
    try:
        # the coordinator's internal API: the cluster secret, as the route client sends it
        async with state.session.get(
            url + "/cluster", timeout=_TIMEOUT, headers=state.config.security.headers
        ) as r:
            if r.status != 200:
                return f"HTTP {r.status}"
            return await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _supervised() -> list[dict[str, Any]]:
    """The processes a running `duet up` on this machine supervises (its state file), if any.
    A state file whose `duet up` is dead (SIGKILLed: it could not remove it) is ignored, as
    `duet status` ignores it: its processes are gone, not "running"."""
    try:
        data = json.loads((duet_home() / "up" / "state.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or not _alive(data.get("pid")):
        return []
    children = data.get("children")
    return [c for c in children if isinstance(c, dict)] if isinstance(children, list) else []


async def cluster_tables(state: GatewayState) -> str:
    urls = state.topology.coordinator_urls()
    reports = await asyncio.gather(*(_replica(state, u) for u in urls))
    infos = {i.node_id: i for i in state.topology.nodes}
    first = next((r for r in reports if isinstance(r, dict)), None)
    sup = _supervised()
    # a node's restarts are its process's under `duet up` (whose process name is the node id);
    # elsewhere (Kubernetes, systemd) its orchestrator counts them: "-"
    restarts = {c.get("name"): c.get("restarts", 0) for c in sup}
    rows = []
    if first is not None:
        for n in first.get("nodes", []):
            info = infos.get(n["node_id"])
            load = n.get("load") or {}
            health = (
                "ready"
                if n.get("ready")
                else ("connected" if n.get("connected") else "unreachable")
            )
            rows.append(
                [
                    n["node_id"],
                    n["role"],
                    n.get("pool", ""),
                    info.engine_kind if info else "-",
                    (info.quantization or "none") if info else "-",
                    f"{n['status']}, {health}",
                    restarts.get(n["node_id"], "-"),
                    f"{load.get('running', '-')} running, {load.get('waiting', '-')} waiting",
                    f"{100 * load['kv_cache_usage_perc']:.1f}%"
                    if "kv_cache_usage_perc" in load
                    else "-",
                    n.get("indexed_blocks", 0),
                    ago(info.started_at) if info else "-",
                    n.get("resyncs", 0),
                ]
            )
    else:
        for i in infos.values():
            rows.append(
                [
                    i.node_id,
                    i.role,
                    i.pool,
                    i.engine_kind,
                    i.quantization or "none",
                    f"{i.status} (etcd only)",
                    restarts.get(i.node_id, "-"),
                    "-",
                    "-",
                    "-",
                    ago(i.started_at),
                    "-",
                ]
            )
    # What a screen reader hears when it changes (the page's status region, console.js): the
    # node count and each health's share, not the tables, which are replaced every 3 s.
    healths = Counter(str(r[5]) for r in rows)
    summary = f"{len(rows)} node{'s' * (len(rows) != 1)}" + (
        ": " + ", ".join(f"{n} {h}" for h, n in sorted(healths.items())) if healths else ""
    )
    out = [
        f'<p class="summary" data-summary="{esc(summary)}">{esc(summary)}</p>',
        table(
            "Nodes",
            [
                "Node",
                "Role",
                "Pool",
                "Engine",
                "Quantization",
                "Health",
                "Restarts",
                "Load",
                "KV use",
                "Cached blocks",
                "Up for",
                "Resyncs",
            ],
            rows,
        ),
    ]
    reps = []
    for url, r in zip(urls, reports, strict=True):
        if isinstance(r, dict):
            reps.append(
                [
                    url,
                    r["replica_id"],
                    "yes" if r["is_leader"] else "no",
                    r.get("leader") or "unknown",
                    "connected" if r["etcd_connected"] else "disconnected",
                    f"{r['index_blocks']} / {r['index_max_blocks']}",
                ]
            )
        else:
            reps.append([url, "-", "-", "-", "-", f"unreachable: {r}"])
    out.append(
        table(
            "Coordinator replicas",
            ["URL", "Replica", "Leader", "Leader seen", "etcd", "Prefix index"],
            reps,
        )
    )
    out.append(await autoscaler.section(state, urls, reports))
    etcd = state.topology.etcd
    if etcd is not None:
        state_text = f"read {ago(etcd.read_at)} ago" + (
            f"; last read failed: {etcd.error}" if etcd.error else ""
        )
        out.append(
            table(
                "etcd",
                ["Endpoint", "State", "Registered nodes", "Replicas"],
                [[etcd.endpoint, state_text, len(etcd.infos), len(etcd.coordinators)]],
            )
        )
    if sup:
        out.append(
            table(
                "Processes supervised by duet up",
                ["Process", "State", "PID", "Restarts"],
                [
                    [
                        c.get("name"),
                        c.get("state") or ("running" if c.get("alive") else "down"),
                        c.get("pid"),
                        c.get("restarts", 0),
                    ]
                    for c in sup
                ],
            )
        )
    out.append(
        f'<p class="muted">Updated {time.strftime("%H:%M:%S", time.gmtime())} UTC; '
        "refreshes every 3 s.</p>"
    )
    return "".join(out)


async def cluster(state: GatewayState, request: web.Request, s: Session) -> web.Response:
    body = await cluster_tables(state)
    if request.query.get("fragment"):
        return fragment(body)
    # The tables are not a live region (re-announced whole every 3 s); the status line says what
    # changed in the node summary.
    return page(
        "Cluster",
        "cluster",
        '<p id="live-status" class="visually-hidden" role="status" aria-live="polite">'
        f'</p><div id="live" data-refresh="/console/cluster?fragment=1">{body}</div>',
        s,
    )
