"""The console's Cluster page against a real `duet up` (etcd, coordinator, prefill-0, decode-0,
gateway under its supervisor), in headless Chromium: signed in with the admin key `duet up`
wrote, the page lists every node with its role and the coordinator leader; a SIGKILLed node is
restarted by the supervisor, and the page — left open, never reloaded — shows its restart count
go from 0 to 1 and the node ready again (the live refresh, not a new page load). A node's row
has its process's restarts too. A state file left by a `duet up` that was SIGKILLed (it could
not remove it) lists no process, as `duet status` ignores it: they are gone, not "running".

One `duet up` on the tiny model (the up-tests' flags: --threads 1, 256 KV blocks), a short
restart backoff so the restart comes at once. Under CI=true a missing browser is a failure
(the browser fixture of test_console.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.console.pages import _supervised
from tests.duet.test_up import start_up, wait_banner
from tests.observe.test_console import browser, sign_in  # noqa: F401  (browser: a fixture)
from tests.procs import Proc, free_port
from tests.wait import wait_for

#: the console's cluster tables, read at once in the page (the live refresh replaces them
#: every 3 s): {caption: [{column: cell}]}
_TABLES_JS = """
const out = {};
for (const t of document.querySelectorAll('#live table')) {
  const head = [...t.tHead.rows[0].cells].map(c => c.innerText.trim());
  out[t.caption.textContent] = [...t.tBodies[0].rows].map(
    r => Object.fromEntries([...r.cells].map((c, i) => [head[i], c.innerText.trim()])));
}
return out;
"""
NODES, PROCS, REPLICAS = "Nodes", "Processes supervised by duet up", "Coordinator replicas"


@dataclass
class Up:
    proc: Proc
    home: Path

    def child(self, name: str) -> dict[str, Any]:
        state = json.loads((self.home / "up" / "state.json").read_text())
        return next(c for c in state["children"] if c["name"] == name)


@pytest.fixture(scope="module")
def up(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("console-up")
    p = start_up(tmp / "home", tiny_llama, free_port(), tmp / "up.log", "--restart-backoff", "0.2")
    u = Up(p, tmp / "home")
    try:
        wait_banner(p)
        yield u
    finally:
        stop(u)


def stop(u: Up) -> None:
    """SIGTERM: the supervisor stops every child in order; then whatever is left of any child's
    process group (a restarted child included) is SIGKILLed."""
    try:
        pids = [
            c["pid"]
            for c in json.loads((u.home / "up" / "state.json").read_text())["children"]
            if c["pid"]
        ]
    except (OSError, ValueError):
        pids = []
    u.proc.terminate()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def tables(d: object) -> dict[str, list[dict[str, str]]]:
    return d.execute_script(_TABLES_JS)  # type: ignore[attr-defined]


def rows_by(d: object, caption: str, key: str) -> dict[str, dict[str, str]]:
    """The rows of table `caption` by their `key` column (a table that says "none" has none)."""
    return {r[key]: r for r in tables(d).get(caption, []) if key in r}


def test_cluster_page_of_duet_up_shows_a_killed_node_restarted_live(
    up: Up,
    browser: object,  # noqa: F811  (the fixture imported above)
) -> None:
    d, base = browser, up.proc.url
    sign_in(d, base, (up.home / "up" / "admin.key").read_text().strip())
    assert d.current_url.endswith("/console/cluster")  # type: ignore[attr-defined]

    # every node of the cluster with its role, ready, not restarted; the coordinator and its leader
    def nodes() -> dict[str, dict[str, str]]:
        return rows_by(d, NODES, "Node")

    wait_for(lambda: all("ready" in nodes().get(n, {}).get("Health", "") for n in ("prefill-0", "decode-0")), 15,
             "both nodes ready on the page")  # fmt: skip
    n = nodes()
    assert {k: (r["Role"], r["Restarts"]) for k, r in n.items()} == {
        "prefill-0": ("prefill", "0"),
        "decode-0": ("decode", "0"),
    }, n
    reps = tables(d)[REPLICAS]
    assert [(r["Replica"], r["Leader"], r["Leader seen"]) for r in reps] == [
        ("coordinator-0", "yes", "coordinator-0")
    ]

    # the supervised processes, none restarted yet
    procs = rows_by(d, PROCS, "Process")
    assert set(procs) == {"etcd", "coordinator", "prefill-0", "decode-0", "gateway"}, procs
    assert all((r["State"], r["Restarts"]) == ("running", "0") for r in procs.values()), procs
    before = up.child("decode-0")
    assert procs["decode-0"]["PID"] == str(before["pid"]), (procs, before)

    # the page stays open: a mark in its window that a reload would wipe
    d.execute_script("window.notReloaded = true")  # type: ignore[attr-defined]
    os.kill(before["pid"], signal.SIGKILL)
    after = wait_for(lambda: (c := up.child("decode-0"))["state"] == "running" and c["restarts"] == 1 and c, 120,
                     "the supervisor to restart decode-0")  # fmt: skip

    def shown() -> bool:
        p, nd = rows_by(d, PROCS, "Process").get("decode-0", {}), nodes().get("decode-0", {})
        return ((p.get("State"), p.get("PID"), p.get("Restarts")) == ("running", str(after["pid"]), "1")
                and "ready" in nd.get("Health", "") and nd.get("Restarts") == "1")  # fmt: skip

    wait_for(shown, 30, "the open page to show decode-0 restarted once and ready")
    assert d.execute_script("return window.notReloaded === true")  # type: ignore[attr-defined]
    assert (
        nodes()["prefill-0"]["Restarts"]
        == rows_by(d, PROCS, "Process")["prefill-0"]["Restarts"]
        == "0"
    )


def test_a_dead_duet_ups_state_file_lists_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    child = {"name": "decode-0", "pid": int(dead.stdout), "state": "running", "restarts": 0}
    (tmp_path / "up").mkdir()
    monkeypatch.setenv("DUET_HOME", str(tmp_path))
    (tmp_path / "up" / "state.json").write_text(
        json.dumps({"pid": int(dead.stdout), "children": [child]})
    )
    assert _supervised() == []
    (tmp_path / "up" / "state.json").write_text(
        json.dumps({"pid": os.getpid(), "children": [child]})
    )
    assert _supervised() == [child]
