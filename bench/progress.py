"""Progress of a run on stderr: a rich progress bar on a terminal, a plain line every tenth of
the run otherwise (logs, CI), nothing with --quiet. stdout stays free for the table or JSON."""

from __future__ import annotations

import sys
import time
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from bench.records import RequestRecord


class RunProgress:
    def __init__(
        self, label: str, total: int | None, duration_s: float | None, quiet: bool
    ) -> None:
        self.label = label
        self.total = total
        self.duration_s = duration_s
        self.quiet = quiet
        self.ok = self.failed = 0
        self._rich: Progress | None = None
        self._task: TaskID | None = None
        self._start = time.perf_counter()
        self._next_step = 1
        self._printed = -1

    def __enter__(self) -> RunProgress:
        self._start = time.perf_counter()
        if not self.quiet and sys.stderr.isatty():
            self._rich = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[status]}"),
                console=Console(stderr=True),
            )
            self._rich.start()
            self._task = self._rich.add_task(self.label, total=self.total, status="")
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif not self.quiet and self._printed != self.ok + self.failed:
            self._line()

    def done(self, rec: RequestRecord) -> None:
        if rec.ok:
            self.ok += 1
        else:
            self.failed += 1
        if self._rich is not None and self._task is not None:
            self._rich.update(self._task, advance=1, status=f"ok {self.ok}  failed {self.failed}")
            return
        if self.quiet:
            return
        if self.total:
            frac = (self.ok + self.failed) / self.total
        elif self.duration_s:
            frac = (time.perf_counter() - self._start) / self.duration_s
        else:
            return
        if frac * 10 >= self._next_step:
            self._next_step = int(frac * 10) + 1
            self._line()

    def _line(self) -> None:
        self._printed = self.ok + self.failed
        of = f"/{self.total}" if self.total else ""
        print(
            f"{self.label}: {self.ok + self.failed}{of} done ({self.failed} failed), "
            f"{time.perf_counter() - self._start:.1f} s",
            file=sys.stderr,
            flush=True,
        )
