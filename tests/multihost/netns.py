"""Several "hosts" on one machine: network namespaces joined by veth pairs on one bridge.

`lan(["a", "b", "c"])` makes one namespace per host plus a "switch" namespace holding a Linux
bridge; every host gets a veth pair whose far end is a port of that bridge, its own address on
a private /24 and its own loopback. The test process (the root namespace) gets a port on the
bridge too, so it can call the hosts' servers the way a client on the network would. Traffic
only ever goes to these addresses, which exist only inside namespaces this module made.

Invariant: everything `lan` creates is removed when its block exits, pass or fail — processes
still inside one of its namespaces (the caller's, started there) are killed first, then the
namespaces (which takes their veth ends with them) and the root-side veth.

`refused()` says why namespaces cannot be made here (not root, a kernel or sandbox that refuses
`ip netns add`), or None.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

#: the veth end inside every host namespace (each namespace has its own interface names)
HOST_DEV = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def refused() -> str | None:
    """Why this machine cannot make network namespaces (None: it can). Tries for real."""
    if os.geteuid() != 0:
        return f"network namespaces need root (ip netns add); this test runs as uid {os.geteuid()}"
    probe = f"duet-probe-{os.getpid()}"
    try:
        r = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "the ip command (iproute2) is not installed"
    if r.returncode != 0:
        return f"the kernel refuses network namespaces: ip netns add: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    name: str
    ns: str
    ip: str

    def exec(self, args: Sequence[str]) -> list[str]:
        """`args` run inside this host's namespace (`ip netns exec` execs: the pid is the
        program's)."""
        return ["ip", "netns", "exec", self.ns, *args]

    def rx_bytes(self, dev: str = HOST_DEV) -> int:
        """Bytes received so far on `dev` in this namespace (the kernel's link counters)."""
        out = _ip("-n", self.ns, "-s", "-j", "link", "show", "dev", dev).stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


@dataclass(frozen=True)
class Lan:
    hosts: dict[str, Host]
    #: the root namespace's own address on the bridge (the test process as a client)
    client_ip: str


def _kill_inside(ns: str) -> None:
    r = _ip("netns", "pids", ns, check=False)
    for pid in r.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def lan(names: Sequence[str]) -> Iterator[Lan]:
    """Hosts `names` on one bridged /24 (see the module docstring); torn down on exit."""
    tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
    # One /24 per LAN, drawn at random among those no interface of this machine uses, so two LANs
    # at once (two test workers, or a module's LAN while a test makes its own) never share a route
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    net = f"10.253.{random.choice([x for x in range(1, 255) if f' 10.253.{x}.' not in used])}"
    switch, root_dev = f"duet-{tag}-sw", f"duet{tag}"
    made: list[str] = []
    root_made = False
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        hosts: dict[str, Host] = {}
        for i, name in enumerate(names):
            ns = f"duet-{tag}-{name}"
            _ip("netns", "add", ns)
            made.append(ns)
            port = f"p{i}"
            _ip(
                "-n",
                ns,
                "link",
                "add",
                HOST_DEV,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                switch,
            )
            _ip("-n", switch, "link", "set", port, "master", "br0", "up")
            ip = f"{net}.{i + 2}"
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", HOST_DEV)
            _ip("-n", ns, "link", "set", HOST_DEV, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            hosts[name] = Host(name, ns, ip)
        _ip("link", "add", root_dev, "type", "veth", "peer", "name", "proot", "netns", switch)
        root_made = True
        _ip("-n", switch, "link", "set", "proot", "master", "br0", "up")
        _ip("addr", "add", f"{net}.1/24", "dev", root_dev)
        _ip("link", "set", root_dev, "up")
        yield Lan(hosts, f"{net}.1")
    finally:
        for ns in made:
            _kill_inside(ns)
        if root_made:
            _ip("link", "del", root_dev, check=False)
        for ns in reversed(made):
            _ip("netns", "del", ns, check=False)
