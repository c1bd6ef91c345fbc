"""Real clusters for coordinator tests: node processes on the tiny model (fp32, one thread,
small KV pools, tcp transport) registered in the etcd of tests/conftest.py's `etcd` fixture,
coordinator processes. Every process is stopped at the end of its test, pass or fail."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, TypeVar

from tests.procs import Proc, duet_node, free_port
from tests.wait import wait_for

NODE_ARGS = (
    "--dtype",
    "float32",
    "--kv-blocks",
    "256",
    "--max-model-len",
    "1024",
    "--transport",
    "tcp",
)
T = TypeVar("T")


def node(role: str, model: Path, tmp: Path, etcd_url: str, *extra: str) -> Proc:
    return duet_node(
        role, str(model), tmp, *NODE_ARGS, "--etcd", etcd_url, "--lease-seconds", "2", *extra
    )


def coordinator(tmp: Path, etcd_url: str, *extra: str) -> Proc:
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "duet",
        "coordinator",
        "--etcd",
        etcd_url,
        "--port",
        str(port),
        *extra,
    ]
    return Proc(args, port, tmp / f"coordinator-{port}.log")


def http(
    method: str,
    url: str,
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        text, status = e.read(), e.code
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text.decode(errors="replace")


def get(url: str) -> Any:
    status, body = http("GET", url)
    assert status == 200, (url, status, body)
    return body


def cluster_node(coord_url: str, node_id: str) -> dict[str, Any] | None:
    return next((n for n in get(coord_url + "/cluster")["nodes"] if n["node_id"] == node_id), None)


def wait_ready(coord_url: str, node_ids: list[str], timeout: float = 60.0) -> None:
    """Every node is known, streaming and reporting load, and no routing decision is pending."""

    def ok() -> bool:
        nodes = {n["node_id"]: n for n in get(coord_url + "/cluster")["nodes"]}
        return all(
            i in nodes
            and nodes[i]["ready"]
            and nodes[i]["pending"]["seqs"] == 0
            and nodes[i]["pending"]["prefill_tokens"] == 0
            for i in node_ids
        )

    wait_for(ok, timeout, f"nodes {node_ids} ready in the coordinator")


def node_id_of(p: Proc) -> str:
    return get(p.url + "/health")["node_id"]


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
