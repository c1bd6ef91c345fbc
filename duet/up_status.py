"""`duet status`'s view of the processes a running `duet up` supervises: one row per process
with its state (starting, running, backoff, failed, stopped), pid, restarts, failures in a row,
the last exit (code or signal, and why) and, in backoff, when it starts again.

Reads the `children` list that `duet up` rewrites in `$DUET_HOME/up/state.json` on every
change (duet/supervisor.py::Child.status); a state file from an older `duet up` (no `state`
field) shows what it has. Pure rendering: no process is signalled or asked anything here.
"""

from __future__ import annotations

import time
from typing import Any

from duet.supervisor import exit_cause

_STYLE = {
    "running": "green",
    "starting": "yellow",
    "backoff": "yellow",
    "failed": "bold red",
    "stopped": "dim",
}


def state_cell(c: dict[str, Any], now: float) -> str:
    state = c.get("state") or ("running" if c.get("alive") else "down")
    text = state
    if state == "backoff" and c.get("next_start"):
        text = f"backoff (restart in {max(0.0, c['next_start'] - now):.0f} s)"
    elif state == "failed":
        text = "failed (crash loop: left down)"
    if state in ("running", "starting") and c.get("alive") is False:
        text, state = "dead (not seen yet)", "failed"
    style = _STYLE.get(state)
    return f"[{style}]{text}[/]" if style else text


def last_exit_cell(c: dict[str, Any]) -> str:
    if c.get("last_cause"):
        return str(c["last_cause"])
    return "-" if c.get("last_exit") is None else exit_cause(c["last_exit"])


def process_table(
    children: list[dict[str, Any]], now: float | None = None
) -> Any:  # -> rich.table.Table
    from rich.table import Table

    now = time.time() if now is None else now
    t = Table("process", "state", "pid", "restarts", "failures in a row", "last exit", "url")
    for c in children:
        t.add_row(
            c["name"],
            state_cell(c, now),
            str(c.get("pid") or "-"),
            str(c.get("restarts", 0)),
            str(c.get("failures_in_a_row", 0)),
            last_exit_cell(c),
            c.get("url") or "",
        )
    return t


def failed(children: list[dict[str, Any]]) -> list[str]:
    """Names of the processes left down after a crash loop."""
    return [c["name"] for c in children if c.get("state") == "failed"]
