"""`duet up` when a process's FIRST start fails: it is a crash like any later one. A colocated
node is given a cluster secret file that does not exist yet (a secret mounted late), so every
start of it exits at once: the cluster still comes up and serves on the other node, the failing
one is restarted with the backoff and shown in `duet status` (state, failures, last exit); once
the file appears its next start works, it registers, and the cluster routes to it.

(A stage none of whose processes can ever start, such as etcd, stops `duet up` with an error
naming it and its log's last lines: tests/duet/test_supervisor.py, on plain processes.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import openai

from tests.duet.test_up import start_up, stop_and_check_nothing_left, wait_banner
from tests.procs import free_port
from tests.wait import wait_for


def test_a_node_whose_first_start_fails_is_restarted_while_the_cluster_serves(
    tiny_llama: Path, tmp_path: Path
) -> None:
    late = tmp_path / "late.secret"
    (tmp_path / "cluster.toml").write_text(f"""
[restart]
max_restarts = 1000
backoff_s = 0.2
backoff_max_s = 1.0
[[nodes]]
role = "both"
[[nodes]]
role = "both"
args = ["--cluster-secret-file", "{late}"]
""")
    home = tmp_path / "home"
    up = start_up(
        home,
        tiny_llama,
        free_port(),
        tmp_path / "up.log",
        "--config",
        str(tmp_path / "cluster.toml"),
    )

    def child(name: str) -> dict[str, Any]:
        state = json.loads((home / "up" / "state.json").read_text())
        return next(c for c in state["children"] if c["name"] == name)

    def status() -> tuple[int, dict[str, Any]]:
        r = subprocess.run(
            [sys.executable, "-m", "duet", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "DUET_HOME": str(home)},
        )
        return r.returncode, json.loads(r.stdout)

    try:
        key = wait_banner(up)  # up, with both-1 down: before, its first failure stopped everything
        assert "all up but both-1" in up.log(), up.log()[-3000:]
        client = openai.OpenAI(base_url=up.url + "/v1", api_key=key, max_retries=0, timeout=60)
        r = client.chat.completions.create(
            model=tiny_llama.name,
            max_tokens=4,
            temperature=0,
            messages=[{"role": "user", "content": "hello"}],
        )
        assert r.usage.completion_tokens == 4
        # restarted with the backoff like any crash, each failure counted and shown
        wait_for(lambda: child("both-1")["restarts"] >= 2, 120, "both-1 restarted twice")
        rc, info = status()
        shown = next(c for c in info["up"]["children"] if c["name"] == "both-1")
        assert shown["state"] in ("backoff", "starting") and shown["failures_in_a_row"] >= 2, shown
        assert shown["last_cause"].startswith("exited with code"), shown
        assert "cannot read the cluster secret file" in (home / "logs" / "both-1.log").read_text()
        assert (
            next(c for c in info["up"]["children"] if c["name"] == "both-0")["state"] == "running"
        )

        # The secret arrives: the next start works, registers, and is routed to.
        fd = os.open(late, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, (home / "up" / "cluster.secret").read_bytes())
        os.close(fd)
        wait_for(lambda: child("both-1")["state"] == "running", 120, "both-1 up")
        secret = (home / "up" / "cluster.secret").read_text().strip()
        coordinator = json.loads((home / "up" / "state.json").read_text())["coordinators"][0]

        def ready_nodes() -> set[str]:
            req = urllib.request.Request(
                coordinator + "/cluster", headers={"Authorization": f"Bearer {secret}"}
            )
            with urllib.request.urlopen(req, timeout=5) as resp:
                return {n["node_id"] for n in json.loads(resp.read())["nodes"] if n["ready"]}

        wait_for(
            lambda: ready_nodes() == {"both-0", "both-1"}, 60, "both nodes ready in the coordinator"
        )
        rc, info = status()
        assert rc == 0 and {c["state"] for c in info["up"]["children"]} == {"running"}, info["up"]
        stop_and_check_nothing_left(up, home, signal.SIGTERM)
    finally:
        up.kill()
