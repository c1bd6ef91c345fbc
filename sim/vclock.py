"""An asyncio event loop on virtual time: `loop.time()` is simulated seconds, and waiting for
the next timer jumps the clock there instead of sleeping.

This is how the simulator runs the gateway's *real* tier admission (gateway/serving/tiers.py, which
waits with asyncio futures and `asyncio.wait_for`) without a copy: every `asyncio.sleep`,
`wait_for` timeout and `call_later` in the simulation is on this clock. The loop never does
I/O: its selector reports no events, and a loop with no timer and nothing ready is a
simulation that cannot progress (SimDeadlock), never a hang.

Invariants: time only moves forward, and only to the deadline of the earliest timer; callbacks
that are ready run before time moves.
"""

from __future__ import annotations

import asyncio
import selectors


class SimDeadlock(RuntimeError):
    """Every task waits on something that no timer will ever bring."""


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list:
        if timeout is None:
            raise SimDeadlock("the simulation has no pending timer and nothing ready to run")
        if timeout > 0:
            self.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._vsel = _VirtualSelector()
        super().__init__(self._vsel)
        # asyncio runs every timer due within `time() + resolution`: keep it tiny so two events
        # a microsecond apart stay ordered
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._vsel.now


def run(coro: object) -> object:
    """Run a coroutine to completion on a fresh virtual-time loop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)  # type: ignore[arg-type]
    finally:
        loop.close()
