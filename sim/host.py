"""Simulated nodes that share one machine: while two or more of them are mid-step, each step's
work progresses at 1 / its co-run factor (the profile's `CoRun`, measured by `duet bench
profile`), and at full speed again once it runs alone.

This is processor sharing on virtual time: a step is a quantity of work (the seconds the step
model gives for it alone); whenever a step starts or ends, every running step's remaining work
is brought up to date at the rates that held since the last change, the rates are recomputed,
and one timer is set for the earliest finish. A step's wall time therefore depends on how much
of it overlapped another node's steps, not only on whether one was running when it began.

Invariants: a step's wall time is ≥ its work and ≤ work × its factor; with one node, or with
factors of 1.0, a step lasts exactly its work (what `asyncio.sleep(work)` gives).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from protocol.profile import CoRun

#: a step whose remaining work would take under this is done (float noise of the rate updates,
#: the timer's resolution)
_DONE_S = 1e-9


@dataclass(eq=False)
class _Step:
    remaining: float
    factor: float
    done: asyncio.Future[None] = field(repr=False)

    def rate(self, shared: bool) -> float:
        return 1.0 / self.factor if shared else 1.0


class SharedHost:
    def __init__(self, corun: CoRun) -> None:
        self.corun = corun
        self._running: list[_Step] = []
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    async def step(self, work_s: float, *, prefill: bool) -> None:
        """Run `work_s` seconds of step work; returns when it is done."""
        loop = asyncio.get_running_loop()
        if work_s <= 0:
            return
        self._advance(loop.time())
        st = _Step(work_s, self.corun.factor(prefill), loop.create_future())
        self._running.append(st)
        self._reschedule(loop)
        try:
            await st.done
        finally:
            if st in self._running:  # cancelled mid-step (a run stopped early)
                self._advance(loop.time())
                self._running.remove(st)
                self._reschedule(loop)

    def _advance(self, now: float) -> None:
        dt = now - self._last
        self._last = now
        if dt <= 0:
            return
        shared = len(self._running) > 1
        for st in self._running:
            st.remaining -= dt * st.rate(shared)

    def _reschedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._running:
            return
        shared = len(self._running) > 1
        wait = min(max(0.0, st.remaining) / st.rate(shared) for st in self._running)
        self._timer = loop.call_at(self._last + wait, self._on_timer)

    def _on_timer(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = None
        self._advance(loop.time())
        shared = len(self._running) > 1
        finished = [st for st in self._running if st.remaining / st.rate(shared) <= _DONE_S]
        for st in finished:
            self._running.remove(st)
            if not st.done.done():
                st.done.set_result(None)
        self._reschedule(loop)
