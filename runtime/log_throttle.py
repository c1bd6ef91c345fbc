"""A warning that floods cannot multiply: at most one line per interval, the lines it held back
counted into the next one.

For events a stranger can cause at will (a request refused for want of the cluster secret): one
line each let anyone who reaches a port fill the disk and bury the lines that matter. The first
event of a quiet period is logged at once, with its own details; the rest of the interval's
are only counted, and the next line logged says how many there were.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class ThrottledWarning:
    def __init__(
        self,
        log: logging.Logger,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.every_s = every_s
        self.clock = clock
        self._last: float | None = None
        #: events held back since the last line
        self.held = 0

    def warning(self, msg: str, *args: object) -> bool:
        """Log `msg % args` unless a line went out less than `every_s` ago (then count it);
        True when it was logged."""
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            self.held += 1
            return False
        if self.held:
            msg += " (and %d more like it in the %.0f s before, not logged one by one)"
            args = (*args, self.held, now - self._last if self._last is not None else 0.0)
        self.log.warning(msg, *args)
        self._last, self.held = now, 0
        return True
