"""How much of a CPU a runnable thread gets on this machine right now: a meter that wakes every
`interval_s`, spins for `work_s` of its own CPU time, and records wall / CPU for that spin.
1.0 = a CPU to itself; 3 = a third of one (other work shares it).

It measures the machine, not the system under test: the validation of the simulator on a
shared machine scales a CPU node kind's profile to the contention measured during each real
run (Profile.at_contention), since the same engine step costs ~3× more wall time at load 19
than at load 6. Its own load is work_s / interval_s (0.4 % by default).
"""

from __future__ import annotations

import statistics
import threading
import time


class ContentionMeter:
    def __init__(self, interval_s: float = 0.5, work_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.work_s = work_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="contention-meter", daemon=True)

    def __enter__(self) -> ContentionMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            c0, t0 = time.thread_time(), time.perf_counter()
            while time.thread_time() - c0 < self.work_s:
                pass
            self.samples.append((time.perf_counter() - t0) / (time.thread_time() - c0))

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")
