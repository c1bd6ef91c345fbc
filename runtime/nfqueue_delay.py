"""A packet delayer on netfilter's queue (NFQUEUE): every packet an iptables rule sends to queue
N is held `delay ± jitter` milliseconds, then let through. Run inside a network namespace
(`ip netns exec NS python -m runtime.nfqueue_delay --queue N --delay-ms D --jitter-ms J`): the
queue belongs to that namespace, and the rule there picks which packets (runtime/netns.py puts
one on the traffic between two members).

Why not `tc qdisc ... netem`: the kernels of some machines (this project's VMs among them) are
built without sch_netem, while netfilter's queue is in every distribution kernel. The netlink
protocol is spoken directly (nfnetlink_queue: bind, copy metadata only, verdicts), so nothing
needs a C library. Jitter draws each packet's delay uniformly from [delay − jitter, delay +
jitter], but a packet never leaves before one queued earlier (a later packet with a shorter
draw waits for it): reordering every stream's packets would collapse TCP's window and turn a
delay into an outage.

Invariants: a packet is never dropped by the delayer (loss is a separate iptables rule); when the
queue is full the kernel lets packets through (fail-open) rather than drop them; SIGTERM lets
every held packet go at once, then the process exits 0; the rule's `--queue-bypass` lets traffic
through while no delayer is bound.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
_SUBSYS_QUEUE = 3
_MSG_PACKET, _MSG_VERDICT, _MSG_CONFIG = 0, 1, 2
_NLM_F_REQUEST, _NLM_F_ACK = 1, 4
_NLMSG_ERROR = 2
_CFG_CMD, _CFG_PARAMS, _CFG_QUEUE_MAXLEN, _CFG_MASK, _CFG_FLAGS = 1, 2, 3, 4, 5
_CMD_BIND = 1
_COPY_META = 1
_F_FAIL_OPEN = 1
_PACKET_HDR, _VERDICT_HDR = 1, 2
NF_ACCEPT = 1


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _msg(msg: int, flags: int, queue: int, attrs: bytes, seq: int = 0) -> bytes:
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack("!H", queue) + attrs
    head = struct.pack("=IHHII", 16 + len(body), (_SUBSYS_QUEUE << 8) | msg, flags, seq, 0)
    return head + body


def _messages(buf: bytes):
    """(type, payload after the nfgenmsg) of every netlink message in `buf`."""
    off = 0
    while off + 16 <= len(buf):
        length, kind, _flags, _seq, _pid = struct.unpack_from("=IHHII", buf, off)
        if length < 16:
            return
        yield kind, buf[off + 16 : off + length]
        off += (length + 3) & ~3


def _packet_id(payload: bytes) -> int | None:
    off = 4  # the nfgenmsg
    while off + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, off)
        if length < 4:
            return None
        if kind & 0x3FFF == _PACKET_HDR:
            return struct.unpack_from("!I", payload, off + 4)[0]
        off += (length + 3) & ~3
    return None


class Delayer:
    def __init__(self, queue: int, delay_ms: float, jitter_ms: float, seed: int = 0) -> None:
        self.queue, self.delay, self.jitter = queue, delay_ms / 1e3, jitter_ms / 1e3
        self.rng = random.Random(seed)
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        # a burst of a KV transfer is thousands of packets: room for them in the socket
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE (root)
        self.held: collections.deque[tuple[float, int]] = collections.deque()
        self._last = 0.0
        self._config(_attr(_CFG_CMD, struct.pack("=Bx", _CMD_BIND) + struct.pack("!H", 2)))
        self._config(_attr(_CFG_PARAMS, struct.pack("!IB", 0, _COPY_META)))
        self._config(_attr(_CFG_QUEUE_MAXLEN, struct.pack("!I", 65536)))
        self._config(
            _attr(_CFG_FLAGS, struct.pack("!I", _F_FAIL_OPEN))
            + _attr(_CFG_MASK, struct.pack("!I", _F_FAIL_OPEN))
        )

    def _config(self, attrs: bytes) -> None:
        self.sock.send(_msg(_MSG_CONFIG, _NLM_F_REQUEST | _NLM_F_ACK, self.queue, attrs, seq=1))
        for kind, payload in _messages(self.sock.recv(65536)):
            if kind == _NLMSG_ERROR:
                err = struct.unpack_from("=i", payload, 0)[0]
                if err:
                    raise OSError(
                        -err, f"nfqueue config of queue {self.queue}: {os.strerror(-err)}"
                    )
                return

    def _verdicts(self, ids: list[int]) -> None:
        out = b"".join(
            _msg(
                _MSG_VERDICT,
                _NLM_F_REQUEST,
                self.queue,
                _attr(_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, i)),
            )
            for i in ids
        )
        if out:
            self.sock.send(out)

    def _take(self) -> None:
        now = time.monotonic()
        while True:
            try:
                buf = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:  # ENOBUFS: the socket overflowed; fail-open let those packets pass
                continue
            for kind, payload in _messages(buf):
                if kind & 0xFF == _MSG_PACKET and (pid := _packet_id(payload)) is not None:
                    d = self.delay + self.rng.uniform(-self.jitter, self.jitter)
                    self._last = max(self._last, now + max(0.0, d))
                    self.held.append((self._last, pid))

    def run(self, stop: list[bool]) -> None:
        while not stop[0]:
            now = time.monotonic()
            due: list[int] = []
            while self.held and self.held[0][0] <= now:
                due.append(self.held.popleft()[1])
            self._verdicts(due)
            wait = min(0.2, self.held[0][0] - now) if self.held else 0.2
            if select.select([self.sock], [], [], max(0.0, wait))[0]:
                self._take()
        self._verdicts([pid for _, pid in self.held])  # let everything held go at once
        self.held.clear()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.nfqueue_delay", description=__doc__)
    p.add_argument("--queue", type=int, required=True, help="netfilter queue number")
    p.add_argument("--delay-ms", type=float, required=True, help="mean delay per packet (ms)")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="± uniform jitter (ms)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    stop = [False]

    def on_term(_s: int, _f: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    d = Delayer(a.queue, a.delay_ms, a.jitter_ms, a.seed)
    print("bound", flush=True)  # the caller waits for this line before adding its rule
    d.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
