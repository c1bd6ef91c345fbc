"""The process supervisor of `duet up`: start children stage by stage (each stage's children
together, the next stage once all of them answer their health check), then watch them like an
orchestrator: a child that dies is restarted alone, with the same arguments (so the same
ports, node id, data directory), after an exponential backoff; the others are not touched. On
SIGINT/SIGTERM everything stops in reverse stage order.

Restart policy (`RestartPolicy`): a child that exits — or, restarted, is not healthy within
`startup_timeout_s`, or, running, has not answered its health URL at all (any status: a
draining node's 503 is an answer) for `liveness_timeout_s`: a hung or SIGSTOPped process, then
killed — has failed once. A gateway's liveness deadline is `gateway_liveness_timeout_s`,
shorter: gateways share the public port (SO_REUSEPORT) and the kernel keeps giving a frozen one
its share of new connections until its listener is gone, which only its death does from outside.
A life healthy for `stable_s` clears its count of failures in a row. After `max_restarts`
failures in a row the child crash-loops: it stays down and is reported (`ChildState.FAILED`)
while the rest keep serving. The delay before restart k of a run of failures is
`backoff_s * 2**(k-1)`, capped at `backoff_max_s`.
Every exit is said on stderr with its cause (exit code or signal, or the start-up timeout).
A child's failure during the first start-up is a crash like any other (a port taken for a while,
a secret mounted late): it is restarted with the same backoff and counted toward the same limit,
and the next stage starts once every child of this one has answered its health check or failed
at least once, with at least one of them up: a node that cannot start does not keep the rest
from serving. A stage none of whose children can ever start (all of them over the limit, or none
healthy after `startup_timeout`) stops everything, with an error naming them and their logs'
last lines: every later stage needs it (etcd, the coordinators, the nodes, the gateway).

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
import enum
import http.client
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from runtime.netns import entered

_COLOURS = (36, 33, 35, 32, 34, 31, 96, 93, 95, 92, 94)
#: how often a running child's health is checked (in a worker thread: a hung child must not
#: stall the supervision of the others)
_LIVENESS_EVERY_S = 2.0
_PR_SET_PDEATHSIG = 1


class ChildState(enum.StrEnum):
    STARTING = "starting"  # started, not yet healthy
    RUNNING = "running"  # answered its health check
    BACKOFF = "backoff"  # died; waits to be started again
    FAILED = "failed"  # crash-looped: stays down
    STOPPED = "stopped"  # stopped by the supervisor's shutdown


@dataclass(frozen=True)
class RestartPolicy:
    #: failures in a row after which a child stays down (0: never restart)
    max_restarts: int = 5
    #: first delay before a restart, doubled per failure in a row
    backoff_s: float = 1.0
    #: the longest delay before a restart
    backoff_max_s: float = 30.0
    #: a life healthy this long clears the count of failures in a row
    stable_s: float = 60.0
    #: a restarted child not healthy after this long is killed (one more failure)
    startup_timeout_s: float = 180.0
    #: a running child whose health URL has not answered at all (any status) for this long is
    #: killed: it is hung (0: never)
    liveness_timeout_s: float = 60.0
    #: the same for a gateway, shorter: gateways share the public port (SO_REUSEPORT) and the
    #: kernel keeps giving a frozen one its share of new connections until it is gone (0: never)
    gateway_liveness_timeout_s: float = 10.0

    def delay(self, failures: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, failures - 1))


def exit_cause(code: int | None) -> str:
    """'exited with code 3' or 'killed by SIGKILL' (Popen reports a signal as a negative code)."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


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
    #: the network namespace it runs in (`duet up --netns`): its health URL is asked from there
    netns: str | None = None
    #: its own liveness deadline (None: the policy's `liveness_timeout_s`; 0: never)
    liveness_timeout_s: float | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # -- supervision state (the supervisor's thread alone writes it) ---------------------------
    state: ChildState = ChildState.STARTING
    restarts: int = 0
    #: failures in a row (cleared by a life healthy for RestartPolicy.stable_s)
    failures: int = 0
    last_exit: int | None = None
    last_cause: str | None = None
    started_at: float = 0.0  # monotonic
    healthy_at: float | None = None  # monotonic
    next_start: float = 0.0  # monotonic, in BACKOFF
    #: wall-clock time of the next start, for `duet status`
    next_start_wall: float | None = None
    reaped: bool = field(default=False, repr=False)
    #: last time (monotonic) the child answered its health check
    last_alive: float = field(default=0.0, repr=False)
    probe: Future[bool] | None = field(default=None, repr=False)
    probe_at: float = field(default=0.0, repr=False)
    #: being stopped for good (autoscaling's scale-in): its exit is not a failure, no restart
    retiring: bool = False
    #: set once a retiring child exited and left supervision
    retired: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def status(self) -> dict[str, object]:
        """What `duet status` shows of this child (JSON-ready)."""
        return {
            "name": self.name,
            "pid": self.pid,
            "log": str(self.log_path),
            "url": self.health_url.rsplit("/health", 1)[0] if self.health_url else None,
            "state": str(self.state),
            "restarts": self.restarts,
            "failures_in_a_row": self.failures,
            "last_exit": self.last_exit,
            "last_cause": self.last_cause,
            "next_start": self.next_start_wall if self.state == ChildState.BACKOFF else None,
            "netns": self.netns,
        }


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
        # one lock for the list and the reads: the supervisor pumps a dead child's last lines
        # before following its next life, while this thread may be pumping too
        self._lock = threading.RLock()
        self._width = width

    def follow(self, name: str, path: Path, offset: int) -> None:
        """Follow `path` from `offset`; a restarted child's log replaces its previous life's."""
        fh = path.open("rb")
        fh.seek(offset)
        with self._lock:
            self.pump()  # the last words of a previous life first
            old = next((i for i, f in enumerate(self._files) if f[0] == name), None)
            n = len(self._files) if old is None else old
            prefix = name.ljust(self._width) + " | "
            if self.colour:
                prefix = f"\x1b[{_COLOURS[n % len(_COLOURS)]}m{prefix}\x1b[0m"
            if old is None:
                self._files.append((name, fh, prefix.encode()))
            else:
                self._files[old][1].close()
                self._files[old] = (name, fh, prefix.encode())

    def pump(self) -> None:
        with self._lock:
            for _, fh, prefix in self._files:
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
    def __init__(
        self,
        stages: list[list[Child]],
        *,
        startup_timeout: float = 600.0,
        stop_timeout: float = 45.0,
        tail: bool = True,
        on_ready: Callable[[Supervisor], bool] | None = None,
        on_started: Callable[[Child], None] | None = None,
        on_change: Callable[[Supervisor], None] | None = None,
        restart: RestartPolicy = RestartPolicy(),
    ) -> None:
        self.stages = stages
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.on_ready = on_ready
        self.on_started = on_started
        #: called after any child changes state (started, up, died, gave up)
        self.on_change = on_change
        self.restart = restart
        self._probes: ThreadPoolExecutor | None = None
        self.stopping = threading.Event()
        self._signals = 0
        self._force = threading.Event()
        self._tail_stop = threading.Event()
        colour = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
        width = max((len(c.name) for stage in stages for c in stage), default=8)
        self._tail = _Tail(sys.stderr, colour, self._tail_stop, width) if tail else None
        self._preexec = {
            sig: _pdeathsig_hook(sig) for sig in {c.death_signal for c in self.children}
        }
        #: set once every stage is up and `on_ready` agreed: children may be added or retired
        self.ready = threading.Event()
        #: work other threads hand to the supervision thread (add or retire a child)
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = (
            queue.SimpleQueue()
        )

    @property
    def children(self) -> list[Child]:
        return [c for stage in self.stages for c in stage]

    def say(self, msg: str) -> None:
        print(f"duet up: {msg}", file=sys.stderr, flush=True)

    def _last_words(self, c: Child) -> None:
        if self._tail is None:  # --quiet: the operator has not seen its last words yet
            with contextlib.suppress(OSError):
                for line in c.log_path.read_text(errors="replace").splitlines()[-15:]:
                    print(f"  {c.name} | {line}", file=sys.stderr)

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True when a stop was asked meanwhile."""
        return self.stopping.wait(seconds)

    # -- children added and removed while running (autoscaling; any thread) -------------------
    def call(self, fn: Callable[[], object]) -> Future[object]:
        """Run `fn` on the supervision thread (next tick, ≤ 0.5 s once nothing holds the thread
        up); its result in the future. The caller may `cancel()` it while the thread has not
        taken it yet: then `fn` never runs (a `False` from `cancel()` means it ran or runs)."""
        fut: Future[object] = Future()
        self._calls.put((fn, fut))
        return fut

    def add(self, stage: int, c: Child) -> None:
        """Supervision thread: start `c` now and supervise it with `stage`'s children (it
        restarts like them; on shutdown it stops with them)."""
        if c.death_signal not in self._preexec:
            self._preexec[c.death_signal] = _pdeathsig_hook(c.death_signal)
        self.stages[stage].append(c)
        self.say(f"starting {c.name} (log {c.log_path})")
        self._start(c)

    def retire(self, c: Child) -> None:
        """Supervision thread: stop `c` for good (SIGTERM; SIGKILL after `stop_timeout`); it
        leaves supervision once it exited (`c.retired` is set then)."""
        c.retiring, c.next_start = True, time.monotonic() + self.stop_timeout  # the kill deadline
        if c.proc is not None and c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
        self.say(f"stopping {c.name} (scale-in)")

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():  # cancelled by a caller that gave up
                continue
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

    def _retire_tick(self, c: Child, now: float) -> None:
        assert c.proc is not None
        if c.proc.poll() is None:
            if now > c.next_start:
                self.say(f"{c.name} did not stop in time: killing it")
                self._kill_group(c)
            return
        self._kill_group(c)
        c.last_exit, c.last_cause, c.state = (
            c.proc.returncode,
            "stopped by scale-in",
            ChildState.STOPPED,
        )
        for stage in self.stages:
            if c in stage:
                stage.remove(c)
        self.say(f"{c.name} stopped ({exit_cause(c.proc.returncode)}); no longer supervised")
        c.retired.set()
        self._changed()

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
            c.proc = subprocess.Popen(
                c.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=c.env,
                start_new_session=True,
                preexec_fn=self._preexec[c.death_signal],
            )
        c.state, c.started_at, c.healthy_at, c.reaped = (
            ChildState.STARTING,
            time.monotonic(),
            None,
            False,
        )
        c.probe = None  # a probe of the previous life says nothing about this one
        if self._tail is not None:
            self._tail.follow(c.name, c.log_path, offset)
        if self.on_started is not None:
            self.on_started(c)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    @staticmethod
    def _healthy(c: Child) -> bool:
        if c.health_url is None:
            return True
        try:
            with entered(c.netns), urllib.request.urlopen(c.health_url, timeout=2) as r:
                return r.status == 200
        except (
            urllib.error.URLError,
            http.client.HTTPException,
            ConnectionError,
            TimeoutError,
            OSError,
        ):
            return False

    @staticmethod
    def _answers(c: Child) -> bool:
        """Liveness, not readiness: any HTTP answer (a draining node's 503 included) proves the
        process is not hung; only silence (refused, reset, timed out) does not."""
        if c.health_url is None:  # nothing to ask (only children with a health URL are probed)
            return False
        try:
            with entered(c.netns), urllib.request.urlopen(c.health_url, timeout=2):
                return True
        except urllib.error.HTTPError:
            return True
        except (
            urllib.error.URLError,
            http.client.HTTPException,
            ConnectionError,
            TimeoutError,
            OSError,
        ):
            return False

    def _start_stage(self, stage: list[Child]) -> bool:
        """Start `stage` and supervise every child started so far (earlier stages included)
        until the stage is through: each child up or failed at least once, one of them up.
        False to stop everything: asked to, or the stage cannot start (said why)."""
        if not stage:
            return True
        for c in stage:
            self.say(f"starting {c.name} (log {c.log_path})")
            self._start(c)
        began = time.monotonic()
        while True:
            now = time.monotonic()
            for c in self.children:
                if c.proc is not None and not self.stopping.is_set():
                    self._tick(c, now)
            up = any(c.state == ChildState.RUNNING for c in stage)
            if up and all(c.state == ChildState.RUNNING or c.failures for c in stage):
                return True
            if all(c.state == ChildState.FAILED for c in stage):
                self._cannot_start(stage, "over the limit of failures in a row")
                return False
            # (one up: a slow first life is killed at its own start-up limit, then counts as failed)
            if not up and now - began > self.startup_timeout:
                self._cannot_start(stage, f"none healthy after {self.startup_timeout:.0f} s")
                return False
            if self.wait(0.2):  # readiness polling interval
                return False

    def _cannot_start(self, stage: list[Child], why: str) -> None:
        """The error that ends a start-up: which processes, why, and their logs' last lines
        (always printed: this is the operator's only clue, tail or --quiet)."""
        names = ", ".join(c.name for c in stage)
        self.say(f"{names} could not start ({why}); everything after them needs them: stopping")
        for c in stage:
            self.say(
                f"{c.name}: {c.failures} failure(s) in a row, last: {c.last_cause or c.state}; "
                f"last lines of {c.log_path}:"
            )
            with contextlib.suppress(OSError):
                for line in c.log_path.read_text(errors="replace").splitlines()[-15:]:
                    print(f"  {c.name} | {line}", file=sys.stderr, flush=True)

    # -- run ---------------------------------------------------------------------------------
    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        if self._tail is not None:
            self._tail.start()
        self._probes = ThreadPoolExecutor(max_workers=4, thread_name_prefix="duet-up-health")
        try:
            for stage in self.stages:
                if not self._start_stage(stage):
                    return 0 if self.stopping.is_set() else 1
            if self.on_ready is not None and not self.on_ready(self):
                return 0 if self.stopping.is_set() else 1
            self.ready.set()
            while not self.wait(0.5):  # supervision interval
                self.supervise_once()
            return 0
        finally:
            self.say("stopping (Ctrl-C again to kill at once)" if self._signals else "stopping")
            self._probes.shutdown(wait=False, cancel_futures=True)
            self._shutdown()
            if self._tail is not None:
                self._tail_stop.set()
                self._tail.join(2)
                self._tail.close()
            for s, h in old.items():
                signal.signal(s, h)
            self.say("stopped")

    # -- supervise ---------------------------------------------------------------------------
    def supervise_once(self) -> None:
        """One round of the supervision thread once everything is up: the calls other threads
        handed over, then one look at every child."""
        self._run_calls()
        for c in self.children:
            if self.stopping.is_set():
                break
            self._tick(c, time.monotonic())

    def _tick(self, c: Child, now: float) -> None:
        """One look at one child: notice its death or its health, start it when its backoff is
        over."""
        assert c.proc is not None
        if c.retiring:
            self._retire_tick(c, now)
            return
        if c.state in (ChildState.STARTING, ChildState.RUNNING):
            if c.proc.poll() is not None:
                lived = now - c.started_at
                self._failed(c, f"{exit_cause(c.proc.returncode)} after {lived:.1f} s", now)
            elif c.state == ChildState.STARTING:
                if self._healthy(c):
                    c.state, c.healthy_at, c.last_alive = ChildState.RUNNING, now, now
                    self.say(
                        f"{c.name} is up again (pid {c.pid}, restart {c.restarts})"
                        if c.restarts
                        else f"{c.name} is up (pid {c.pid})"
                    )
                    self._changed()
                elif now - c.started_at > (limit := self._startup_limit(c)):
                    self._kill_group(c)
                    self._failed(c, f"not healthy {limit:.0f} s after its start", now)
            elif self._hung(c, now):
                self._kill_group(c)
                self._failed(
                    c, f"not answering its health check for {self._liveness(c):.0f} s", now
                )
            elif (
                c.failures
                and c.healthy_at is not None
                and now - c.healthy_at >= self.restart.stable_s
            ):
                c.failures = 0  # a stable life: the next death starts a new run of failures
                self._changed()
        elif c.state == ChildState.BACKOFF and now >= c.next_start:
            c.restarts += 1
            self.say(f"restarting {c.name} (restart {c.restarts}; last: {c.last_cause})")
            self._start(c)

    def _startup_limit(self, c: Child) -> float:
        """A first life may load a model the first time (the whole start-up's timeout); a
        restart gets the policy's."""
        return self.startup_timeout if c.restarts == 0 else self.restart.startup_timeout_s

    def _liveness(self, c: Child) -> float:
        return (
            self.restart.liveness_timeout_s
            if c.liveness_timeout_s is None
            else c.liveness_timeout_s
        )

    def _hung(self, c: Child, now: float) -> bool:
        """Probe a running child's health now and then (off the supervision thread); True once
        it has not answered for its liveness deadline."""
        limit = self._liveness(c)
        if not limit or c.health_url is None or self._probes is None:
            return False
        if c.probe is not None and c.probe.done():
            if c.probe.exception() is None and c.probe.result():
                c.last_alive = c.probe_at
            c.probe = None
        if c.probe is None and now - c.probe_at >= _LIVENESS_EVERY_S:
            c.probe_at, c.probe = now, self._probes.submit(self._answers, c)
        return now - c.last_alive > limit

    def _failed(self, c: Child, cause: str, now: float) -> None:
        """`c` died (or was killed for not starting): reap its group, then back off or give up."""
        assert c.proc is not None
        self._kill_group(c)
        c.last_exit, c.last_cause = c.proc.returncode, cause
        if c.healthy_at is not None and now - c.healthy_at >= self.restart.stable_s:
            c.failures = 0
        c.failures += 1
        if c.failures > self.restart.max_restarts:
            c.state = ChildState.FAILED
            self.say(
                f"{c.name} {cause}: {c.failures} failures in a row, over the limit of "
                f"{self.restart.max_restarts} restarts; leaving it down (the rest keep serving)"
            )
        else:
            delay = self.restart.delay(c.failures)
            c.state, c.next_start = ChildState.BACKOFF, now + delay
            c.next_start_wall = time.time() + delay
            self.say(
                f"{c.name} {cause}; restarting it in {delay:.1f} s ({c.failures} failure(s) in a "
                f"row; left down after {self.restart.max_restarts + 1}); see {c.log_path}"
            )
        self._last_words(c)
        self._changed()

    @staticmethod
    def _kill_group(c: Child) -> None:
        """SIGKILL the child's process group (it, if still there, and anything it left behind),
        then reap it; once reaped the group id may be reused, so it is never signalled again."""
        assert c.proc is not None
        if c.reaped:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.proc.pid, signal.SIGKILL)
        c.proc.wait()
        c.reaped = True

    def _shutdown(self) -> None:
        for stage in reversed(self.stages):
            live = [c for c in stage if c.proc is not None and not c.reaped]
            for c in live:
                if c.proc.poll() is None:  # type: ignore[union-attr]
                    c.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            for c in live:
                assert c.proc is not None
                waited = 0.0
                while (
                    c.proc.poll() is None
                    and waited < self.stop_timeout
                    and not self._force.is_set()
                ):
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        c.proc.wait(0.2)
                    waited += 0.2
                if c.proc.poll() is None:
                    self.say(f"{c.name} did not stop in time: killing it")
                self._kill_group(c)
                c.state = ChildState.STOPPED
        self._changed()
