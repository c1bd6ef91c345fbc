"""Starting and stopping `tests.kvtransfer.peer` processes, with deadlines, never sleeps."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 30.0


class PeerProcess:
    def __init__(
        self,
        backend: str,
        engine_id: str,
        seed: int,
        layout: dict[str, Any] | None = None,
        secret: str | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.seed = seed
        # Closed in stop(): it outlives this constructor, so no `with` block.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self._stderr_text = ""
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.kvtransfer.peer",
                "--backend",
                backend,
                "--engine-id",
                engine_id,
                "--seed",
                str(seed),
                "--layout",
                json.dumps(layout or {}),
                # One argv word: a secret may start with "-", which argparse would
                # take for an option of its own.
                *((f"--secret={secret}",) if secret else ()),
            ],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        self.port = self._wait_ready()
        # Keep draining stdout so a chatty library can never block the peer on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self) -> int:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while (left := deadline - time.monotonic()) > 0:
                if not sel.select(left):
                    continue
                line = self.proc.stdout.readline()
                if not line:
                    break  # exited
                if line.startswith(b"READY "):
                    return int(line.split()[1])
        finally:
            sel.close()
        self.stop()
        raise RuntimeError(f"peer {self.engine_id} did not start:\n{self._stderr_text}")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stderr(self) -> str:
        if self._stderr.closed:
            return self._stderr_text
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def kill(self) -> None:
        """SIGKILL, and wait until the process is really gone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case a test stopped it
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the peer exits on EOF
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if not self._stderr.closed:
            # Kept for stderr() after the file is gone (a failed start reports it).
            self._stderr_text = self.stderr()
            self._stderr.close()
