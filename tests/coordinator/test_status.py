"""`duet status --etcd URL`: the nodes and coordinator replicas registered in a real etcd,
listed through coordinator/cluster_view.py — replicas alive there are asked, and the nodes are
shown even when no coordinator answers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import msgspec

from coordinator.cluster_view import ClusterView
from coordinator.etcd_server import EtcdServer
from coordinator.etcd_store import EtcdStore
from protocol.cluster import NodeInfo, NodeStatus, coordinators_prefix, node_key
from runtime.ports import free_port


def _info(node_id: str, role: str, status: NodeStatus = NodeStatus.ACTIVE) -> bytes:
    return msgspec.json.encode(
        NodeInfo(
            node_id=node_id,
            role=role,
            url=f"http://{node_id}:1",
            model="m",  # type: ignore[arg-type]
            engine_id=node_id,
            block_size=16,
            kv_layout_hash="h",
            kv_capacity_blocks=8,
            max_model_len=64,
            status=status,
            started_at=time.time(),
        )
    )


async def _register(url: str, dead_replica: str) -> None:
    store = EtcdStore(url)
    try:
        await store.put(node_key("c", "decode", "d1"), _info("d1", "decode", NodeStatus.DRAINING))
        await store.put(node_key("c", "prefill", "p1"), _info("p1", "prefill"))
        await store.put(node_key("c", "prefill", "bad"), b"{not json")
        await store.put(coordinators_prefix("c") + "r1", dead_replica.encode())
        snap = await ClusterView(store, "c").read()
        assert [n.node_id for n in snap.nodes] == ["d1", "p1"] and snap.coordinators == [
            dead_replica
        ]
        assert [n.node_id for n in snap.active()] == ["p1"] and snap.nodes[
            0
        ].status is NodeStatus.DRAINING
    finally:
        await store.close()


def test_status_lists_etcd_when_no_coordinator_answers(etcd: EtcdServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    asyncio.run(_register(etcd.url, dead))
    out = subprocess.run(
        [sys.executable, "-m", "duet", "status", "--etcd", etcd.url, "--cluster", "c", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    info = json.loads(out.stdout)
    assert info["cluster"] is None and info["errors"][0].startswith(
        dead
    )  # the replica from etcd was asked
    reg = info["registered"]
    assert reg["coordinators"] == [dead]
    assert [(n["node_id"], n["status"]) for n in reg["nodes"]] == [
        ("d1", "draining"),
        ("p1", "active"),
    ]
    table = subprocess.run(
        [sys.executable, "-m", "duet", "status", "--etcd", etcd.url, "--cluster", "c"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        "registered in etcd" in table.stdout and "p1" in table.stdout and "draining" in table.stdout
    )
    bad = subprocess.run(
        [sys.executable, "-m", "duet", "status", "--etcd", "ftp://x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "etcd URL" in bad.stderr
