"""`duet up --netns PREFIX`: every process of the cluster in a network namespace of its own (the
gateways share one, so they share their port), joined by veth links to one bridge
(runtime/netns.py) — the layout `duet bench chaos --faults` partitions, delays and drops packets
in. Each process listens on its namespace's address and registers that address, so every call
between two processes crosses their links; the nodes' KV transport is told to use TCP over
`eth0` (within one machine UCX would otherwise copy through shared memory or cma, which no
network fault reaches), and states that KV network isolated (`--kv-network-isolated`): the
bridge exists on this machine only.

Invariants: the namespaces exist before the first process starts and are removed when `duet up`
returns, pass or fail (`Netns.close`); the caller that chose PREFIX removes them again if
`duet up` itself was SIGKILLed (runtime.netns.destroy).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from duet.supervisor import Child
from runtime.netns import Lan, destroy, make_lan, refused

#: the one namespace of all gateways (SO_REUSEPORT shares a port only within a namespace)
GATEWAYS = "gateway"
#: UCX over the member's veth only (kvtransfer/ucx_env.py names every variable)
UCX_OVER_ETH0 = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}


def member_of(child_name: str) -> str:
    """The namespace member a supervised process lives in: gateways share one."""
    return GATEWAYS if child_name.startswith("gateway") else child_name


class Netns:
    """The namespaces of one `duet up`; `None` where it runs without them (`host()` is then
    loopback and `place()` changes nothing)."""

    def __init__(self, prefix: str | None, names: Sequence[str]) -> None:
        self.lan: Lan | None = None
        if prefix is None:
            return
        if (why := refused()) is not None:
            raise RuntimeError(f"--netns: {why}")
        members = sorted({member_of(n) for n in names})
        self.lan = make_lan(prefix, members)

    def host(self, name: str) -> str:
        """The address process `name` listens on and registers."""
        return "127.0.0.1" if self.lan is None else self.lan.members[member_of(name)].ip

    def place(self, c: Child, ucx: bool = False) -> Child:
        """`c` started inside its namespace (and its health asked from there); `ucx`: a node,
        whose KV transport must cross the link."""
        if self.lan is None:
            return c
        m = self.lan.members[member_of(c.name)]
        c.args = m.exec(c.args)
        c.netns = m.ns
        if ucx:
            c.env = {**(c.env or os.environ), **UCX_OVER_ETH0}
            # The bridge is this machine's alone (its namespaces and the root one): as isolated
            # as loopback, so NIXL may cross it (node/kv_network.py)
            c.args = [*c.args, "--kv-network-isolated"]
        return c

    def state(self) -> dict[str, object] | None:
        return None if self.lan is None else self.lan.to_json()

    def close(self) -> None:
        if self.lan is not None:
            destroy(self.lan.prefix)
            self.lan = None
