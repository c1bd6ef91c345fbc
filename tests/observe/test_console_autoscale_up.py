"""The console's autoscaler decisions under a real `duet up --autoscale`: the planner
in duet up's coordinator takes a load-driven step through the local actuator, and the Cluster
page the gateway serves shows that step as the planner recorded it — same pool, direction,
reason, replicas, drained node, outcome and inputs — while its node table follows the step.

The step: two prefill nodes, the pool's bounds [1, 2], and no traffic. Once the pool's window
is half full the planner finds the pool, at one replica, still well under its SLO, and scales
in (`headroom`): it drains the least loaded prefill node and duet up stops it. No timing
decides anything: the test waits on the planner's record, then on the page.

Read at the HTTP level (the page's live-refresh fragment, `/console/cluster?fragment=1`, and the
full page), signed in with the admin key duet up wrote, so it runs without a browser. The
planner's own record is the leading coordinator's `GET /planner`, behind the cluster secret.
"""

from __future__ import annotations

import http.cookiejar
import json
import re
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gateway.console.autoscaler import describe_inputs
from protocol.planner import DecisionInputs
from tests.duet.test_up import start_up, wait_banner
from tests.observe.test_console_up import NODES, PROCS, Up, stop
from tests.procs import free_port
from tests.wait import wait_for

#: bounds make the step: prefill may go down to 1 (it starts at 2); decode stays at 1. A short
#: tick and window so the idle pool is judged within seconds; the SLO is the shared tier's, set
#: here so the page's figures can be checked against it.
PLANNER = """
[planner]
interval_s = 0.5
window_s = 6
cooldown_s = 30
reverse_cooldown_s = 60
cold_start_s = 1
[planner.bounds]
"prefill" = [1, 2]
"decode" = [1, 1]
[planner.slo.shared]
ttft_s = 2.0
itl_s = 0.5
"""
DECISIONS = "Autoscaler decisions"
POOLS = "Autoscaler pools"


class _Tables(HTMLParser):
    """The page's tables as {caption: [{column: cell text}]}; a table that says "none" has none."""

    def __init__(self) -> None:
        super().__init__()
        self.out: dict[str, list[dict[str, str]]] = {}
        self._caption: str | None = None
        self._head: list[str] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._in_caption = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._caption, self._head = "", []
        elif tag == "caption":
            self._in_caption = True
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "caption":
            self._in_caption = False
            self.out[self._caption or ""] = []
        elif tag in ("td", "th") and self._row is not None and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if not self._head:
                self._head = self._row
            elif len(self._row) == len(self._head):  # a "none" row is one cell across
                self.out[self._caption or ""].append(dict(zip(self._head, self._row, strict=True)))
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._in_caption:
            self._caption = (self._caption or "") + data
        elif self._cell is not None:
            self._cell.append(data)


def tables(html: str) -> dict[str, list[dict[str, str]]]:
    p = _Tables()
    p.feed(html)
    return p.out


class Console:
    """A browser of its own at the HTTP level: a cookie jar, signed in through the sign-in form
    (its double-submit CSRF token) with `key`."""

    def __init__(self, base: str, key: str) -> None:
        self.base = base
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )
        with self.opener.open(base + "/console/login", timeout=10) as r:
            token = re.search(r'name="csrf" value="([^"]+)"', r.read().decode())
        assert token
        form = urllib.parse.urlencode({"csrf": token.group(1), "key": key}).encode()
        with self.opener.open(
            base + "/console/login", data=form, timeout=10
        ) as r:  # 303 → the Cluster page
            assert r.url.endswith("/console/cluster"), r.url

    def get(self, path: str) -> str:
        with self.opener.open(self.base + path, timeout=30) as r:
            assert r.status == 200
            return r.read().decode()

    def cluster(self) -> dict[str, list[dict[str, str]]]:
        """The page's tables as its live refresh reads them."""
        return tables(self.get("/console/cluster?fragment=1"))


