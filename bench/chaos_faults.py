"""The faults of `duet bench chaos` past SIGKILL: each class on its own schedule (one fault every
`every_s`, held `for_s`), every fault logged on the timeline with its start and end.

- `stop`: SIGSTOP a process, SIGCONT it after `for_s` (a grey failure: its sockets stay open,
  nothing answers);
- `partition`, `delay`, `loss`: between two processes of one pair class (gateway ↔ coordinator,
  gateway ↔ node, prefill ↔ decode — the KV path —, node ↔ etcd, coordinator ↔ etcd; etcd is
  every member at once), in the namespaces of `duet up --netns` (runtime/netns.py);
- `etcd`: one member cut off, then a second (the quorum lost), then both back — half of `for_s`
  each — on a cluster of 3 or more members;
- `disk`: the gateways' store file system (a small one of the cluster's own, DiskTrap) filled
  to the last byte for `for_s`, then freed;
- `slowfs`: the gateways' store slow to commit for `for_s`, each commit `commit_s`
  (bench/chaos_slowfs.py).

Invariant: every fault started is undone — when its time is up, or by `settle()` at the end of
the run whatever happened (a process still stopped is continued, every rule and delayer removed,
the filler deleted) — and a fault never targets a process `duet up` does not list as running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from bench.chaos_kill import kind_of, read_children
from bench.chaos_slowfs import SlowStore
from runtime import netns

#: fault classes past SIGKILL (kill is bench/chaos_kill.py's)
CLASSES = ("stop", "partition", "delay", "loss", "etcd", "disk", "slowfs")
#: the classes that need `duet up --netns`
NETWORK = {"partition", "delay", "loss", "etcd"}
PAIR_CLASSES = (
    "gateway-coordinator",
    "gateway-node",
    "prefill-decode",
    "node-etcd",
    "coordinator-etcd",
)
#: stands for every etcd member in a pair
ETCD = "etcd"


class FaultEvent(msgspec.Struct, kw_only=True):
    kind: str
    #: what it hit: a process, or a pair "a <-> b"
    target: str
    #: seconds since the run's start
    start_s: float
    end_s: float | None = None
    detail: str = ""
    #: the pair class of a network fault
    pair: str = ""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    every_s: float
    for_s: float
    delay_ms: float = 100.0
    jitter_ms: float = 20.0
    loss_pct: float = 5.0
    commit_s: float = 2.0


def _is_node(name: str) -> bool:
    return kind_of(name) in ("prefill", "decode", "both")


def pairs(members: list[str], pair_class: str) -> list[tuple[str, str]]:
    """Every (a, b) of `pair_class` among the namespace members (b may be ETCD: all members)."""
    coords = [m for m in members if kind_of(m) == "coordinator"]
    nodes = [m for m in members if _is_node(m)]
    gw = [m for m in members if m == "gateway"]
    if pair_class == "gateway-coordinator":
        return [(g, c) for g in gw for c in coords]
    if pair_class == "gateway-node":
        return [(g, n) for g in gw for n in nodes]
    if pair_class == "prefill-decode":
        ps = [m for m in members if kind_of(m) == "prefill"]
        return [(p, d) for p in ps for d in members if kind_of(d) == "decode"]
    if pair_class == "node-etcd":
        return [(n, ETCD) for n in nodes]
    if pair_class == "coordinator-etcd":
        return [(c, ETCD) for c in coords]
    raise ValueError(pair_class)


class DiskTrap:
    """The gateways' store on a file system of its own size (`size_mib`, tmpfs), made before
    `duet up` starts in `home`: the home itself is that small file system, and the logs, the
    state, etcd's data and the nodes' files get unbounded ones mounted over their directories, so
    only the store (gateway.db and its WAL) runs out of space when `fill()` takes the rest."""

    def __init__(self, home: Path, size_mib: int = 32) -> None:
        self.home = home
        self.mounts: list[Path] = []
        self._mount(home, f"size={size_mib}m")
        for sub in ("logs", "up", "etcd"):
            (home / sub).mkdir(exist_ok=True)
            self._mount(home / sub, "size=50%")
        self.filler = home / ".chaos-disk-filler"

    def _mount(self, where: Path, opts: str) -> None:
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], check=True)
        self.mounts.append(where)

    def fill(self) -> int:
        """Take every free byte of the store's file system; the bytes taken."""
        st = os.statvfs(self.home)
        free = st.f_bavail * st.f_frsize
        with self.filler.open("wb", buffering=0) as f:
            with contextlib.suppress(OSError):
                os.posix_fallocate(f.fileno(), 0, free)
            with contextlib.suppress(OSError):  # what fallocate's rounding left
                while f.write(b"\0" * 4096):
                    f.flush()
        return self.filler.stat().st_size

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        self.free()
        for where in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(where)], check=False)
        self.mounts.clear()


