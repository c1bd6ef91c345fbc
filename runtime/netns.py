"""Several "hosts" on one machine for fault drills: one network namespace per process (or per
role), each joined by a veth link to one bridge, and the network faults between any two of them.

Layout (`make_lan(prefix, names)`): a switch namespace `{prefix}-sw` holds a Linux bridge; member
`name` lives in namespace `{prefix}-{name}` with `eth0` (a veth whose far end is a bridge port),
its own address on a private /24 drawn at random among those no interface here uses, and its own
loopback. The root namespace gets a bridge port too (`{prefix}r`, the /24's .1), so a supervisor
and a load generator reach every member as a client on the network would. `ip netns exec`
execs its program, so a process started in a member keeps the pid its supervisor sees.

Faults between members A and B (rules in both namespaces, so both directions fail alike):
- `partition`: every packet between them dropped — silent, no reset and no refusal, as a real
  partition looks (iptables DROP in and out);
- `loss`: a share of the packets between them dropped at random (iptables `statistic`);
- `delay`: every packet between them held `delay ± jitter` ms on arrival by an NFQUEUE delayer
  in the receiving namespace (runtime/nfqueue_delay.py; order kept). Not `tc netem`: kernels
  built without sch_netem (this project's VMs) have netfilter's queue, and delaying on arrival
  keeps the sender's TCP small-queue accounting out of it (a packet held on the way out counts
  against its socket, which then sends ~2 packets per delay: an outage, not a delay);
- `isolate`: a member's link down (cut off from everyone: an etcd member removed).
Each returns a `NetFault` whose `undo()` removes exactly what it added.

Invariant: every name made here carries the run's prefix; `destroy(prefix)` removes all of it —
the processes inside first, then the namespaces (their veth ends go with them) and the root's
port — whoever made it, so a drill cleans up after a SIGKILLed `duet up` too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import itertools
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

DEV = "eth0"
_CLONE_NEWNET = 0x40000000
_QUEUES = itertools.count(1)


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check)


def iptables() -> str:
    """The legacy iptables where there is one: its NFQUEUE target needs no nftables queue support
    (kernels without CONFIG_NFT_QUEUE), and a namespace's tables are its own either way."""
    for name in ("iptables-legacy", "iptables"):
        with contextlib.suppress(FileNotFoundError):
            if subprocess.run([name, "--version"], capture_output=True).returncode == 0:
                return name
    raise FileNotFoundError("iptables is not installed (scripts/setup installs it)")


def refused() -> str | None:
    """Why this machine cannot make namespaces for a drill (None: it can). Tries for real."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return f"network namespaces need root (ip netns add); this runs as uid {os.geteuid()}"
    probe = f"duet-probe-{os.getpid()}"
    try:
        r = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "the ip command (iproute2) is not installed (scripts/setup installs it)"
    if r.returncode != 0:
        return f"the kernel refuses network namespaces: ip netns add: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    try:
        iptables()
    except FileNotFoundError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Member:
    name: str
    ns: str
    ip: str

    def exec(self, args: Sequence[str]) -> list[str]:
        """`args` run inside this member's namespace (the pid is the program's)."""
        return ["ip", "netns", "exec", self.ns, *args]


@dataclass(frozen=True)
class Lan:
    prefix: str
    members: dict[str, Member]
    #: the root namespace's address on the bridge
    root_ip: str

    def to_json(self) -> dict[str, object]:
        return {
            "prefix": self.prefix,
            "root_ip": self.root_ip,
            "members": {n: {"ns": m.ns, "ip": m.ip} for n, m in self.members.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Lan:
        members = d["members"]
        assert isinstance(members, dict)
        return cls(
            prefix=str(d["prefix"]),
            root_ip=str(d["root_ip"]),
            members={n: Member(n, m["ns"], m["ip"]) for n, m in members.items()},
        )


def make_lan(prefix: str, names: Sequence[str]) -> Lan:
    """Members `names` on one bridged /24 (see the module docstring). On any failure what was made
    is removed before the error is raised; otherwise the caller calls `destroy(prefix)`."""
    used = _ip("-o", "-4", "addr").stdout
    free = [x for x in range(1, 255) if f" 10.252.{x}." not in used]
    net = f"10.252.{random.choice(free)}"
    switch, root_dev = f"{prefix}-sw", f"{prefix}r"
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        members = {}
        for i, name in enumerate(names):
            ns = f"{prefix}-{name}"
            _ip("netns", "add", ns)
            port = f"p{i}"
            _ip("-n", ns, "link", "add", DEV, "type", "veth", "peer", "name", port, "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0", "up")
            ip = f"{net}.{i + 2}"
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", DEV)
            _ip("-n", ns, "link", "set", DEV, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            members[name] = Member(name, ns, ip)
        _ip("link", "add", root_dev, "type", "veth", "peer", "name", "proot", "netns", switch)
        _ip("-n", switch, "link", "set", "proot", "master", "br0", "up")
        _ip("addr", "add", f"{net}.1/24", "dev", root_dev)
        _ip("link", "set", root_dev, "up")
    except BaseException:
        destroy(prefix)
        raise
    return Lan(prefix, members, f"{net}.1")


def namespaces(prefix: str) -> list[str]:
    out = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in out if line.startswith(f"{prefix}-")]


def destroy(prefix: str) -> list[str]:
    """Remove every namespace and the root port of `prefix`, processes inside first; what was
    removed (empty: nothing was left)."""
    gone = []
    for ns in namespaces(prefix):
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", ns, check=False)
        gone.append(ns)
    if _ip("link", "del", f"{prefix}r", check=False).returncode == 0:
        gone.append(f"{prefix}r")
    return gone


@contextlib.contextmanager
def entered(ns: str | None) -> Iterator[None]:
    """This thread inside namespace `ns` for the block (sockets made meanwhile stay in it); the
    thread's own namespace after. `None`: nothing changes."""
    if ns is None:
        yield
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        try:
            yield
        finally:
            libc.setns(own, _CLONE_NEWNET)
    finally:
        os.close(own)
        os.close(target)


