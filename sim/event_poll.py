"""When a simulated node's KV events reach the coordinator: the real node's event poller on
virtual time.

A real node does not push a step's BlockStored/BlockRemoved events the moment the step ends.
Its poller (node/kv_events.py) asks the engine for them every POLL_INTERVAL_S (0.1 s), and the
engine answers that call on its own thread *between two steps* (node/engines/native.py::_drain):
a poll issued while a step runs waits for the step's end and then carries that step's events; a
poll issued while the engine idles returns at once. The poller sleeps POLL_INTERVAL_S after
each answer. So a prefill node's long steps publish their blocks at the step's end (a poll is
always waiting by then), while a decode node's 20 ms steps publish up to 0.1 s late — a window
in which the coordinator does not yet see a prefix just pulled to D. (Modelled because the
real node works so; on sim.validate's six cases it moved no figure — 05 Dec, the same measured
runs re-simulated with and without it.)

The poller's clock is kept lazily: its polls fall on a grid `anchor + k × interval`, re-anchored
at every poll that waited for a step, and a timer is set only while events wait to go out (an
idle node costs nothing; one timer per step at most).

Invariants: events go out in the order they were made; never before the end of the step that
made them; never later than the first poll after it (at most one interval, or the end of the
step in flight at that poll).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from node.kv_events import POLL_INTERVAL_S


class EventPoll:
    def __init__(
        self,
        flush: Callable[[], None],
        pending: Callable[[], bool],
        interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.interval_s = interval_s
        self._flush = flush
        self._pending = pending
        self._anchor = 0.0  # when the last poll answered
        self._step_start: float | None = None
        self._waiting = False  # a poll issued during the step in flight waits for its end
        self._timer: asyncio.TimerHandle | None = None

    def step_started(self, now: float) -> None:
        self._step_start = now

    def step_ended(self, now: float) -> None:
        start, self._step_start = self._step_start, None
        if self._waiting:
            self._waiting = False
            self._answer(now)
        elif self._timer is None and start is not None and self._next_poll(start) < now:
            # no events were waiting, so no timer ran, but the poller still polled during the
            # step: that poll answers now, with this step's events, and re-anchors the grid
            self._answer(now)
        else:
            self.events_made(now)

    def events_made(self, now: float) -> None:
        """Events were made outside a step (a release, an abort), or a step's wait for the next
        poll."""
        if self._timer is None and self._step_start is None and self._pending():
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(self._next_poll(now), self._poll)

    def _poll(self) -> None:
        self._timer = None
        if self._step_start is not None:  # the engine answers between steps: at this one's end
            self._waiting = True
        else:
            self._answer(asyncio.get_running_loop().time())

    def _answer(self, now: float) -> None:
        self._anchor = now
        self._flush()

    def _next_poll(self, t: float) -> float:
        """The first poll at or after `t` (and after the last answer)."""
        k = max(1, math.ceil((t - self._anchor) / self.interval_s - 1e-9))
        return self._anchor + k * self.interval_s