def planner(up: Up) -> dict[str, Any]:
    """The leading coordinator's own record (`duet up` runs one replica)."""
    [url] = up.state()["coordinators"]
    secret = (up.home / "up" / "cluster.secret").read_text().strip()
    req = urllib.request.Request(url + "/planner", headers={"Authorization": f"Bearer {secret}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def step_in(report: dict[str, Any]) -> dict[str, Any] | None:
    return next((d for d in report["decisions"] if d["direction"] == "in"), None)


def diagnosis(up: Up, decision: dict[str, Any] | None) -> str:
    """What a failed run needs to be understood from CI's log alone: the planner's decision
    whole (its outcome's detail carries the actuator's error), the coordinator's planner and
    actuator lines, and duet up's own log (the supervisor's "stopping …", "busy" or "took it
    late" lines)."""
    logs = up.home / "logs"
    planner_lines = [
        line
        for line in (logs / "coordinator.log").read_text(errors="replace").splitlines()
        if "duet.planner" in line
    ]
    up_log = up.proc.log()
    return "\n".join(
        [
            f"decision: {json.dumps(decision, indent=1)}",
            "coordinator's planner log:",
            *planner_lines[-20:],
            "duet up's log (last 40 lines):",
            *up_log.splitlines()[-40:],
        ]
    )


@pytest.fixture
def up(tiny_llama: Path, tmp_path: Path) -> Iterator[Up]:
    (tmp_path / "planner.toml").write_text(PLANNER)
    p = start_up(
        tmp_path / "home",
        tiny_llama,
        free_port(),
        tmp_path / "up.log",
        "--prefill",
        "2",
        "--decode",
        "1",
        "--autoscale",
        "--max-nodes",
        "3",
        "--planner-config",
        str(tmp_path / "planner.toml"),
    )
    u = Up(p, tmp_path / "home")
    try:
        wait_banner(p)
        yield u
    finally:
        stop(u)


def test_the_cluster_page_shows_duet_ups_scale_in_as_the_planner_recorded_it(up: Up) -> None:
    console = Console(up.proc.url, (up.home / "up" / "admin.key").read_text().strip())
    layout = {"prefill-0", "prefill-1", "decode-0"}

    # Before the step, the page lists the layout's three nodes. The planner has not stepped
    # when it is read if its record has no step yet (the window is 6 s): then the page must say so.
    before, shown = step_in(planner(up)), console.cluster()
    if before is None:
        assert set(r["Node"] for r in shown[NODES]) == layout, shown[NODES]

    # the planner's step, done: the local actuator drained the node and duet up stopped it
    try:
        done = wait_for(
            lambda: (d := step_in(planner(up))) is not None and d["outcome"] is not None and d,
            60,
            "the planner to scale the idle prefill pool in",
        )
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diagnosis(up, step_in(planner(up)))}") from None
    assert (done["role"], done["reason"], done["current"], done["desired"], done["outcome"]) == (
        "prefill",
        "headroom",
        2,
        1,
        "done",
    ), diagnosis(up, done)
    victim = done["victim"]
    assert victim in {"prefill-0", "prefill-1"}, done
    inputs = done["inputs"]
    assert (inputs["replicas"], inputs["warm"], inputs["bounds"]) == (2, 2, [1, 2]), inputs
    assert inputs["slo"] == {"ttft_s": 2.0, "itl_s": 0.5}, inputs
    assert inputs["load"]["waiting"] == 0 and inputs["at_n_minus_1"]["n"] == 1, inputs
    pool = f"prefill/{done['model']}/{done['tier']}"

    # the page shows that decision as the planner recorded it
    def row() -> dict[str, str] | None:
        return next(
            (r for r in console.cluster().get(DECISIONS, []) if r["Step"] == "scale in"), None
        )

    r = wait_for(
        lambda: (r := row()) is not None and r["Outcome"].startswith("done") and r,
        15,
        "the page to show the finished scale-in",
    )
    assert r == {
        "Time (UTC)": time.strftime("%H:%M:%S", time.gmtime(done["at"])),
        "Pool": pool,
        "Step": "scale in",
        "Reason": "headroom",
        "Replicas": "2 → 1",
        "Node drained": victim,
        "Outcome": f"done: {done['detail']}" if done["detail"] else "done",
        "Inputs": describe_inputs(msgspec.convert(inputs, DecisionInputs)),
    }, (r, done)
    # the inputs read as the figures themselves, not only as the formatter renders them
    for part in (
        "2 replicas (2 warm)",
        "bounds 1–2",
        "load 0 running, 0 waiting",
        "(SLO 2.00 s / 500 ms)",
        "at 1: TTFT",
    ):
        assert part in r["Inputs"], r["Inputs"]
    # only one step was taken, and the page lists no other
    assert [d for d in planner(up)["decisions"] if d["direction"] != "hold"] == [done]
    assert [x["Step"] for x in console.cluster()[DECISIONS]].count("scale in") == 1

    # the node table follows the step: the drained node is gone, the others stay, and the
    # autoscaler's pool row and duet up's processes agree
    def nodes() -> set[str]:
        return {x["Node"] for x in console.cluster()[NODES]}

    wait_for(lambda: nodes() == layout - {victim}, 15, f"the node table without {victim}")
    t = console.cluster()
    assert sum(x["Role"] == "prefill" for x in t[NODES]) == done["desired"], t[NODES]
    assert [(x["Pool"], x["Replicas"]) for x in t[POOLS] if x["Pool"] == pool] == [(pool, "1")], t[
        POOLS
    ]
    assert victim not in {x["Process"] for x in t[PROCS]}, t[PROCS]
    # the full page (not only its live-refresh fragment) carries the same decision, and says
    # who decided: duet up's coordinator, leading, with the local actuator
    html = console.get("/console/cluster")
    page = tables(html)
    intro = re.sub(r"<[^>]+>", "", html.split('<p class="autoscaler">', 1)[1].split("</p>", 1)[0])
    assert intro.startswith("Autoscaler: load mode, local actuator, every 0.5 s;"), intro
    assert intro.endswith(f"on coordinator-0 ({up.state()['coordinators'][0]}), which leads."), (
        intro
    )
    assert [x for x in page[DECISIONS] if x["Step"] == "scale in"] == [r], page[DECISIONS]