@dataclass
class NetFault:
    """What one fault added; `undo()` removes it (idempotent)."""

    what: str
    #: the undo steps, newest last; what a step returns (a CompletedProcess) is ignored
    _undo: list[Callable[[], object]] = field(default_factory=list)

    def undo(self) -> None:
        while self._undo:
            with contextlib.suppress(Exception):
                self._undo.pop()()

    def rule(self, ns: str, spec: list[str]) -> None:
        """Insert the iptables rule `spec` (chain first) in namespace `ns`; `undo()` deletes
        it. For a fault shape of a caller's own (the helpers below build the common ones)."""
        ipt = iptables()
        _run(["ip", "netns", "exec", ns, ipt, "-I", *spec])
        self._undo.append(lambda: _run(["ip", "netns", "exec", ns, ipt, "-D", *spec], check=False))


def partition(a: Member, b: Member) -> NetFault:
    f = NetFault(f"partition {a.name} <-> {b.name}")
    try:
        for x, y in ((a, b), (b, a)):
            f.rule(x.ns, ["INPUT", "-s", y.ip, "-j", "DROP"])
            f.rule(x.ns, ["OUTPUT", "-d", y.ip, "-j", "DROP"])
    except BaseException:
        f.undo()
        raise
    return f


def loss(a: Member, b: Member, share: float) -> NetFault:
    f = NetFault(f"loss {share:.0%} {a.name} <-> {b.name}")
    try:
        for x, y in ((a, b), (b, a)):
            stat = ["-m", "statistic", "--mode", "random", "--probability", f"{share:.4f}"]
            f.rule(x.ns, ["INPUT", "-s", y.ip, *stat, "-j", "DROP"])
    except BaseException:
        f.undo()
        raise
    return f


def delay(a: Member, b: Member, delay_ms: float, jitter_ms: float = 0.0) -> NetFault:
    """Each direction delayed `delay_ms ± jitter_ms` (the round trip twice that)."""
    f = NetFault(f"delay {delay_ms:g}±{jitter_ms:g} ms {a.name} <-> {b.name}")
    try:
        for x, y in ((a, b), (b, a)):
            q = next(_QUEUES)
            proc = subprocess.Popen(
                x.exec(
                    [
                        sys.executable,
                        "-m",
                        "runtime.nfqueue_delay",
                        "--queue",
                        str(q),
                        "--delay-ms",
                        str(delay_ms),
                        "--jitter-ms",
                        str(jitter_ms),
                        "--seed",
                        str(q),
                    ]
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            f._undo.append(functools.partial(_stop, proc))
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != b"bound":
                raise RuntimeError(f"the delayer in {x.ns} did not bind queue {q}")
            nfq = ["-j", "NFQUEUE", "--queue-num", str(q), "--queue-bypass"]
            f.rule(x.ns, ["INPUT", "-s", y.ip, *nfq])
    except BaseException:
        f.undo()
        raise
    return f


def _stop(p: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the delayer lets what it holds go), then SIGKILL."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def isolate(a: Member) -> NetFault:
    f = NetFault(f"isolate {a.name}")
    _ip("-n", a.ns, "link", "set", DEV, "down")
    f._undo.append(lambda: _ip("-n", a.ns, "link", "set", DEV, "up", check=False))
    return f
