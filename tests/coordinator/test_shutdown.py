"""A coordinator stops on SIGTERM even when etcd is already gone (duet up stops etcd last, but an
operator's etcd may die first): resigning must not wait forever on an unreachable etcd."""

from __future__ import annotations

import subprocess
from pathlib import Path

from coordinator.etcd_server import EtcdServer
from tests.coordinator.conftest import coordinator, get
from tests.wait import wait_for


def test_sigterm_with_etcd_gone_exits(etcd: EtcdServer, tmp_path: Path) -> None:
    c = coordinator(tmp_path, etcd.url)
    try:
        c.wait_healthy(120)
        wait_for(lambda: get(c.url + "/health").get("is_leader"), 30, "the coordinator to lead")
        etcd.kill()
        c.proc.terminate()
        try:
            rc = c.proc.wait(60)  # a hang is the defect; 60 s is far above the resign bound
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"coordinator still running 60 s after SIGTERM:\n{c.log()[-2000:]}"
            ) from None
        assert rc == 0, c.log()[-2000:]
    finally:
        c.kill()
