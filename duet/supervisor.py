"""The process supervisor of `duet up`: start children stage by stage (each stage's children
together, the next stage once all of them answer their health check), watch them, and on
SIGINT/SIGTERM — or when any child dies — stop everything in reverse stage order.

Every child writes stdout+stderr to its own log file; a tail thread prints new lines of all
of them, prefixed with the child's name (coloured on a terminal), unless `tail=False`.

Invariants:
- when `run` returns, no process it started is running: each child is the leader of its own
  process group (so a terminal's Ctrl-C reaches only the supervisor, which stops children in
  order), and after a child exits its whole group is SIGKILLed to take any grandchild with it;
- a child gets SIGTERM if the supervisor itself dies without cleaning up (Linux
  PR_SET_PDEATHSIG), so even a SIGKILLed `duet up` leaves no orphans behind;
- a second SIGINT/SIGTERM during shutdown skips the grace periods (SIGKILL at once).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

_COLOURS = (36, 33, 35, 32, 34, 31, 96, 93, 95, 92, 94)
_PR_SET_PDEATHSIG = 1


@dataclass
class Child:
    name: str
    args: list[str]
    log_path: Path
    health_url: str | None = None
    env: dict[str, str] | None = None
    #: what the child gets if the supervisor dies without stopping it (SIGKILL for a child
    #: whose clean shutdown needs another child that gets the same signal at the same time)
    death_signal: int = signal.SIGTERM
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid


def _pdeathsig_hook(sig: int) -> Callable[[], None] | None:
    """A preexec_fn asking the kernel to send `sig` to the child when its parent dies (Linux
    only). libc is loaded here, before any fork: the hook only calls an already-bound function."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    prctl = libc.prctl

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return hook


class _Tail(threading.Thread):
    """Follows every child's log file from the point the child was started."""

    def __init__(self, out: IO[str], colour: bool, stop: threading.Event, width: int) -> None:
        super().__init__(name="duet-up-tail", daemon=True)
        self.out, self.colour, self._stop_evt = out, colour, stop
        self._files: list[tuple[str, IO[bytes], bytes]] = []
        self._lock = threading.Lock()
        self._width = width

    def follow(self, name: str, path: Path, offset: int) -> None:
        fh = path.open("rb")
        fh.seek(offset)
        with self._lock:
            n = len(self._files)
            prefix = name.ljust(self._width) + " | "
            if self.colour:
                prefix = f"\x1b[{_COLOURS[n % len(_COLOURS)]}m{prefix}\x1b[0m"
            self._files.append((name, fh, prefix.encode()))

    def pump(self) -> None:
        with self._lock:
            files = list(self._files)
        for _, fh, prefix in files:
            while True:
                line = fh.readline()
                if not line:
                    break
                if not line.endswith(b"\n"):  # a partial line: wait for the rest of it
                    fh.seek(-len(line), os.SEEK_CUR)
                    break
                self.out.write((prefix + line).decode(errors="replace"))
        self.out.flush()

    def run(self) -> None:
        while not self._stop_evt.wait(0.2):  # tail interval
            self.pump()

    def close(self) -> None:
        self.pump()
        with self._lock:
            for _, fh, _ in self._files:
                fh.close()


