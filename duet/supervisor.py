"""A small process supervisor for `duet up`: start child processes, wait until each is healthy,
forward SIGINT/SIGTERM, and stop everything when any child dies (exit code != 0 then).

Invariant: when `run` returns, no child it started is still running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


@dataclass
class Child:
    name: str
    args: list[str]
    health_url: str | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)


class Supervisor:
    def __init__(self, children: list[Child], startup_timeout: float = 300.0) -> None:
        self.children = children
        self.startup_timeout = startup_timeout
        self._stopping = False

    def _say(self, msg: str) -> None:
        print(f"duet up: {msg}", file=sys.stderr, flush=True)

    def _wait_healthy(self, child: Child) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline and not self._stopping:
            assert child.proc is not None
            if child.proc.poll() is not None:
                return False
            if child.health_url is None:
                return True
            try:
                with urllib.request.urlopen(child.health_url, timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)  # readiness polling interval
        return False

    def _stop(self, *_: object) -> None:
        self._stopping = True

    def run(self) -> int:
        old = {s: signal.signal(s, self._stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for c in self.children:
                self._say(f"starting {c.name}: {' '.join(c.args)}")
                c.proc = subprocess.Popen(c.args, start_new_session=True)
                if not self._wait_healthy(c):
                    if not self._stopping:
                        self._say(f"{c.name} did not become healthy; stopping")
                        return 1
                    return 0
                self._say(f"{c.name} is up")
            self._say("all up; Ctrl-C stops everything")
            while not self._stopping:
                for c in self.children:
                    assert c.proc is not None
                    if c.proc.poll() is not None:
                        self._say(f"{c.name} exited with {c.proc.returncode}; stopping the rest")
                        return 1
                time.sleep(0.5)  # supervision interval
            return 0
        finally:
            self._shutdown()
            for s, h in old.items():
                signal.signal(s, h)

    def _shutdown(self) -> None:
        for c in reversed(self.children):
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        for c in reversed(self.children):
            if c.proc is None:
                continue
            try:
                c.proc.wait(40)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
