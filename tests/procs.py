"""Real processes for tests (see bench.procs): every one is stopped at the end of its test.

`three_nodes` is the one definition of the usual P/D set (one prefill, one decode, one
colocated node); tests/conftest.py's `pd_nodes` fixture runs it on the tiny model.

`secured_plane` is the one definition of an internal plane with a cluster secret: the secret
file, a real etcd and a coordinator on it, both given the secret; `SecuredPlane.node` adds a
node of that plane. The caller starts its nodes beside the coordinator in its own `running`
block (its flags differ per suite); the coordinator is stopped at the end even when no
`running` block was reached, the etcd after it."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.procs import Proc, duet_node, free_port, running
from coordinator.etcd_server import EtcdServer
from runtime.cluster_secret import write_secret_file
from tests.wait import wait_for

__all__ = [
    "TINY_NODE_ARGS",
    "Proc",
    "SecuredPlane",
    "duet_node",
    "free_port",
    "running",
    "secured_plane",
    "three_nodes",
]

#: a node on the tiny model: fp32, a small KV pool, a short context
TINY_NODE_ARGS = ("--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")


@contextmanager
def three_nodes(
    model: str | Path, tmp: Path, *args: str, prefill_args: tuple[str, ...] = ()
) -> Iterator[tuple[Proc, Proc, Proc]]:
    """A prefill, a decode and a colocated node of `model`, running until the block ends."""
    p = duet_node("prefill", model, tmp, *args, *prefill_args)
    d = duet_node("decode", model, tmp, *args)
    both = duet_node("both", model, tmp, *args)
    with running(p, d, both):
        yield p, d, both


@dataclass(frozen=True)
class SecuredPlane:
    """An etcd and a coordinator on it, both with the cluster secret in `secret_file`."""

    tmp: Path
    etcd: str
    secret: str
    secret_file: Path
    #: started, not yet waited for: the caller's `running` block waits until it is healthy
    coordinator: Proc

    @property
    def flag(self) -> tuple[str, str]:
        """The flag that gives a process the secret."""
        return ("--cluster-secret-file", str(self.secret_file))

    @property
    def auth(self) -> dict[str, str]:
        """The header an internal call carries."""
        return {"Authorization": f"Bearer {self.secret}"}

    def wait_ready(self, ids: set[str], timeout: float = 60) -> None:
        """Wait until the coordinator lists every node of `ids` as ready."""
        req = urllib.request.Request(self.coordinator.url + "/cluster", headers=self.auth)

        def ready() -> bool:
            with urllib.request.urlopen(req, timeout=5) as r:
                nodes = json.loads(r.read())["nodes"]
            return ids <= {n["node_id"] for n in nodes if n["ready"]}

        wait_for(ready, timeout=timeout, what=f"nodes {sorted(ids)} ready")

    def node(self, role: str, model: str | Path, *args: str, node_id: str | None = None) -> Proc:
        """A `duet node` registered in this plane's etcd (as `node_id`, when given), with the
        secret."""
        named = ("--node-id", node_id) if node_id else ()
        return duet_node(role, str(model), self.tmp, *args, "--etcd", self.etcd, *named, *self.flag)


@contextmanager
def secured_plane(tmp: Path, secret: str, *coordinator_args: str) -> Iterator[SecuredPlane]:
    """Write `secret` to `tmp/cluster.secret`, start an etcd and a coordinator (with
    `coordinator_args`) that needs it; both are stopped when the block ends."""
    secret_file = tmp / "cluster.secret"
    write_secret_file(secret_file, secret)
    flag = ("--cluster-secret-file", str(secret_file))
    with EtcdServer(tmp / "etcd") as etcd:
        port = free_port()
        coord = Proc(
            [
                sys.executable,
                "-m",
                "duet",
                "coordinator",
                "--etcd",
                etcd.url,
                "--port",
                str(port),
                *coordinator_args,
                *flag,
            ],
            port,
            tmp / "coordinator.log",
        )
        try:
            yield SecuredPlane(tmp, etcd.url, secret, secret_file, coord)
        finally:
            coord.terminate()  # a no-op when the caller's `running` block stopped it already