class Supervisor:
    def __init__(self, stages: list[list[Child]], *, startup_timeout: float = 600.0,
                 stop_timeout: float = 45.0, tail: bool = True,
                 on_ready: Callable[[Supervisor], bool] | None = None,
                 on_started: Callable[[Child], None] | None = None) -> None:  # fmt: skip
        self.stages = stages
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.on_ready = on_ready
        self.on_started = on_started
        self.stopping = threading.Event()
        self._signals = 0
        self._force = threading.Event()
        self._tail_stop = threading.Event()
        colour = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
        width = max((len(c.name) for stage in stages for c in stage), default=8)
        self._tail = _Tail(sys.stderr, colour, self._tail_stop, width) if tail else None
        self._preexec = {sig: _pdeathsig_hook(sig) for sig in {c.death_signal for c in self.children}}

    @property
    def children(self) -> list[Child]:
        return [c for stage in self.stages for c in stage]

    def say(self, msg: str) -> None:
        print(f"duet up: {msg}", file=sys.stderr, flush=True)

    def _died(self, c: Child, when: str) -> None:
        assert c.proc is not None
        self.say(f"{c.name} exited with {c.proc.returncode} {when}; see {c.log_path}")
        if self._tail is None:  # --quiet: the operator has not seen its last words yet
            with contextlib.suppress(OSError):
                for line in c.log_path.read_text(errors="replace").splitlines()[-15:]:
                    print(f"  {c.name} | {line}", file=sys.stderr)

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True when a stop was asked meanwhile."""
        return self.stopping.wait(seconds)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        self.stopping.set()
        if self._signals > 1:
            self._force.set()

    # -- start -------------------------------------------------------------------------------
    def _start(self, c: Child) -> None:
        c.log_path.parent.mkdir(parents=True, exist_ok=True)
        with c.log_path.open("ab") as log:
            offset = log.tell()
            c.proc = subprocess.Popen(c.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=c.env,
                                      start_new_session=True, preexec_fn=self._preexec[c.death_signal])  # fmt: skip
        if self._tail is not None:
            self._tail.follow(c.name, c.log_path, offset)
        if self.on_started is not None:
            self.on_started(c)

    @staticmethod
    def _healthy(c: Child) -> bool:
        if c.health_url is None:
            return True
        try:
            with urllib.request.urlopen(c.health_url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def _start_stage(self, stage: list[Child]) -> bool:
        for c in stage:
            self.say(f"starting {c.name} (log {c.log_path})")
            self._start(c)
        pending = list(stage)
        deadline = self.startup_timeout
        waited = 0.0
        while pending:
            for c in list(pending):
                assert c.proc is not None
                if c.proc.poll() is not None:
                    self._died(c, "during start-up")
                    return False
                if self._healthy(c):
                    self.say(f"{c.name} is up (pid {c.proc.pid})")
                    pending.remove(c)
            if not pending:
                break
            if waited > deadline:
                self.say(f"{', '.join(c.name for c in pending)} not healthy after {deadline:.0f}s; stopping")
                return False
            if self.wait(0.2):  # readiness polling interval
                return False
            waited += 0.2
        return True

    # -- run ---------------------------------------------------------------------------------
    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        if self._tail is not None:
            self._tail.start()
        try:
            for stage in self.stages:
                if not self._start_stage(stage):
                    return 0 if self.stopping.is_set() else 1
            if self.on_ready is not None and not self.on_ready(self):
                return 0 if self.stopping.is_set() else 1
            while not self.wait(0.5):  # supervision interval
                for c in self.children:
                    assert c.proc is not None
                    if c.proc.poll() is not None:
                        self._died(c, "unexpectedly; stopping the rest")
                        return 1
            return 0
        finally:
            self.say("stopping (Ctrl-C again to kill at once)" if self._signals else "stopping")
            self._shutdown()
            if self._tail is not None:
                self._tail_stop.set()
                self._tail.join(2)
                self._tail.close()
            for s, h in old.items():
                signal.signal(s, h)
            self.say("stopped")

    def _shutdown(self) -> None:
        for stage in reversed(self.stages):
            live = [c for c in stage if c.proc is not None]
            for c in live:
                if c.proc.poll() is None:  # type: ignore[union-attr]
                    c.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            for c in live:
                assert c.proc is not None
                waited = 0.0
                while c.proc.poll() is None and waited < self.stop_timeout and not self._force.is_set():
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        c.proc.wait(0.2)
                    waited += 0.2
                if c.proc.poll() is None:
                    self.say(f"{c.name} did not stop in time: killing it")
                # Kill the whole group: the child if it is still there, and anything it left behind.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
