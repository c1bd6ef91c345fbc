"""The console's Cluster page against a real `duet up` (etcd, coordinator, prefill-0, decode-0,
gateway under its supervisor), in headless Chromium: signed in with the admin key `duet up`
wrote, the page lists every node with its role and the coordinator leader; a SIGKILLed node is
restarted by the supervisor, and the page — left open, never reloaded — shows its restart count
go from 0 to 1 and the node ready again (the live refresh, not a new page load). A node's row
has its process's restarts too. The etcd table, before and after the restart, says what etcd
itself reports (its JSON API, read directly): the endpoint, a recent read without an error
while etcd is healthy, and the counts of node registrations and coordinator replicas. A state file
left by a `duet up` that was SIGKILLed (it could not remove it) lists no process, as `duet status`
ignores it: they are gone, not "running".

One `duet up` on the tiny model (the up-tests' flags: --threads 1, 256 KV blocks), a short
restart backoff so the restart comes at once. Under CI=true a missing browser is a failure
(the browser fixture of test_console.py).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.console.pages.cluster import _supervised
from protocol.cluster import coordinators_prefix, nodes_prefix
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
NODES, PROCS, REPLICAS, ETCD = (
    "Nodes",
    "Processes supervised by duet up",
    "Coordinator replicas",
    "etcd",
)


@dataclass
class Up:
    proc: Proc
    home: Path

    def state(self) -> dict[str, Any]:
        return json.loads((self.home / "up" / "state.json").read_text())

    def child(self, name: str) -> dict[str, Any]:
        return next(c for c in self.state()["children"] if c["name"] == name)


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


def etcd_keys(url: str, prefix: str) -> dict[str, bytes]:
    """The keys under `prefix` as etcd itself reports them: its v3 JSON API (`/v3/kv/range`),
    not the project's client or the gateway's view, which are what the page is checked against."""
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)  # the range [prefix, prefix's successor)
    body = json.dumps(
        {
            "key": base64.b64encode(prefix.encode()).decode(),
            "range_end": base64.b64encode(end.encode()).decode(),
        }
    ).encode()
    req = urllib.request.Request(
        url + "/v3/kv/range", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        kvs = json.loads(r.read()).get("kvs", [])
    return {
        base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")) for kv in kvs
    }


def check_etcd_table(d: object, up: Up, node_ids: set[str]) -> None:
    """The page's etcd table says what etcd says: its endpoint is the one `duet up` started, it
    was read recently without an error while etcd reports itself healthy, and it counts the node
    registrations and coordinator replicas etcd holds — `node_ids`, and each live replica."""
    st = up.state()
    url, cluster = st["etcd"], st["cluster"]
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        assert json.loads(r.read())["health"] == "true"
    nodes = etcd_keys(url, nodes_prefix(cluster))
    assert {json.loads(v)["node_id"] for v in nodes.values()} == node_ids, nodes
    replicas = etcd_keys(url, coordinators_prefix(cluster))
    assert len(replicas) == len(st["coordinators"]) == 1, replicas

    def shown() -> list[dict[str, str]]:
        return tables(d).get(ETCD, [])

    want = {"Endpoint": url, "Registered nodes": str(len(nodes)), "Replicas": str(len(replicas))}
    wait_for(
        lambda: [{k: r[k] for k in want} for r in shown()] == [want],
        15,
        f"the page's etcd table to read {want}",
    )
    [row] = shown()
    # "read N s ago": the gateway reads etcd every 2 s; "last read failed" would be an error
    assert (
        row["State"].startswith("read ")
        and row["State"].endswith(" s ago")
        and "failed" not in row["State"]
    ), row
    assert int(row["State"].split()[1]) < 10, row


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

    wait_for(
        lambda: all(
            "ready" in nodes().get(n, {}).get("Health", "") for n in ("prefill-0", "decode-0")
        ),
        15,
        "both nodes ready on the page",
    )
    n = nodes()
    assert {k: (r["Role"], r["Restarts"]) for k, r in n.items()} == {
        "prefill-0": ("prefill", "0"),
        "decode-0": ("decode", "0"),
    }, n
    reps = tables(d)[REPLICAS]
    assert [(r["Replica"], r["Leader"], r["Leader seen"]) for r in reps] == [
        ("coordinator-0", "yes", "coordinator-0")
    ]
    check_etcd_table(d, up, {"prefill-0", "decode-0"})

    # the supervised processes, none restarted yet
    procs = rows_by(d, PROCS, "Process")
    assert set(procs) == {"etcd", "coordinator", "prefill-0", "decode-0", "gateway"}, procs
    assert all((r["State"], r["Restarts"]) == ("running", "0") for r in procs.values()), procs
    before = up.child("decode-0")
    assert procs["decode-0"]["PID"] == str(before["pid"]), (procs, before)

    # the page stays open: a mark in its window that a reload would wipe
    d.execute_script("window.notReloaded = true")  # type: ignore[attr-defined]
    os.kill(before["pid"], signal.SIGKILL)
    after = wait_for(
        lambda: (c := up.child("decode-0"))["state"] == "running" and c["restarts"] == 1 and c,
        120,
        "the supervisor to restart decode-0",
    )

    def shown() -> bool:
        p, nd = rows_by(d, PROCS, "Process").get("decode-0", {}), nodes().get("decode-0", {})
        return (
            (p.get("State"), p.get("PID"), p.get("Restarts")) == ("running", str(after["pid"]), "1")
            and "ready" in nd.get("Health", "")
            and nd.get("Restarts") == "1"
        )

    wait_for(shown, 30, "the open page to show decode-0 restarted once and ready")
    assert d.execute_script("return window.notReloaded === true")  # type: ignore[attr-defined]
    check_etcd_table(d, up, {"prefill-0", "decode-0"})  # the restarted node registered again, once
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
