"""The killer of `duet bench chaos`: every `kill_every` seconds, SIGKILL one process of a
`duet up` cluster, chosen at random among those running, and time how long until `duet up`
has it running (healthy) again.

The processes come from `$DUET_HOME/up/state.json` (duet/supervisor.py::Child.status, which
`duet up` rewrites on every change): name, pid, state. A process's kind is its name without
the replica number (`decode-1` → decode). A gateway is a candidate when the cluster runs two
or more (`duet up --gateways N`: another one takes over its port), or when asked for: with one
gateway, its death is a client-visible outage by design (no second gateway to take over).

Invariant: only pids listed by the running `duet up` are ever signalled, and only while they
are listed as running.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

KINDS = ("etcd", "coordinator", "prefill", "decode", "both", "gateway")


class Kill(msgspec.Struct, kw_only=True):
    name: str
    pid: int
    #: seconds since the run's start
    at_s: float
    #: seconds from the kill until `duet up` reported the process healthy again (None: not back)
    back_s: float | None = None
    #: `duet up` gave up on it (crash loop)
    left_down: bool = False


def kind_of(name: str) -> str:
    head, _, tail = name.rpartition("-")
    return head if tail.isdigit() else name


def read_children(state_file: Path) -> list[dict[str, Any]]:
    try:
        return json.loads(state_file.read_text()).get("children", [])
    except (FileNotFoundError, ValueError):
        return []  # duet up rewrites it atomically; missing only while it stops


class Killer:
    def __init__(
        self,
        state_file: Path,
        kinds: set[str],
        every_s: float,
        seed: int,
        t0: float,
        say: Callable[[str], None],
        gateways_when_several: bool = True,
    ) -> None:
        """`gateways_when_several`: gateways are candidates too while two or more run (the
        default kinds; an explicit --kill list is taken as given)."""
        self.state_file = state_file
        self.kinds = kinds
        self.gateways_when_several = gateways_when_several
        self.every_s = every_s
        self.rng = random.Random(seed)
        self.t0 = t0
        self.say = say
        self.kills: list[Kill] = []
        self._watchers: list[asyncio.Future[None]] = []

    def candidates(self) -> list[dict[str, Any]]:
        children = read_children(self.state_file)
        kinds = self.kinds
        if (
            self.gateways_when_several
            and sum(kind_of(c["name"]) == "gateway" for c in children) >= 2
        ):
            kinds = kinds | {"gateway"}
        return [
            c
            for c in children
            if c.get("state") == "running" and kind_of(c["name"]) in kinds and c.get("pid")
        ]

    async def run(self, until_s: float) -> None:
        """Kill every `every_s` seconds until `until_s` (seconds since t0)."""
        if self.every_s <= 0:
            return
        k = 1
        while (at := k * self.every_s) < until_s:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - self.t0)))
            k += 1
            victims = self.candidates()
            if not victims:
                self.say("nothing to kill: no process of the chosen kinds is running")
                continue
            c = self.rng.choice(victims)
            try:
                os.kill(c["pid"], signal.SIGKILL)
            except ProcessLookupError:
                continue  # died by itself meanwhile: duet up is already on it
            kill = Kill(name=c["name"], pid=c["pid"], at_s=time.monotonic() - self.t0)
            self.kills.append(kill)
            self.say(f"t={kill.at_s:.0f}s SIGKILL {kill.name} (pid {kill.pid})")
            self._watchers.append(asyncio.ensure_future(self._watch(kill)))

    async def _watch(self, kill: Kill) -> None:
        while True:
            c = next((c for c in read_children(self.state_file) if c["name"] == kill.name), None)
            if c is not None and c.get("state") == "running" and c.get("pid") != kill.pid:
                kill.back_s = time.monotonic() - self.t0 - kill.at_s
                self.say(f"{kill.name} back after {kill.back_s:.1f} s")
                return
            if c is not None and c.get("state") == "failed":
                kill.left_down = True
                self.say(f"{kill.name} left down by duet up (crash loop)")
                return
            await asyncio.sleep(0.2)  # state.json polling interval

    async def settle(self, timeout: float) -> None:
        """Wait (at most `timeout`) for every killed process to be back or given up."""
        pending = [w for w in self._watchers if not w.done()]
        if pending:
            _, left = await asyncio.wait(pending, timeout=timeout)
            for w in left:
                w.cancel()
