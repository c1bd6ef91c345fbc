"""Launching duet processes for benchmarks and tests: start a command on a loopback port, wait
until `/health` answers 200, and always stop it (SIGTERM, then SIGKILL on timeout).

Invariant: a Proc started inside `running(...)` is stopped when the block exits, even on error."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from runtime.ports import free_port


class Proc:
    def __init__(
        self, args: list[str], port: int, log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.args = args
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.args} exited with {self.proc.returncode}:\n{self.log()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)  # polling interval of a readiness probe, not a race cover-up
        raise TimeoutError(f"{self.args} not healthy after {timeout}s:\n{self.log()[-3000:]}")

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@contextlib.contextmanager
def running(*procs: Proc, timeout: float = 180.0) -> Iterator[tuple[Proc, ...]]:
    try:
        for p in procs:
            p.wait_healthy(timeout)
        yield procs
    finally:
        for p in procs:
            p.terminate()


def duet_node(
    role: str,
    model: str,
    log_dir: Path,
    *extra: str,
    port: int | None = None,
    threads: int | None = 1,
    env: dict[str, str] | None = None,
) -> Proc:
    """A `duet node --role ROLE` process on a free loopback port."""
    port = port or free_port()
    args = [
        sys.executable,
        "-m",
        "duet",
        "node",
        "--role",
        role,
        "--model",
        str(model),
        "--port",
        str(port),
        *(["--threads", str(threads)] if threads else []),
        *extra,
    ]
    return Proc(args, port, log_dir / f"{role}-{port}.log", env=env)