class Injector:
    def __init__(
        self,
        state_file: Path,
        specs: list[FaultSpec],
        seed: int,
        t0: float,
        say: Callable[[str], None],
        disk: DiskTrap | None = None,
    ) -> None:
        self.state_file, self.specs, self.t0, self.say = state_file, specs, t0, say
        self.rng = random.Random(seed + 1)
        self.disk = disk
        self.events: list[FaultEvent] = []
        self._undo: dict[int, Callable[[], None]] = {}  # id(event) → how to end it

    def lan(self) -> netns.Lan | None:
        import json

        with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
            st = json.loads(self.state_file.read_text())
            return netns.Lan.from_json(st["netns"]) if st.get("netns") else None
        return None

    def _now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, until_s: float) -> None:
        await asyncio.gather(*(self._schedule(s, until_s) for s in self.specs))

    async def _schedule(self, spec: FaultSpec, until_s: float) -> None:
        k = 1
        # the classes start staggered, so that two classes' faults do not always coincide
        offset = spec.every_s * (CLASSES.index(spec.kind) + 1) / (len(CLASSES) + 1)
        while (at := offset + (k - 1) * spec.every_s) + min(spec.for_s, 1.0) < until_s:
            await asyncio.sleep(max(0.0, at - self._now()))
            k += 1
            hold = min(spec.for_s, until_s - self._now())
            try:
                await self._one(spec, hold)
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                self.say(f"{spec.kind}: could not inject: {e}")

    async def _one(self, spec: FaultSpec, hold: float) -> None:
        if spec.kind == "stop":
            await self._stop(hold)
        elif spec.kind == "etcd":
            await self._etcd(hold)
        elif spec.kind == "disk":
            await self._disk(hold)
        elif spec.kind == "slowfs":
            await self._slowfs(spec, hold)
        else:
            await self._network(spec, hold)

    def _begin(self, ev: FaultEvent, undo: Callable[[], None]) -> FaultEvent:
        self.events.append(ev)
        self._undo[id(ev)] = undo
        self.say(f"t={ev.start_s:.0f}s {ev.kind} {ev.target} {ev.detail}".rstrip())
        return ev

    def _end(self, ev: FaultEvent) -> None:
        undo = self._undo.pop(id(ev), None)
        if undo is not None:
            with contextlib.suppress(Exception):
                undo()
            ev.end_s = self._now()
            self.say(f"t={ev.end_s:.0f}s end of {ev.kind} {ev.target}")

    async def _hold(self, ev: FaultEvent, hold: float) -> None:
        try:
            await asyncio.sleep(hold)
        finally:
            await asyncio.to_thread(self._end, ev)

    async def _stop(self, hold: float) -> None:
        running = [c for c in read_children(self.state_file) if c.get("state") == "running"]
        if not running:
            return
        c = self.rng.choice(running)
        pid = int(c["pid"])
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return

        def resume() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

        ev = self._begin(
            FaultEvent(kind="stop", target=c["name"], start_s=self._now(), detail=f"pid {pid}"),
            resume,
        )
        await self._hold(ev, hold)

    async def _network(self, spec: FaultSpec, hold: float) -> None:
        lan = self.lan()
        if lan is None:
            raise RuntimeError("network faults need `duet up --netns`")
        members = list(lan.members)
        cls = self.rng.choice([p for p in PAIR_CLASSES if pairs(members, p)])
        a, b = self.rng.choice(pairs(members, cls))
        bs = [m for m in members if kind_of(m) == "etcd" or m == "etcd"] if b == ETCD else [b]
        ma = lan.members[a]

        def make(mb: netns.Member) -> netns.NetFault:
            if spec.kind == "partition":
                return netns.partition(ma, mb)
            if spec.kind == "loss":
                return netns.loss(ma, mb, spec.loss_pct / 100)
            return netns.delay(ma, mb, spec.delay_ms, spec.jitter_ms)

        made: list[netns.NetFault] = []

        def undo() -> None:
            for f in made:
                f.undo()

        try:
            for name in bs:
                made.append(await asyncio.to_thread(make, lan.members[name]))
        except BaseException:
            undo()
            raise
        detail = {
            "partition": "",
            "loss": f"{spec.loss_pct:g} %",
            "delay": f"{spec.delay_ms:g}±{spec.jitter_ms:g} ms",
        }[spec.kind]
        ev = FaultEvent(
            kind=spec.kind, target=f"{a} <-> {b}", start_s=self._now(), detail=detail, pair=cls
        )
        self._begin(ev, undo)
        await self._hold(ev, hold)

    async def _etcd(self, hold: float) -> None:
        lan = self.lan()
        members = sorted(m for m in (lan.members if lan else {}) if kind_of(m) == "etcd")
        if lan is None or len(members) < 3:
            raise RuntimeError("the etcd fault needs `duet up --netns` with [etcd] members >= 3")
        first, second = self.rng.sample(members, 2)
        f1 = await asyncio.to_thread(netns.isolate, lan.members[first])
        e1 = self._begin(
            FaultEvent(kind="etcd", target=first, start_s=self._now(), detail="member removed"),
            f1.undo,
        )
        await asyncio.sleep(hold / 2)
        f2 = await asyncio.to_thread(netns.isolate, lan.members[second])
        e2 = self._begin(
            FaultEvent(
                kind="etcd",
                target=f"{first}+{second}",
                start_s=self._now(),
                detail=f"quorum lost: {second} removed too",
            ),
            f2.undo,
        )
        try:
            await asyncio.sleep(hold / 2)
        finally:
            await asyncio.to_thread(self._end, e2)
            await asyncio.to_thread(self._end, e1)

    async def _disk(self, hold: float) -> None:
        if self.disk is None:
            raise RuntimeError("the disk fault needs the store on a file system of its own")
        taken = await asyncio.to_thread(self.disk.fill)
        ev = self._begin(
            FaultEvent(
                kind="disk",
                target="gateway store",
                start_s=self._now(),
                detail=f"file system full ({taken >> 20} MiB taken)",
            ),
            self.disk.free,
        )
        await self._hold(ev, hold)

    async def _slowfs(self, spec: FaultSpec, hold: float) -> None:
        # duet up's home: HOME/up/state.json, its store HOME/gateway.db (duet/up_home.py)
        slow = SlowStore(self.state_file.parent.parent / "gateway.db", spec.commit_s)
        slow.start()
        ev = FaultEvent(
            kind="slowfs",
            target="gateway store",
            start_s=self._now(),
            detail=f"each commit {spec.commit_s:g} s",
        )

        def end() -> None:
            slow.stop()
            ev.detail += f", {slow.commits} slow commits"

        await self._hold(self._begin(ev, end), hold)

    def settle(self) -> None:
        """End every fault still on (a cancelled run, an error): nothing stays injected."""
        for ev in list(self.events):
            if id(ev) in self._undo:
                self._end(ev)


def timeline_rows(events: list[FaultEvent]) -> list[dict[str, Any]]:
    return [
        {
            "kind": e.kind,
            "target": e.target,
            "pair": e.pair,
            "start_s": round(e.start_s, 1),
            "end_s": None if e.end_s is None else round(e.end_s, 1),
            "detail": e.detail,
        }
        for e in events
    ]
