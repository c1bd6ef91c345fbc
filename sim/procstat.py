"""The CPU clocks of a running cluster's processes, read from Linux's /proc: which process is
which part (`duet up`'s children: gateway, coordinator, node:<id>), and per thread the kernel
scheduler's own account (/proc/<pid>/task/<tid>/schedstat: nanoseconds run on a CPU, nanoseconds
waited runnable on a run queue).

Why the scheduler's account: on a shared machine a busy thread's wall time is its CPU time
stretched by the time it waits for a core. `(run + wait) / run` of the node's engine thread is
that stretch as the kernel measured it for the system under test itself — the contention its
steps ran at — where sim/contention.py's meter (a thread that sleeps, then spins 2 ms) reads the
share a *waking* thread gets, which the scheduler favours: at load 10 on 2 cores the meter read
1.0 while the engine thread's steps took 4× their CPU time.

A node's threads: its main thread is the event loop (HTTP, tokenize, SSE: `loop`); of the others,
the one that ran most over an interval is the engine's step loop (`step`), the rest (torch's, the
KV transport's progress threads) are `aux`.
Invariant: only reads; a process or thread that ends between two reads counts what was read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # gone, or not Linux
        return None


def cmdline(pid: int) -> list[str]:
    raw = _read(PROC / str(pid) / "cmdline")
    return raw.rstrip("\0").split("\0") if raw else []


def children(pid: int) -> list[int]:
    """Direct children of `pid` (its supervised processes; their own forks are left out)."""
    out = []
    for d in PROC.iterdir():
        if not d.name.isdigit():
            continue
        stat = _read(d / "stat")
        # field 4 (ppid) follows the command name, which may hold spaces: split after its ')'
        if stat and int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            out.append(int(d.name))
    return out


def part(pid: int) -> str | None:
    """gateway, coordinator, node:<node id>, or None (etcd, anything else)."""
    cmd = cmdline(pid)
    if "duet" not in cmd or cmd.index("duet") + 1 >= len(cmd):
        return None
    sub = cmd[cmd.index("duet") + 1]
    if sub == "node":
        return "node:" + (cmd[cmd.index("--node-id") + 1] if "--node-id" in cmd else str(pid))
    return sub if sub in ("gateway", "coordinator") else None


def cluster(up_pid: int) -> dict[str, int]:
    """`duet up`'s parts by name → pid."""
    out: dict[str, int] = {}
    for pid in children(up_pid):
        name = part(pid)
        if name is not None:
            out[name if name not in out else f"{name}#{pid}"] = pid
    return out


@dataclass
class Clock:
    """Nanoseconds run and waited runnable, summed over some threads."""

    run_ns: int = 0
    wait_ns: int = 0

    def __sub__(self, other: Clock) -> Clock:
        return Clock(self.run_ns - other.run_ns, self.wait_ns - other.wait_ns)

    def __add__(self, other: Clock) -> Clock:
        return Clock(self.run_ns + other.run_ns, self.wait_ns + other.wait_ns)

    @property
    def cpu_s(self) -> float:
        return self.run_ns / 1e9

    @property
    def stretch(self) -> float:
        """(run + wait) / run: 1.0 = a core whenever runnable; nan when it never ran."""
        return (self.run_ns + self.wait_ns) / self.run_ns if self.run_ns > 0 else float("nan")


@dataclass
class Snapshot:
    """Every thread's clock, by (part, tid)."""

    threads: dict[tuple[str, int], Clock] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)

    def __sub__(self, before: Snapshot) -> Snapshot:
        return Snapshot(
            {k: c - before.threads.get(k, Clock()) for k, c in self.threads.items()}, self.pids
        )

    def parts(self) -> dict[str, Clock]:
        """Per part: `gateway`, `coordinator` (all threads), and per node `node:X/loop` (the main
        thread), `node:X/step` (the non-main thread that ran most over this interval: the engine's
        step loop) and `node:X/aux` (the rest: torch's, the KV transport's threads)."""
        out: dict[str, Clock] = {}
        for name, pid in self.pids.items():
            mine = {tid: c for (n, tid), c in self.threads.items() if n == name}
            if not name.startswith("node:"):
                out[name] = sum(mine.values(), Clock())
                continue
            others = {tid: c for tid, c in mine.items() if tid != pid}
            step = max(others, key=lambda t: others[t].run_ns, default=None)
            out[f"{name}/loop"] = mine.get(pid, Clock())
            out[f"{name}/step"] = others.pop(step) if step is not None else Clock()
            out[f"{name}/aux"] = sum(others.values(), Clock())
        return out

    def sum(self, suffix: str) -> Clock:
        return sum((c for k, c in self.parts().items() if k.endswith(suffix)), Clock())


def thread_clock(pid: int, tid: int) -> Clock:
    raw = _read(PROC / str(pid) / "task" / str(tid) / "schedstat")
    if not raw:
        return Clock()
    run, wait, *_ = raw.split()
    return Clock(int(run), int(wait))


def snapshot(parts: dict[str, int]) -> Snapshot:
    out: dict[tuple[str, int], Clock] = {}
    for name, pid in parts.items():
        try:
            tids = [int(t.name) for t in (PROC / str(pid) / "task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            out[(name, tid)] = thread_clock(pid, tid)
    return Snapshot(out, dict(parts))


def available() -> bool:
    return _read(PROC / "self" / "schedstat") is not None
